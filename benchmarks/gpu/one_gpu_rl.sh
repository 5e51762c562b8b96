#!/bin/bash
# The one-GPU check on the GPU machine (no network): unpack the vLLM bundle and asyncrl's missing wheels made by
# scripts/gpu-prepare.sh, then run benchmarks/gpu/one_gpu_rl.py with the given arguments.
#   bash benchmarks/gpu/one_gpu_rl.sh --out "$OUT" --parts alone,async,sync
# Exit 5: the bundle is missing or does not unpack; 6: vLLM or the project does not import.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
if [ ! -f /tmp/vllm-env.sh ]; then
  bash benchmarks/gpu/vllm/vllm-device-setup.sh .vllm-parts/p1 >/tmp/vllm-setup.log 2>&1 || { cat /tmp/vllm-setup.log; exit 5; }
fi
source /tmp/vllm-env.sh
if [ ! -d /tmp/site2 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 .gpuwheels/*.whl \
    2>&1 | grep -v "WARNING: Running pip as" | tail -3
fi
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD
python3 -c "import vllm, verifiers, peft, torch, worker.cli" || exit 6
echo "setup $(( $(date +%s) - T0 )) s"
exec python3 benchmarks/gpu/one_gpu_rl.py "$@"
