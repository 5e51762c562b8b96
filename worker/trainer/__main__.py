import sys

from worker.trainer.train import main

sys.exit(main())
