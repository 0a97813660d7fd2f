"""The Celery application: Redis broker in a cluster, in-memory transport when embedded.

Tasks carry ids only; trajectories go straight to the database, never through the broker.
"""

from __future__ import annotations

from celery import Celery

from service.config import Settings, get_settings


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    app = Celery("swerve", broker=settings.broker_url, include=["service.tasks"])
    app.conf.update(
        task_acks_late=True,  # a worker killed mid-episode leaves the task to be redelivered
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 6 * 3600},
        task_default_queue="swerve",
        worker_hijack_root_logger=False,
    )
    return app


app = make_celery()
