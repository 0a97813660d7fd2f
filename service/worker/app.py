"""The Celery application: Redis broker in a cluster, in-memory transport when embedded.

Tasks carry ids only; trajectories go straight to the database, never through the broker.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from celery import Celery
from kombu.transport import redis as kombu_redis

from service.config import Settings, get_settings

QUEUE = "swerve"
"""The workers' queue on a shared broker (`swerve worker --queues=swerve`)."""

logger = logging.getLogger(__name__)


class _QoS(kombu_redis.QoS):
    def restore_unacked_once(self, stderr=None):
        # kombu 5.7 fails here (and in ack/reject of deliveries made before) with AttributeError
        # once the broker went away and the consumer dropped the connection: the worker dies
        # instead of reconnecting.
        # Giving the messages back is only an optimisation: the orchestrator sends again
        # episodes that no worker started.
        try:
            return super().restore_unacked_once(stderr)
        except Exception as e:  # noqa: BLE001 - see above
            logger.warning("could not give unacknowledged messages back to the broker: %r", e)


    def ack(self, delivery_tag):
        try:
            return super().ack(delivery_tag)
        except AttributeError as e:  # a delivery of a connection lost since: nothing to remove
            logger.warning("could not acknowledge a delivery of a lost broker connection: %r", e)

    def reject(self, delivery_tag, requeue=False):
        try:
            return super().reject(delivery_tag, requeue=requeue)
        except AttributeError as e:
            logger.warning("could not reject a delivery of a lost broker connection: %r", e)


class _Channel(kombu_redis.Channel):
    QoS = _QoS


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport, surviving a broker restart (see _QoS)."""

    Channel = _Channel


def make_celery(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    app = Celery("swerve", broker=settings.broker_url, include=["service.worker.tasks"])
    # kombu's memory transport keeps one set of queues per process, whatever the connection, so
    # every app on memory:// gets a queue of its own: a worker an earlier app left behind (a
    # test's, an earlier stage of a demo, on another database) never takes this app's tasks
    queue = f"{QUEUE}-{uuid.uuid4().hex[:12]}" if settings.broker_url.startswith("memory://") else QUEUE
    if settings.broker_url.startswith(("redis://", "rediss://")):
        app.conf.broker_transport = "service.worker.app:RedisTransport"
    app.conf.update(
        task_acks_late=True,  # a worker killed mid-episode leaves the task to be redelivered
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 6 * 3600},
        task_default_queue=queue,
        worker_hijack_root_logger=False,
    )
    return app


app = make_celery()


def episode_sender(celery: Celery) -> Callable[[str], None]:
    """What the orchestrator calls to hand an episode id to the workers (the `swerve.episode` task)."""

    def send(episode_id: str) -> None:
        celery.send_task("swerve.episode", args=[episode_id], queue=celery.conf.task_default_queue)

    return send



def prediction_sender(celery: Celery) -> Callable[[str, str, int], None]:
    """What an evaluation's owner calls to hand a prediction to the workers."""

    def send(evaluation_id: str, instance_id: str, attempt: int) -> None:
        celery.send_task("swerve.grade_prediction", args=[evaluation_id, instance_id, attempt],
                         queue=celery.conf.task_default_queue)

    return send
