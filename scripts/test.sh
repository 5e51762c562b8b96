#!/usr/bin/env bash
# The README's test command: the services the tests use (test-services.sh), then three pytest passes; extra arguments
# go to every pytest (e.g. -x, -k name). Exit status 0 only when all passed.
#  1. tests that mostly wait (control plane on Postgres/Redis, unit tests: 1,900 tests, ~25 % of one core serially):
#     4 processes (pytest-xdist), the tests of one file in one process; beside them, in a pytest of its own, the
#     schemathesis fuzz (`fuzz`: pytest-xdist would run one of its operations; in process, on its own test database
#     and queue like every pytest session: beside pass 1, which leaves a core idle);
#  2. real runs (vLLM, training, Slurm, Chromium): two processes (pytest-xdist, the tests of one file in one process,
#     every Slurm file in one: tests/conftest.py). A real run on the tiny model keeps about one core busy (Python,
#     one OMP thread for vLLM): run one at a time, the box idled ~45 % of the time; two at once filled it. Each process
#     has its own test database, queue, state dir and session vLLM server (tests/support/server.py);
#  OMP_WAIT_POLICY=PASSIVE in passes 1 and 2, where more busy threads than cores always run: a torch OpenMP thread
#  that waits for work sleeps at once instead of spinning on a core another test needs (benchmarks/omp_wait_policy.py:
#  two 20-step SFTs at once on a busy 2-core box, 282 s default vs 48 s passive);
#  3. `timing` tests (a time bound or ratio that a real run beside them breaks) and `serial` ones (gloo groups, a peer
#     closed under load): one at a time, alone.
# ASYNCRL_TEST_CACHE: a folder of this run's, removed at its end, where every pytest of the run keeps what a test
# support helper made once for any of them (tests/support/runs.py, multiturn_run: keyed by its inputs and the code).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/test-services.sh || exit 1
ASYNCRL_TEST_CACHE=$(mktemp -d -t asyncrl-test-cache-XXXXXX)
export ASYNCRL_TEST_CACHE
trap 'rm -rf "$ASYNCRL_TEST_CACHE"' EXIT
REAL_RUNS="vllm or slurm or browser or slow"  # pass 2
ALONE="serial or timing"  # pass 3
fuzz_log=$(mktemp)
export OMP_WAIT_POLICY=PASSIVE  # passes 1 and 2 (above); unset for pass 3
.venv/bin/python -m pytest -m "not gpu and not fault_matrix and fuzz" -q --durations=5 "$@" >"$fuzz_log" 2>&1 &
fuzz_pid=$!
.venv/bin/python -m pytest -m "not gpu and not fault_matrix and not fuzz and not ($REAL_RUNS or $ALONE)" -n 4 \
  --dist loadfile -q --durations=15 "$@"
waiting=$?
wait "$fuzz_pid"
fuzzing=$?
echo "test.sh: the fuzz pytest (beside pass 1):"
cat "$fuzz_log"
rm -f "$fuzz_log"
# exit 5: nothing selected (e.g. -k of a test elsewhere): not a failure of this run
[ "$fuzzing" -eq 5 ] && fuzzing=0
.venv/bin/python -m pytest -m "not gpu and not fault_matrix and not fuzz and ($REAL_RUNS) and not ($ALONE)" -n 2 \
  --dist loadfile -q --durations=60 "$@"
running=$?
[ "$running" -eq 5 ] && running=0
unset OMP_WAIT_POLICY
.venv/bin/python -m pytest -m "not gpu and not fault_matrix and not fuzz and ($ALONE)" -q --durations=15 "$@"
alone=$?
[ "$alone" -eq 5 ] && alone=0
echo "test.sh: pass 1 (parallel) exit $waiting, fuzz exit $fuzzing, pass 2 (real runs, two at once) exit $running," \
  "pass 3 (one at a time) exit $alone"
[ "$waiting" -eq 0 ] && [ "$fuzzing" -eq 0 ] && [ "$running" -eq 0 ] && [ "$alone" -eq 0 ]
