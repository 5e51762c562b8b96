#!/bin/bash
# The one-GPU check on the GPU machine (no network): unpack the vLLM bundle and asyncrl's missing wheels made by
# scripts/gpu-prepare.sh, then run benchmarks/gpu/one_gpu_rl.py with the given arguments.
#   bash benchmarks/gpu/one_gpu_rl.sh --out "$OUT" --parts alone,async,sync
# Exit 5: the bundle is missing or does not unpack; 6: vLLM or the project does not import.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
source benchmarks/gpu/device-env.sh
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD
python3 -c "import vllm, verifiers, peft, torch, worker.cli" || exit 6
echo "setup $(( $(date +%s) - T0 )) s"
exec python3 benchmarks/gpu/one_gpu_rl.py "$@"
