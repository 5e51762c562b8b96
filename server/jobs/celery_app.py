"""The Celery app of the compute plane.

Tasks are idempotent on their run id, so they run with late acks: a worker killed mid-task (even kill -9)
leaves the message unacked and the broker redelivers it (``task_reject_on_worker_lost``). The Redis
visibility timeout is far longer than any task (a launch takes about a second), so a slow task is never
handed to a second worker while the first still runs it. Without ``CELERY_BROKER_URL`` the broker is a
folder in ASYNCRL_HOME (kombu's filesystem transport): embedded mode needs no Redis.

Celery beat enqueues ``asyncrl.reconcile`` every ``RECONCILE_INTERVAL_S``; ``asyncrl worker`` embeds beat
(``-B``, schedule file in ASYNCRL_HOME) unless ``--no-beat`` (then run one ``celery -A server.jobs.celery_app beat``).
Beat also enqueues ``asyncrl.check_stalls`` (``stall`` alert rules) every ``ALERT_STALL_CHECK_S`` and
``asyncrl.tick_sweeps`` (prune and start the trials of running sweeps) and ``asyncrl.tick_pipelines`` (start the
next stage of running pipelines) every ``SWEEP_TICK_S``.

Exports (``asyncrl.export_run``: minutes and GiBs of memory each) go to a queue of their own
(``settings.export_queue``), consumed by the export worker ``asyncrl worker`` starts beside its control-plane
worker (``--export-concurrency``), so a long export never holds the slot a launch or a reconcile needs. A delivery of
an export killed mid-task (out of memory) is redelivered like any other, at most ``EXPORT_MAX_DELIVERIES`` times
(``server.jobs.tasks.export`` counts them in the run's events).

The server enqueues tasks by name (:class:`TaskName`, :func:`enqueue`), never importing ``server.jobs.tasks``:
the tasks call the services, so the services must not call the tasks.
"""

from __future__ import annotations

import enum

from celery import Celery
from celery.signals import beat_embedded_init
from kombu.exceptions import KombuError
from kombu.utils.url import maybe_sanitize_url
from redis.exceptions import RedisError

from server.core.config import settings
from server.jobs.embedded_broker import register as register_embedded_broker
from server.jobs.heartbeat import Heartbeat
from worker.run.procs import die_with_parent


def _transport_options() -> dict[str, object]:
    if settings.embedded_broker:
        folder = settings.ASYNCRL_HOME / "broker"
        folder.mkdir(parents=True, exist_ok=True)
        # control_folder (exchange tables) defaults to ./control in the working directory: keep it in ASYNCRL_HOME too
        return {
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "control_folder": str(folder / "control"),
        }
    return {"visibility_timeout": settings.CELERY_VISIBILITY_TIMEOUT_S}


class TaskName(enum.StrEnum):
    """The names the tasks of ``server/jobs/tasks.py`` are registered under (the one place that spells them)."""

    launch_run = "asyncrl.launch_run"
    stop_run = "asyncrl.stop_run"
    deliver_webhook = "asyncrl.deliver_webhook"
    reconcile = "asyncrl.reconcile"
    check_stalls = "asyncrl.check_stalls"
    start_waiting = "asyncrl.start_waiting"
    export_run = "asyncrl.export_run"
    tick_sweeps = "asyncrl.tick_sweeps"
    tick_pipelines = "asyncrl.tick_pipelines"


if settings.embedded_broker:
    register_embedded_broker()  # filesystem:// with whole-message writes (server/jobs/embedded_broker.py)
app = Celery("asyncrl", broker=settings.CELERY_BROKER_URL, include=["server.jobs.tasks"])
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=settings.CELERY_QUEUE,
    task_routes={TaskName.export_run.value: {"queue": settings.export_queue}},
    task_ignore_result=True,
    broker_transport_options=_transport_options(),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    beat_schedule={
        name: {"task": task.value, "schedule": every_s, "options": {"expires": every_s}}  # a late tick is dropped
        for name, task, every_s in (
            ("reconcile", TaskName.reconcile, settings.RECONCILE_INTERVAL_S),
            ("check-stalls", TaskName.check_stalls, settings.ALERT_STALL_CHECK_S),
            ("tick-sweeps", TaskName.tick_sweeps, settings.SWEEP_TICK_S),
            ("tick-pipelines", TaskName.tick_pipelines, settings.SWEEP_TICK_S),
        )
    },
    beat_schedule_filename=str(settings.ASYNCRL_HOME / "celerybeat-schedule"),
)
app.steps["consumer"].add(Heartbeat)  # /healthz's "worker" (server/jobs/heartbeat.py)


@beat_embedded_init.connect
def _beat_dies_with_its_worker(**_: object) -> None:
    """The beat that ``asyncrl worker -B`` forks stops when the worker dies, even by kill -9: a restarted worker
    would otherwise run beside an orphaned beat and every periodic task would be sent twice."""
    die_with_parent()


class BrokerUnavailable(Exception):
    """The broker did not take a task (Redis down or full, the embedded broker's folder unwritable); the message is
    one line naming the broker and the task."""


def broker_name() -> str:
    """The broker as a user may see it: the Redis URL without its password, or the embedded broker's folder."""
    if settings.embedded_broker:
        return f"the embedded broker ({settings.ASYNCRL_HOME / 'broker'})"
    return f"the broker {maybe_sanitize_url(str(app.conf.broker_url))}"


def enqueue(task: TaskName, *args: int) -> None:
    """Send ``task(*args)`` to the queue by name. Call it only after the commit that wrote the rows the task reads
    (the worker must find them).

    Raises:
        BrokerUnavailable: the broker cannot be reached or refused the message (kombu retries a lost connection for
            about a second first).
    """
    try:
        app.send_task(task.value, args=list(args))
    except (KombuError, OSError, RedisError) as err:
        cause = " ".join(str(err).split()) or type(err).__name__
        raise BrokerUnavailable(f"{broker_name()} did not take the task {task.value}: {cause}") from err
