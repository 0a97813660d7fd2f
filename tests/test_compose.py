"""docker-compose.yml and the Dockerfile are valid as Compose reads them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import missing_service

ROOT = Path(__file__).resolve().parent.parent


def compose_command() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    missing_service("docker compose (or docker-compose)")


def compose_config(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(compose_command() + ["-f", str(ROOT / "docker-compose.yml"), "config"],
                          cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)


def test_compose_config_validates():
    result = compose_config({"SWERVE_API_TOKEN": "x" * 24})
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert {"postgres", "redis", "api", "worker"} <= set(config["services"])
    for name in ("postgres", "redis", "api", "worker"):
        assert "healthcheck" in config["services"][name], name
    assert config["services"]["api"]["environment"]["SWERVE_BROKER_URL"].startswith("redis://")


def test_compose_demands_an_api_token():
    env = {k: v for k, v in os.environ.items() if k != "SWERVE_API_TOKEN"}
    result = subprocess.run(compose_command() + ["-f", str(ROOT / "docker-compose.yml"), "config"],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "SWERVE_API_TOKEN" in result.stderr


def test_dockerfile_copies_every_package():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("service", "envs", "sandboxes", "trainer"):
        assert f"COPY {package} ./{package}" in dockerfile


def test_the_installed_package_carries_its_migrations_and_example_suite(tmp_path):
    """The app image installs swerve as a wheel (not from the checkout): what it reads from beside
    its modules (Alembic's versions, the example suite's bundles, the UI's files) must be in it."""
    import zipfile

    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    names = set(zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist())
    versions = {f"service/store/migrations/versions/{p.name}"
                for p in (ROOT / "service/store/migrations/versions").glob("*.py")}
    assert versions and versions <= names
    assert {"service/store/migrations/env.py", "service/store/migrations/script.py.mako"} <= names
    bundles = {f"envs/example_suite/bundles/{p.name}" for p in (ROOT / "envs/example_suite/bundles").iterdir()}
    assert bundles and bundles <= names
    assert {"envs/example_suite/suite.jsonl", "envs/example_suite/rl.toml", "service/ui/templates/base.html",
            "service/fleet/assets/tokenizer_corpus.txt", "envs/words.txt"} <= names


@pytest.mark.parametrize(("profile", "service"), [("gpu", "vllm"), ("cpu", "vllm-cpu")])
def test_inference_profiles(profile, service):
    result = subprocess.run(compose_command() + ["-f", str(ROOT / "docker-compose.yml"), "--profile",
                                                 profile, "config"],
                            cwd=ROOT, env={**os.environ, "SWERVE_API_TOKEN": "x" * 24},
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    vllm = yaml.safe_load(result.stdout)["services"][service]
    assert "service.fleet.extension.SwerveWorkerExtension" in vllm["command"]
    assert vllm["environment"]["VLLM_SERVER_DEV_MODE"] == "1"


def test_rl_profile_runs_the_job_against_the_cluster():
    result = subprocess.run(compose_command() + ["-f", str(ROOT / "docker-compose.yml"), "--profile", "rl", "config"],
                            cwd=ROOT, env={**os.environ, "SWERVE_API_TOKEN": "x" * 24}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    trainer, vllm = services["trainer"], services["vllm-rl"]
    assert trainer["command"][:2] == ["swerve", "rl"] and trainer["restart"] == "on-failure"  # restarted: resumes
    assert '--inference.endpoints=["http://vllm-rl:8100"]' in trainer["command"]
    assert trainer["environment"]["SWERVE_DATABASE_URL"].startswith("postgresql://")
    assert trainer["environment"]["SWERVE_BROKER_URL"].startswith("redis://")
    assert trainer["build"]["args"]["EXTRAS"] == "[model,trainer]"
    assert "service.fleet.extension.SwerveWorkerExtension" in vllm["command"]
    assert {"vllm-rl", "api", "worker"} <= set(trainer["depends_on"])
    assert "model-init" in vllm["depends_on"]


def test_the_build_context_carries_the_sources_and_no_environment(tmp_path):
    """What `docker build .` sends the engine, as the Docker client reads .dockerignore: the
    sources the Dockerfiles copy, and none of the virtual environments, caches and data a
    working copy holds (a .venv-vllm alone is gigabytes, sent again by every build)."""
    from docker.utils.build import exclude_paths

    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    # a working copy's heavy folders, made here so the check does not depend on this checkout
    work = tmp_path / "repo"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", ".venv*", "var", "build", "*.egg-info"))
    for folder in (".venv/lib", ".venv-vllm/lib", "var/images", "build/lib", ".cache/pip", "swerve.egg-info"):
        (work / folder).mkdir(parents=True, exist_ok=True)
        (work / folder / "heavy.bin").write_bytes(b"\0" * 1024)
    sent = exclude_paths(str(work), patterns)
    assert not [p for p in sent if p.endswith("heavy.bin")], sorted(p for p in sent if p.endswith("heavy.bin"))
    for needed in ("pyproject.toml", "README.md", "service/cli.py", "service/store/migrations/env.py",
                   "sandboxes/docker.py", "trainer/__init__.py", "envs/example_suite/suite.jsonl"):
        assert needed in sent, needed
