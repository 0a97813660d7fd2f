"""A vLLM worker extension (loaded inside vLLM's process with --worker-extension-cls).

Imports only vLLM and torch. Reached through POST /collective_rpc {"method": NAME, ...}.
"""

from __future__ import annotations



class SwerveWorkerExtension:
    def swerve_reload_weights(self, weights_path: str) -> int:
        """Reload weights in place from a checkpoint folder. On CPU, vLLM's in-place reload
        leaves MoE expert weights in checkpoint layout while the CPU grouped-gemm kernel
        expects them prepacked: repack them as a fresh load would. Returns layers repacked."""
        from vllm.platforms import current_platform

        runner = self.model_runner
        runner.reload_weights(weights_path=weights_path)
        if not current_platform.is_cpu():
            return 0
        repacked = 0
        for module in runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and "CPU" in type(experts).__name__:
                experts.process_weights_after_loading(module)
                repacked += 1
        return repacked
