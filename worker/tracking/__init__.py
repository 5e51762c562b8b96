"""What a run reports besides its training files: ``alert_rules.py`` (the alert rule schema and every metric name
a process writes), ``progress.py`` (each process's progress record and the hang watchdog), ``system_metrics.py``
(CPU, memory and GPU of a process) and ``wandb_export.py`` (a run's metrics, events and revisions to W&B)."""
