import sys

from worker.orchestrator.orchestrator import main

sys.exit(main())
