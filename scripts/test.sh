#!/usr/bin/env bash
# The README's test command: the services the tests use (test-services.sh), then two pytest passes; extra arguments go
# to both (e.g. -x, -k name). Exit status 0 only when both passed.
#  1. tests that mostly wait (control plane on Postgres/Redis, unit tests: 1,900 tests, ~25 % of one core serially):
#     4 processes (pytest-xdist), the tests of one file in one process;
#  2. real runs (vLLM, training, Slurm, Chromium) and `serial` tests: one at a time, they need the 2 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/test-services.sh || exit 1
ONE_AT_A_TIME="vllm or slurm or browser or slow or serial"
.venv/bin/python -m pytest -m "not gpu and not fault_matrix and not ($ONE_AT_A_TIME)" -n 4 --dist loadfile -q \
  --durations=15 "$@"
waiting=$?
.venv/bin/python -m pytest -m "not gpu and not fault_matrix and ($ONE_AT_A_TIME)" -q --durations=30 "$@"
running=$?
echo "test.sh: pass 1 (parallel) exit $waiting, pass 2 (one at a time) exit $running"
[ "$waiting" -eq 0 ] && [ "$running" -eq 0 ]
