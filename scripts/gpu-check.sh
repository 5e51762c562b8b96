#!/usr/bin/env bash
# The one-call GPU check: GPU tests, the shipped reverse-text RL config on a GPU, vLLM's boot.
#
#   bash scripts/gpu-check.sh                    # here, on a CPU machine with PyPI: prepare, print the device call
#   bash scripts/gpu-check.sh --device OUT [--parts rl,tests,boot] [--budget-s 540] [--commit SHA] [--merge JSON]
#                                                # there, on the GPU machine (no network), in the checkout's root
#   bash scripts/gpu-check.sh --device OUT --parts loop --merge benchmarks/results/gpu_check.json
#                                                # there, second call: the 0.6B-shape loop measurement
#
# Prepare (here): scripts/gpu-prepare.sh makes the vLLM 0.26 bundle (.vllm-parts) and asyncrl's missing wheels
# (.gpuwheels), both git-ignored, carried to the GPU machine by the `run` tool's `carry`.
# Device (there): unpacks them into /tmp/site and /tmp/site2, then benchmarks/gpu/gpu_check.py runs the parts within
# --budget-s seconds of this script's start (setup included; the `run` tool's limit is 600 s a call) and writes
# OUT/gpu_check.json (stamped with --commit, or the checkout's HEAD when .git is there) and OUT/logs.tgz. A part that
# does not fit is recorded as not run; run it in a second call with --parts and --merge (the first call's JSON).
# Exit 5: the bundle is missing or does not unpack; 6: vLLM or the project does not import.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)

if [ "${1:-}" != "--device" ]; then
  bash scripts/gpu-prepare.sh >/dev/null || exit $?
  du -sh .vllm-parts .gpuwheels
  SHA=$(git rev-parse HEAD)
  cat <<EOF
== prepared. On the GPU machine (the \`run\` tool; commit ${SHA} — commit first, the working tree travels as it is):
run(carry=[".vllm-parts", ".gpuwheels"], timeout_s=600, command=
  "bash scripts/gpu-check.sh --device \$OUT --commit ${SHA} 2>&1 | tee \$OUT/console.log")
then copy \$OUT/gpu_check.json to benchmarks/results/gpu_check.json. The second call, the 0.6B-shape loop measurement
(and any part left out for time): --parts loop[,<those>] --merge benchmarks/results/gpu_check.json (the first call's
file, committed or carried); copy its gpu_check.json over the first.
EOF
  exit 0
fi

shift
OUT=${1:?usage: gpu-check.sh --device OUT [args of benchmarks/gpu/gpu_check.py]}
shift
mkdir -p "$OUT"
source benchmarks/gpu/device-env.sh
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD PYTHONUNBUFFERED=1
python3 -c "import vllm, verifiers, torch, worker.cli" || exit 6
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "setup $(( $(date +%s) - T0 )) s"
COMMIT=()
if git rev-parse HEAD >/dev/null 2>&1; then COMMIT=(--commit "$(git rev-parse HEAD)"); fi
exec python3 benchmarks/gpu/gpu_check.py --out "$OUT" --started "$T0" "${COMMIT[@]}" "$@"
