"""Deployment settings (env prefix SWERVE_); a bad value fails at start naming its variable."""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from typing import Literal
from pathlib import Path

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "SWERVE_"


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names the environment variable."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_file=".env", extra="ignore", frozen=True
    )

    data_dir: Path = Path("var")
    """Where the embedded database, environments, weights and logs live (relative to cwd)."""
    database_url: str = ""
    """SQLAlchemy URL. Empty means an SQLite file `swerve.db` under `data_dir`."""
    broker_url: str = "memory://"
    """Celery broker. `memory://` runs an in-process worker; `redis://host:6379/0` in a cluster."""
    embedded_worker: bool = True
    """With a memory:// broker, the API process runs the Celery worker itself (embedded mode)."""
    embedded_worker_concurrency: int = Field(64, ge=1)
    """Episodes in flight in the embedded worker."""
    api_token: str | None = None
    """Bearer token for mutating API calls. None: local mode, the service binds 127.0.0.1 only."""
    models_dir: Path | None = None
    """Where local models are created and served from. None means `data_dir/models`."""
    max_upload_bytes: int = Field(512 * 1024 * 1024, gt=0)
    """Largest suite upload accepted (bytes); larger uploads answer 413."""
    max_record_bytes: int = Field(64 * 1024 * 1024, gt=0)
    """Largest single task record of a suite upload (bytes); a larger one is a record error
    (422) and is never held in memory whole."""
    max_listed_errors: int = Field(1000, gt=0)
    """How many record errors a refused suite upload lists (the total is always given)."""
    orchestrator_lease_s: float = Field(15.0, gt=0)
    """A run whose orchestrator has not renewed its lease for this long is taken over by
    another process (the owner renews it every half second)."""
    log_format: str = "text"
    """`text` for people, `json` for containers."""
    worker_event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """The event loop under a worker's episodes: uvloop's (libuv, in C; 7-10% less of the
    worker's CPU a turn in bench/rollouts.py) or asyncio's own."""

    # What a run or suite may ask for: checked when it is created, so a bad value is a 422
    # naming the field, never a run that cannot end (service.control.admission).
    max_memory_mb: int = Field(65536, ge=16)
    """Ceiling on a run's `limits.memory_mb` (MiB)."""
    max_cpus: float = Field(64.0, gt=0, allow_inf_nan=False)
    """Ceiling on `limits.cpus`."""
    max_pids: int = Field(16384, ge=8)
    """Ceiling on `limits.pids`."""
    max_disk_mb: int = Field(262144, ge=16)
    """Ceiling on `limits.disk_mb` (MiB)."""
    max_command_timeout_s: float = Field(6 * 3600.0, gt=0, allow_inf_nan=False)
    """Ceiling on `limits.command_timeout_s`."""
    max_sandbox_lifetime_s: float = Field(48 * 3600.0, gt=0, allow_inf_nan=False)
    """Ceiling on `limits.lifetime_s` and on the agent's `wall_clock_s`."""
    max_output_limit_bytes: int = Field(16 * 1024 * 1024, ge=256)
    """Ceiling on `limits.output_limit_bytes`."""
    max_worker_timeout_s: float = Field(24 * 3600.0, gt=0, allow_inf_nan=False)
    """Ceiling on a run's `worker_timeout_s` and `queue_timeout_s`."""
    endpoint_hosts: str = ""
    """Hosts a run's `sampler.endpoints` may name, comma-separated (`host` or `host:port`; `*`
    any). Loopback is allowed too in local mode. Endpoints must be http(s) either way."""
    model_roots: str = ""
    """Folders a run's `sampler.tokenizer` may come from besides the models folder,
    comma-separated (in local mode too). Outside them only the folder the run's own endpoints
    serve (vLLM's `root` in /v1/models) is taken."""
    admission_probe_timeout_s: float = Field(5.0, gt=0, le=60)
    """How long run admission waits for an endpoint's /v1/models when the tokenizer is outside
    the model folders."""
    source_roots: str = ""
    """Host folders a task's local `source` may be under, comma-separated. Empty: none with a
    token set (git URLs and `bundle:NAME` only); any in local mode."""
    allowed_hosts: str = ""
    """Host names the API answers to besides loopback's in local mode, comma-separated (`*`
    any): a page elsewhere cannot reach a local service by DNS rebinding."""

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, url: str) -> str:
        if url and not url.startswith(("sqlite", "postgresql", "postgres")):
            raise ValueError("must be an sqlite:// or postgresql:// URL")
        return url

    @field_validator("api_token")
    @classmethod
    def _strong_token(cls, token: str | None) -> str | None:
        if token is not None and len(token) < 16:
            raise ValueError("must be at least 16 characters (or unset for local mode)")
        return token or None

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, value: str) -> str:
        if value not in ("text", "json"):
            raise ValueError("must be 'text' or 'json'")
        return value

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'swerve.db').resolve()}"

    @property
    def resolved_models_dir(self) -> Path:
        return self.models_dir or self.data_dir / "models"

    @property
    def local_mode(self) -> bool:
        return self.api_token is None

    @property
    def endpoint_host_list(self) -> tuple[str, ...]:
        return _items(self.endpoint_hosts)

    @property
    def model_root_list(self) -> tuple[Path, ...]:
        return (self.resolved_models_dir, *map(Path, _items(self.model_roots)))

    @property
    def source_root_list(self) -> tuple[Path, ...] | None:
        """None: any local source (local mode without the setting)."""
        roots = tuple(map(Path, _items(self.source_roots)))
        return None if not roots and self.local_mode else roots

    @property
    def allowed_host_list(self) -> tuple[str, ...]:
        return _items(self.allowed_hosts)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, without port) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _items(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def load_settings(**overrides) -> Settings:
    """Build settings from the environment; raise SettingsError naming each bad variable."""
    try:
        return Settings(**overrides)
    except ValidationError as e:
        problems = [
            f"{ENV_PREFIX}{str(err['loc'][0]).upper()}: {err['msg']}" for err in e.errors()
        ]
        raise SettingsError("invalid settings: " + "; ".join(problems)) from e


@lru_cache
def get_settings() -> Settings:
    return load_settings()
