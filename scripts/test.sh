#!/usr/bin/env bash
# The README's test command: the services the tests use (test-services.sh), then two pytest passes; extra arguments
# go to every pytest (e.g. -x, -k name). Exit status 0 only when all passed.
#  1. tests that mostly wait (control plane on Postgres/Redis, unit tests: 1,900 tests, ~25 % of one core serially):
#     4 processes (pytest-xdist), the tests of one file in one process; beside them, in a pytest of its own, the
#     schemathesis fuzz (`fuzz`: pytest-xdist would run one of its operations; in process, on its own test database
#     and queue like every pytest session: it used ~1 core for minutes of pass 2 while pass 1 leaves one idle);
#  2. real runs (vLLM, training, Slurm, Chromium), `timing` tests (a time bound or ratio that a real run beside them
#     breaks) and `serial` ones (gloo groups): one at a time. Two processes (`-n 2`) were tried: on 2 cores each real
#     run already uses both, and the pass took longer, not shorter (each process has its own test database, queue and
#     state dir, so it works: tests/support/server.py).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/test-services.sh || exit 1
ONE_AT_A_TIME="vllm or slurm or browser or slow or serial or timing"  # pass 2
fuzz_log=$(mktemp)
.venv/bin/python -m pytest -m "not gpu and not fault_matrix and fuzz" -q --durations=5 "$@" >"$fuzz_log" 2>&1 &
fuzz_pid=$!
.venv/bin/python -m pytest -m "not gpu and not fault_matrix and not fuzz and not ($ONE_AT_A_TIME)" -n 4 \
  --dist loadfile -q --durations=15 "$@"
waiting=$?
wait "$fuzz_pid"
fuzzing=$?
echo "test.sh: the fuzz pytest (beside pass 1):"
cat "$fuzz_log"
rm -f "$fuzz_log"
# exit 5: nothing selected (e.g. -k of a test elsewhere): not a failure of this run
[ "$fuzzing" -eq 5 ] && fuzzing=0
.venv/bin/python -m pytest -m "not gpu and not fault_matrix and not fuzz and ($ONE_AT_A_TIME)" -q --durations=30 "$@"
running=$?
[ "$running" -eq 5 ] && running=0
echo "test.sh: pass 1 (parallel) exit $waiting, fuzz exit $fuzzing, pass 2 (one at a time) exit $running"
[ "$waiting" -eq 0 ] && [ "$fuzzing" -eq 0 ] && [ "$running" -eq 0 ]
