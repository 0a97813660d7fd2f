"""Start and stop local vLLM servers (the CPU build here, the same flags on GPUs).

vLLM lives in its own virtual environment (its pins clash with ours): SWERVE_VLLM_PYTHON.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
EXTENSION = "service.fleet.extension.SwerveWorkerExtension"


def vllm_python() -> str:
    return os.environ.get("SWERVE_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


@dataclass
class VLLMServer:
    model: Path
    port: int
    host: str = "127.0.0.1"
    served_name: str | None = None
    max_model_len: int = 32768
    dtype: str = "float32"
    device: str = os.environ.get("SWERVE_VLLM_DEVICE", "cpu")
    kv_cache_gb: int = 1
    extra_args: list[str] = field(default_factory=list)
    cache_dir: Path = REPO / "var" / "vllm-cache"
    log_path: Path | None = None
    die_with_parent: bool = False
    """The server gets SIGTERM when the process that started it dies, even by SIGKILL (a job's
    own server; start it from the main thread: the signal follows the thread that forked)."""
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model), "--served-model-name", self.served_name or self.model.name,
               "--host", self.host, "--port", str(self.port), "--max-model-len", str(self.max_model_len),
               "--dtype", self.dtype, "--worker-extension-cls", EXTENSION,
               "--disable-log-stats", "--enable-prefix-caching"]
        if self.device == "cpu":
            cmd.append("--enforce-eager")
        return cmd + self.extra_args

    def env(self) -> dict[str, str]:
        (self.cache_dir / "tmp").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "HOME": str(self.cache_dir),
               "VLLM_CACHE_ROOT": str(self.cache_dir / "vllm"), "TMPDIR": str(self.cache_dir / "tmp"),
               "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
        # VLLM_ENABLE_V1_MULTIPROCESSING=0 on CPU: the model runs in the engine's process (the
        # "uni" executor). With it on, vLLM's CPU platform forces the "mp" executor, a worker
        # process beside the engine; each waits for the other's next message on shared memory by
        # spinning (sched_yield) for a second after every read, so under steady load both burn a
        # core. On 2 cores that is the CPU the RL job's trainer, sandboxes and grading need: during a
        # demo evaluation the engine and its worker took 45 and 57 s of CPU a minute, the job 6
        # (bench/vllm_cpu.py measures both executors side by side).
        if self.device == "cpu":
            env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
                    "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                    "VLLM_ENABLE_V1_MULTIPROCESSING": env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
        return env

    def start(self) -> VLLMServer:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent if self.die_with_parent else None)
        return self

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} before it was ready; "
                                   f"see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM on {self.url} not ready after {timeout_s} s")

    def served_version(self) -> str | None:
        return httpx.get(f"{self.url}/weight_info", timeout=5).json().get("weight_version")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM when its parent dies (Linux PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def set_version(url: str, version: int) -> None:
    httpx.post(f"{url}/update_weight_version", json={"new_version": str(version)}, timeout=30).raise_for_status()


if __name__ == "__main__":
    server = VLLMServer(Path(sys.argv[1]), int(sys.argv[2]))
    print(" ".join(server.command()))
