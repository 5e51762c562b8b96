"""The control plane's background jobs: the Celery app (``celery_app``: task names, the broker, beat), its tasks
(``tasks``: launch, stop, reconcile, export, webhook delivery, sweep and pipeline ticks, thin shells over plain
functions) the embedded broker (``embedded_broker``: a file-backed transport for one machine without Redis) and the workers'
heartbeat in the broker (``heartbeat``: what ``/healthz`` reports as ``broker`` and ``worker``).

They belong to the server: they read and write its database and call its services, and they start runs through the
engine (``worker.launchers.supervisor``, ``worker.launchers``), which never imports them."""
