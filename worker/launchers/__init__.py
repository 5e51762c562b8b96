"""Starting and following a run: ``local.py`` (the processes of an RL, SFT or eval run as children of this
process), ``slurm.py`` with ``slurm_job.py`` and ``slurm_layout.py`` (a run as a Slurm job), ``supervisor.py`` (one
service-launched run, started by the Celery task) with ``reporter.py`` (what it tells the server over HTTP), and
``capacity.py`` (what a worker machine holds, and whether a spec fits it)."""
