"""What a token holder may ask of this service, checked when a run or a suite is created: the
operator's ceilings on a run's limits (settings), inference endpoints only over http(s) to
allowed hosts, tokenizers only from model folders or the model the run's own endpoints serve,
task sources only under allowed roots. A
run that passes starts; one that does not is a 422 naming the field and the setting that
would allow it, so no run is created that cannot do what it asks."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from service.config import Settings, is_loopback
from service.worker.config import RunConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class AdmissionError(ValueError):
    """A request asks for more than this service allows; the message names each field."""


async def check_run(cfg: RunConfig, settings: Settings) -> None:
    """Raise AdmissionError listing every field of `cfg` this service does not allow."""
    problems = _ceilings(cfg, settings)
    endpoints = []
    if cfg.sampler.type == "vllm":
        endpoints = [p for i, url in enumerate(cfg.sampler.endpoints)
                     if (p := endpoint_problem(url, settings, f"sampler.endpoints[{i}]"))]
    tokenizer = _tokenizer(cfg)
    if not tokenizer and not _under_model_roots(cfg.sampler.tokenizer, settings):
        heard = await _served_by_endpoints(cfg, settings) if cfg.sampler.type == "vllm" and not endpoints else ""
        if heard is not None:
            roots = ", ".join(map(str, settings.model_root_list))
            tokenizer = [f"sampler.tokenizer: {cfg.sampler.tokenizer} is not under a model folder of this service "
                         f"({roots}; SWERVE_MODEL_ROOTS adds folders"
                         + (f", nor the model folder its endpoints serve: {heard})" if heard else ")")]
    problems += tokenizer + endpoints
    if problems:
        raise AdmissionError("; ".join(problems))


def _ceilings(cfg: RunConfig, settings: Settings) -> list[str]:
    lim = cfg.limits
    asked = [("limits.memory_mb", lim.memory_mb, settings.max_memory_mb, "MAX_MEMORY_MB"),
             ("limits.cpus", lim.cpus, settings.max_cpus, "MAX_CPUS"),
             ("limits.pids", lim.pids, settings.max_pids, "MAX_PIDS"),
             ("limits.disk_mb", lim.disk_mb, settings.max_disk_mb, "MAX_DISK_MB"),
             ("limits.command_timeout_s", lim.command_timeout_s, settings.max_command_timeout_s,
              "MAX_COMMAND_TIMEOUT_S"),
             ("limits.lifetime_s", lim.lifetime_s, settings.max_sandbox_lifetime_s, "MAX_SANDBOX_LIFETIME_S"),
             ("limits.output_limit_bytes", lim.output_limit_bytes, settings.max_output_limit_bytes,
              "MAX_OUTPUT_LIMIT_BYTES"),
             ("agent.wall_clock_s", cfg.agent.wall_clock_s, settings.max_sandbox_lifetime_s, "MAX_SANDBOX_LIFETIME_S"),
             ("worker_timeout_s", cfg.worker_timeout_s, settings.max_worker_timeout_s, "MAX_WORKER_TIMEOUT_S"),
             ("queue_timeout_s", cfg.queue_timeout_s, settings.max_worker_timeout_s, "MAX_WORKER_TIMEOUT_S")]
    return [f"{field}: {value:g} is above this service's ceiling of {ceiling:g} (SWERVE_{setting})"
            for field, value, ceiling, setting in asked if value > ceiling]


def _tokenizer(cfg: RunConfig) -> list[str]:
    path = Path(cfg.sampler.tokenizer)
    try:
        if not path.is_dir():
            return [f"sampler.tokenizer: {str(path)[:300]!r} is not a folder (give the model folder the servers serve)"]
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            return [f"sampler.tokenizer: {path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})"]
    except OSError as e:  # a name too long, a folder this service may not read
        return [f"sampler.tokenizer: {str(path)[:300]!r} cannot be read ({e.strerror or type(e).__name__}); give the "
                "model folder the servers serve"]
    return []


def _under_model_roots(path: str, settings: Settings) -> bool:
    real = Path(os.path.realpath(path))
    return any(real.is_relative_to(os.path.realpath(root)) for root in settings.model_root_list)


async def _served_by_endpoints(cfg: RunConfig, settings: Settings) -> str | None:
    """None if one of the run's endpoints serves the tokenizer's folder (vLLM names the folder
    it loaded as `root` in /v1/models): the policy's own model is its tokenizer wherever it is.
    Else what each endpoint answered."""
    import httpx

    from service.fleet.client import served_models

    real = os.path.realpath(cfg.sampler.tokenizer)
    heard = []
    async with httpx.AsyncClient(timeout=settings.admission_probe_timeout_s, follow_redirects=False) as http:
        for url in cfg.sampler.endpoints:
            try:
                served = served_models((await http.get(f"{url.rstrip('/')}/v1/models")).raise_for_status().json())
            except (httpx.HTTPError, ValueError) as e:
                heard.append(f"{url} did not answer /v1/models ({type(e).__name__})")
                continue
            if isinstance(served, str):
                heard.append(f"{url} answered {served}")
                continue
            roots = [m["root"] for m in served if isinstance(m.get("root"), str)]
            if any(os.path.isabs(root) and os.path.realpath(root) == real for root in roots):
                return None
            heard.append(f"{url} serves {', '.join(map(repr, roots)) or 'no model folder it names'}")
    return "; ".join(heard)


def endpoint_problem(url: str, settings: Settings, field: str) -> str | None:
    """Why a run may not sample from `url` (None: it may): http(s) only, to a host the operator
    allowed (SWERVE_ENDPOINT_HOSTS), or to loopback in local mode."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"{field}: {url!r} is not a URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{field}: {url!r} must be an http:// or https:// URL with a host"
    if parts.username or parts.password:
        return f"{field}: {url!r} must not carry credentials"
    host = parts.hostname
    allowed = settings.endpoint_host_list
    if "*" in allowed or host in allowed or (port is not None and f"{host}:{port}" in allowed):
        return None
    if settings.local_mode and is_loopback(host):
        return None
    return (f"{field}: host {host!r} of {url} is not an allowed inference host; the operator allows it "
            f"with SWERVE_ENDPOINT_HOSTS (comma-separated{'; loopback is allowed in local mode' if settings.local_mode else ''})")
