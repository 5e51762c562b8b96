#!/usr/bin/env bash
# Prepare everything the one-GPU check (benchmarks/gpu/one_gpu_rl.py) needs on a GPU machine without network.
#
#   bash scripts/gpu-prepare.sh        # from the checkout root, on a CPU machine with PyPI; ~3-5 min
#
# Writes, into folders git ignores (added to the checkout's info/exclude):
#   .vllm-parts/p1/   vLLM 0.26.0 and its missing dependencies as one ~46 MiB xz part (benchmarks/gpu/vllm/:
#                     vllm-prepare.sh trims vLLM for sm_90 and compacts its fatbins; vllm-device-setup.sh unpacks it
#                     there into /tmp/site). Skipped when .vllm-parts/p1/MANIFEST exists, unless FORCE=1.
#   .gpuwheels/       cp312 manylinux wheels of asyncrl's own dependencies that the GPU image lacks
#                     (benchmarks/gpu/device-wheels.txt, pinned as requirements-gpu.lock).
# Then it prints the command to run on the GPU machine (with the `run` tool: carry .vllm-parts and .gpuwheels).
# Env: FORCE=1 (rebuild the vLLM bundle), WORK (scratch of vllm-prepare.sh, default /tmp/vllm-prep).
set -euo pipefail
ROOT=$(pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$ROOT/benchmarks/gpu/one_gpu_rl.py" ] || { echo "run this from the asyncrl checkout root" >&2; exit 2; }
command -v python3 >/dev/null || { echo "needs python3 with pip" >&2; exit 2; }

EXCL=$(git -C "$ROOT" rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)
case $EXCL in /*) ;; *) EXCL=$ROOT/$EXCL ;; esac
mkdir -p "$(dirname "$EXCL")"
for d in /.vllm-parts/ /.gpuwheels/; do grep -qxF "$d" "$EXCL" 2>/dev/null || echo "$d" >>"$EXCL"; done

if [ "${FORCE:-0}" = 1 ] || [ ! -f "$ROOT/.vllm-parts/p1/MANIFEST" ]; then
  echo "== vLLM bundle -> .vllm-parts"
  REPO=$ROOT bash "$HERE/benchmarks/gpu/vllm/vllm-prepare.sh"
else
  echo "== vLLM bundle: .vllm-parts/p1 exists (FORCE=1 rebuilds it)"
fi

echo "== asyncrl's dependencies missing on the GPU machine -> .gpuwheels"
rm -rf "$ROOT/.gpuwheels" && mkdir -p "$ROOT/.gpuwheels"
PIP_CONFIG_FILE=${PIP_CONFIG_FILE:-/dev/null} python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$ROOT/.gpuwheels" -r "$HERE/benchmarks/gpu/device-wheels.txt"
du -sh "$ROOT/.vllm-parts" "$ROOT/.gpuwheels"

cat <<'EOF'
== on the GPU machine (the `run` tool, kind nvidia-h200): the checkout travels, .vllm-parts and .gpuwheels are carried.
Two calls of at most 10 minutes each (each RL run starts its own vLLM):
run(carry=[".vllm-parts", ".gpuwheels"], timeout_s=600, command=
  "set -o pipefail; bash benchmarks/gpu/one_gpu_rl.sh --out $OUT --parts alone,async,sync 2>&1 | tee $OUT/one_gpu_rl.log")
then copy $OUT/gpu_one_gpu_rl.json to benchmarks/results/ and
run(carry=[".vllm-parts", ".gpuwheels"], timeout_s=600, command=
  "set -o pipefail; bash benchmarks/gpu/one_gpu_rl.sh --out $OUT --parts lora,pg --merge benchmarks/results/gpu_one_gpu_rl.json 2>&1 | tee $OUT/one_gpu_rl.log")
and copy $OUT/gpu_one_gpu_rl.json and $OUT/gpu_lora.json to benchmarks/results/.
EOF
