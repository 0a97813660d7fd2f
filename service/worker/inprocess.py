"""A Celery worker on a thread of this process: any app configured with a `memory://` broker starts
one, so `swerve serve` works without Redis."""

from __future__ import annotations

import threading
import uuid

from celery import Celery

from service.config import Settings


class InProcessWorker:
    """A Celery worker on a thread of this process; its pool threads hand episodes to the
    process's episode loop (service.worker.runtime)."""

    def __init__(self, celery: Celery, settings: Settings, concurrency: int = 64):
        from celery.worker import WorkController

        from service.worker.runtime import runtime

        runtime(settings)
        celery.finalize()
        started = threading.Event()

        class Controller(WorkController):
            def on_consumer_ready(self, consumer) -> None:
                started.set()

        self.worker = Controller(app=celery, concurrency=concurrency, pool="threads",
                                 queues=[celery.conf.task_default_queue],
                                 hostname=f"embedded-{uuid.uuid4().hex[:6]}@localhost", loglevel="WARNING",
                                 without_heartbeat=True, without_mingle=True, without_gossip=True)
        self.thread = threading.Thread(target=self.worker.start, name="celery-embedded", daemon=True)
        self.thread.start()
        if not started.wait(60):
            raise RuntimeError("the in-process Celery worker did not start within 60 s")

    def stop(self, timeout_s: float = 30.0) -> None:
        from service.worker.runtime import close_runtime

        close_runtime()  # episodes in flight stop (sandboxes closed); a restart picks them up again
        self.worker.stop(in_sighandler=False)
        self.thread.join(timeout_s)
