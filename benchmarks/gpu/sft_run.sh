#!/bin/bash
# Issue 22 on the GPU machine (no network): a real `asyncrl sft` run of the Qwen3-0.6B-shape model on packed 16k rows.
#   bash benchmarks/gpu/sft_run.sh "$OUT"      (run tool; carry .vllm-parts and .gpuwheels: scripts/gpu-prepare.sh)
# Unpacks the bundle as one_gpu_rl.sh does (verifiers comes with it), writes the model (`asyncrl model init --size
# qwen3-0.6b`) and 16,384 reverse-text chat rows (scripts/sft_rows_from_env.py), runs benchmarks/gpu/sft_0p6b.toml
# and prints the median `tokens_per_s` of steps 3.. (steps 1-2 compile). Files: $OUT/sft/<name>/metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: sft_run.sh OUT_DIR}
if [ ! -f /tmp/vllm-env.sh ]; then
  bash benchmarks/gpu/vllm/vllm-device-setup.sh .vllm-parts/p1 >/tmp/vllm-setup.log 2>&1 || { cat /tmp/vllm-setup.log; exit 5; }
fi
source /tmp/vllm-env.sh
[ -d /tmp/site2 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 .gpuwheels/*.whl
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD
python3 -m worker.cli model init --size qwen3-0.6b --out /tmp/sft-model --overwrite >/dev/null
python3 scripts/sft_rows_from_env.py --env reverse_text --args '{"system_message": false}' --num-examples 16384 \
  --out /tmp/sft-data.jsonl
python3 -m worker.cli sft @ benchmarks/gpu/sft_0p6b.toml --model.name /tmp/sft-model --data.path /tmp/sft-data.jsonl \
  --output_dir "$OUT/sft"
python3 - "$OUT"/sft/*/metrics.jsonl <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"tokens_per_s"' in line]
steady = [r["tokens_per_s"] for r in rows if r["step"] >= 3]
print(f"sft steps {len(rows)}; tokens/s median of steps 3..{rows[-1]['step']}: {statistics.median(steady):.0f}"
      f" (min {min(steady):.0f}, max {max(steady):.0f}); loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
PY
