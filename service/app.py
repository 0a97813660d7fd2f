"""The FastAPI application: REST under /api/v1, OpenAPI at /docs."""

from __future__ import annotations

import logging
import math
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from service.store import db
from service.api.routes import evaluations, health, runs, suites, tasks
from service.config import Settings, get_settings, is_loopback
from service.control.evaluations import EvaluationExists
from service.control.suites import SuiteNameTaken, SuiteRejected, UploadTooLarge
from service.control.views import NotFound, TokenizerUnavailable

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.engine = db.make_async_engine(settings.resolved_database_url)
        app.state.sessions = db.session_factory(app.state.engine)
        app.state.background = set()
        from service.worker.app import make_celery

        app.state.celery = make_celery(settings)
        app.state.worker = None
        if settings.broker_url.startswith("memory://") and settings.embedded_worker:
            from service.worker.inprocess import InProcessWorker

            app.state.worker = InProcessWorker(app.state.celery, settings, settings.embedded_worker_concurrency)
        app.state.supervisor = _supervisor(app, settings)
        app.state.supervisor.run_in_background()  # runs left active by a dead process are taken over
        app.state.evaluations = _evaluations(app, settings)
        app.state.evaluations.run_in_background()
        from service.control.validation import ValidationSupervisor

        app.state.validations = ValidationSupervisor(app.state.engine, settings, app.state.supervisor.owner,
                                                     lease_s=settings.orchestrator_lease_s)
        app.state.validations.run_in_background()  # validations left running by a dead process are taken over
        yield
        # each part stopped whatever the others did: a worker that failed to stop in time must
        # not leave the engine's connections (and, on SQLite, a write lock) behind
        for what, close in (("validations", app.state.validations.close), ("evaluations", app.state.evaluations.close),
                            ("orchestrators", app.state.supervisor.close)):
            try:
                await close()
            except Exception:
                logger.exception("stopping the %s failed", what)
        if app.state.worker is not None:
            try:
                app.state.worker.stop()
            except Exception:
                logger.exception("stopping the in-process worker failed")
        for job in list(app.state.background):
            job.cancel()
        await app.state.engine.dispose()

    app = FastAPI(title="swerve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Rollout service for RL of coding agents.")  # /docs: service.ui, no CDN
    app.state.settings = settings
    for module in (health, suites, tasks, runs, evaluations):
        app.include_router(module.router, prefix="/api/v1")
    _add_error_handlers(app)
    app.add_middleware(RefuseNul)
    if settings.local_mode:
        app.add_middleware(CheckHost, allowed=settings.allowed_host_list)

    from service import ui

    ui.mount(app)
    return app


class CheckHost:
    """Local mode answers only requests addressed to loopback (or SWERVE_ALLOWED_HOSTS): a web
    page whose name an attacker points at 127.0.0.1 (DNS rebinding) sends its own Host header,
    and is refused (400) before any route, so it can neither read nor change anything."""

    def __init__(self, app, allowed: tuple[str, ...] = ()):
        self.app, self.allowed = app, set(allowed)

    def allows(self, host_header: str) -> bool:
        if "*" in self.allowed:
            return True
        host = host_header.strip().lower()
        if host.startswith("["):  # [::1]:8000
            host = host[1:].split("]", 1)[0]
        elif host.count(":") == 1:
            host = host.split(":", 1)[0]
        return is_loopback(host) or host in self.allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            host = dict(scope.get("headers") or ()).get(b"host", b"").decode("latin-1")
            if not self.allows(host):
                response = JSONResponse({"detail": f"Host {host[:100]!r} is not this local service's: local mode "
                                                   "answers loopback only; the operator allows more names with "
                                                   "SWERVE_ALLOWED_HOSTS"}, status_code=400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RefuseNul:
    """A NUL byte in the path or the query string is refused (422, naming where) before any
    route: no database stores one in text, and Postgres would answer the query with an error."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            from urllib.parse import parse_qsl

            loc = None
            if b"%00" in scope.get("raw_path", b"").lower() or "\x00" in scope.get("path", ""):
                loc = ["path"]
            else:
                query = scope.get("query_string", b"").decode("latin-1")
                loc = next((["query", k.replace("\x00", "")] for k, v in parse_qsl(query, keep_blank_values=True)
                            if "\x00" in k or "\x00" in v), None)
            if loc is not None:  # FastAPI's shape for a bad parameter
                where = "the path" if loc == ["path"] else f"query parameter {loc[1]!r}"
                response = JSONResponse({"detail": [{"type": "nul_byte", "loc": loc,
                                                     "msg": f"{where} holds a NUL byte (%00); remove it"}]},
                                        status_code=422)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _supervisor(app: FastAPI, settings: Settings):
    from service.control.orchestrator import Supervisor
    from service.worker.app import episode_sender

    return Supervisor(app.state.engine, episode_sender(app.state.celery), lease_s=settings.orchestrator_lease_s)


def _evaluations(app: FastAPI, settings: Settings):
    from service.control.evaluations import EvaluationSupervisor
    from service.worker.app import prediction_sender

    return EvaluationSupervisor(app.state.engine, prediction_sender(app.state.celery), app.state.supervisor.owner,
                                lease_s=settings.orchestrator_lease_s)


ERROR_STATUS = {UploadTooLarge: 413, NotFound: 404, TokenizerUnavailable: 409, SuiteNameTaken: 409,
                EvaluationExists: 409}
"""The control plane's errors and the HTTP status each answers with ({"detail": message})."""


def _finite(value):
    """A value as JSON can carry it: a float that is not finite becomes its name ("inf", "nan")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer echoes the input, which JSON cannot carry when it is NaN or Infinity
        return JSONResponse({"detail": _finite(jsonable_encoder(exc.errors(), custom_encoder={float: lambda f: f}))},
                            status_code=422)

    @app.exception_handler(SuiteRejected)
    async def _rejected(_: Request, exc: SuiteRejected) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=422)

    async def _detail(_: Request, exc: Exception) -> JSONResponse:
        status = next(code for error, code in ERROR_STATUS.items() if isinstance(exc, error))
        return JSONResponse({"detail": str(exc)}, status_code=status)

    for error in ERROR_STATUS:
        app.add_exception_handler(error, _detail)
