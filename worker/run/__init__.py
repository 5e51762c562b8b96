"""A run on disk and as processes: ``rundir.py`` (the run directory, the supervisor's home, the one JSONL tail
reader), ``checkpoint.py`` (checkpoint parts, completion, where to resume), ``run_files.py`` (how the service reads
a run's files safely), ``inputs.py`` (what a run starts from in other runs' folders, copied into its own),
``procs.py`` (process groups that die with their parent, the run's user and environment) and
``cgroups.py`` (one cgroup per service-launched run). Imports nothing heavy and nothing of the other rooms but the
spec."""
