"""Celery tasks. Each carries ids only and is idempotent on them (acks_late redelivers after a
lost worker; the episode then restarts cleanly)."""

from __future__ import annotations

import os
import socket
import uuid

from celery import shared_task


@shared_task(name="swerve.ping")
def ping() -> dict:
    """Answer with the worker's identity; used by health checks."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


@shared_task(name="swerve.episode", acks_late=True, reject_on_worker_lost=True)
def episode(episode_id: str) -> str | None:
    """Run one episode to its final status on this process's shared event loop; trajectories
    go to the database, not the broker."""
    from concurrent.futures import CancelledError

    from service.worker.runtime import runtime

    try:
        return runtime().run(uuid.UUID(episode_id))
    except CancelledError:  # the process is shutting down: the episode's heartbeat lapses and it restarts
        return None


@shared_task(name="swerve.grade_prediction", acks_late=True, reject_on_worker_lost=True)
def grade_prediction(evaluation_id: str, instance_id: str, attempt: int) -> str | None:
    """Grade one prediction of an evaluation (service.control.evaluations), this attempt only."""
    from concurrent.futures import CancelledError

    from service.worker.grading import grade_prediction as grade
    from service.worker.runtime import runtime

    try:
        return runtime().call(grade, uuid.UUID(evaluation_id), instance_id, attempt)
    except CancelledError:  # shutting down: the heartbeat lapses and the prediction is handed over again
        return None
