"""The FastAPI application: REST under /api/v1, OpenAPI at /docs."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from service.store import db
from service.api.routes import evaluations, health, runs, suites, tasks
from service.config import Settings, get_settings
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
        yield
        await app.state.evaluations.close()
        await app.state.supervisor.close()
        if app.state.worker is not None:
            app.state.worker.stop()
        for job in list(app.state.background):
            job.cancel()
        await app.state.engine.dispose()

    app = FastAPI(title="swerve", version="0.1.0", lifespan=lifespan,
                  description="Rollout service for RL of coding agents.")
    app.state.settings = settings
    for module in (health, suites, tasks, runs, evaluations):
        app.include_router(module.router, prefix="/api/v1")
    _add_error_handlers(app)

    from service import ui

    ui.mount(app)
    return app


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


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SuiteRejected)
    async def _rejected(_: Request, exc: SuiteRejected) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=422)

    async def _detail(_: Request, exc: Exception) -> JSONResponse:
        status = next(code for error, code in ERROR_STATUS.items() if isinstance(exc, error))
        return JSONResponse({"detail": str(exc)}, status_code=status)

    for error in ERROR_STATUS:
        app.add_exception_handler(error, _detail)
