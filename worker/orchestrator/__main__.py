import sys

from worker.orchestrator.orchestrator import main
from worker.run.rundir import run_process

sys.exit(run_process("orchestrator", main))
