"""A vLLM worker extension (loaded inside vLLM's process with --worker-extension-cls).

Imports only vLLM and torch. Reached through POST /collective_rpc {"method": NAME, ...}.
"""

from __future__ import annotations



class SwerveWorkerExtension:
    def swerve_reload_weights(self, weights_path: str) -> int:
        """Reload weights in place from a checkpoint folder. On CPU, vLLM's in-place reload
        leaves two kinds of layer on stale kernel weights, so they are prepared again as a
        fresh load would: MoE experts (left in checkpoint layout while the CPU grouped-gemm
        kernel expects them prepacked) and a vocabulary head tied to the embedding (the
        checkpoint has no weight of its own for it, so the reload skips it and its prepacked
        GEMM keeps the old embedding: the served logits were the old policy's). Returns the
        layers prepared again."""
        from vllm.platforms import current_platform

        runner = self.model_runner
        runner.reload_weights(weights_path=weights_path)
        if not current_platform.is_cpu():
            return 0
        model = runner.get_model()
        repacked = 0
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and "CPU" in type(experts).__name__:
                experts.process_weights_after_loading(module)
                repacked += 1
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        weight = getattr(head, "weight", None)
        if weight is not None and embed is not None and weight is getattr(embed, "weight", None):
            head.quant_method.process_weights_after_loading(head)
            repacked += 1
        return repacked
