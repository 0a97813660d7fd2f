"""Celery tasks. Each is idempotent on its ids (acks_late redelivers after a lost worker)."""

from __future__ import annotations

import os
import socket

from celery import shared_task


@shared_task(name="swerve.ping")
def ping() -> dict:
    """Answer with the worker's identity; used by health checks."""
    return {"host": socket.gethostname(), "pid": os.getpid()}
