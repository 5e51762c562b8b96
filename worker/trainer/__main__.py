import sys

from worker.run.rundir import run_process
from worker.trainer.train import main

sys.exit(run_process("trainer", main))
