#!/bin/bash
# One-GPU smoke + measurement of `asyncrl rl` with configs/reverse_text/rl.toml (vLLM 0.26 + trainer on cuda:0).
# RL_ARGS adds overrides, e.g. RL_ARGS='--trainer.weight_sync.kind cuda_ipc --max_steps 40' (the colocated route).
# SFT_MODEL: an SFT'd tiny model made elsewhere (`asyncrl model init`, then `asyncrl sft @ configs/reverse_text/sft.toml`)
# and carried; without it the SFT stage runs here first, with SFT_ARGS (default `--threads 8`; `--device cuda` trains it
# on the GPU: the 13 MB fp32 model does not fit beside the 58 MiB bundle in the 64 MiB a `run` call carries).
# OUTSUB: subfolder of $OUT for the results; RL_TIMEOUT: seconds.
# Writes rl_console.log, metrics.jsonl, summary.json and logs.tgz (the run's process logs).
set -x
T0=$(date +%s)
bash benchmarks/gpu/vllm/vllm-device-setup.sh .vllm-parts/p1 >/dev/null && source /tmp/vllm-env.sh || exit 5
python3 -m pip install -q --no-index --no-deps --target /tmp/site2 .gpuwheels/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD
python3 -c "import vllm, verifiers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" || exit 6
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "setup $(( $(date +%s) - T0 )) s"
O=$OUT/${OUTSUB:-.}; mkdir -p $O
SFT=${SFT_MODEL:-/tmp/runs/reverse-text-sft/final}
[ -d "$SFT" ] || { python3 -m worker.cli model init --out /tmp/m 2>&1 | tail -3
SFT_CMD="python3 -m worker.cli sft @ configs/reverse_text/sft.toml --model.name /tmp/m --output_dir /tmp/runs"
$SFT_CMD ${SFT_ARGS:---threads 8} > /tmp/sft.log 2>&1 || { tail -5 /tmp/sft.log; echo "SFT with ${SFT_ARGS} failed: on CPU";
  rm -rf /tmp/runs/reverse-text-sft; $SFT_CMD --threads 8 > /tmp/sft.log 2>&1; }
tail -3 /tmp/sft.log; cp /tmp/runs/reverse-text-sft/summary.json $O/sft_summary.json 2>/dev/null; }
rm -rf /tmp/runs/reverse-text-rl
echo "sft done $(( $(date +%s) - T0 )) s"
timeout ${RL_TIMEOUT:-300} python3 -m worker.cli rl @ configs/reverse_text/rl.toml --model.name "$SFT" \
  --output_dir /tmp/runs --trainer.device cuda ${RL_ARGS} > $O/rl_console.log 2>&1
echo "rl rc=$? $(( $(date +%s) - T0 )) s"
tail -8 $O/rl_console.log
R=$(ls -d /tmp/runs/reverse-text-rl* | head -1)
tar czf $O/logs.tgz -C $R logs 2>/dev/null; cp $R/metrics.jsonl $R/summary.json $O/ 2>/dev/null
grep -i -E "weight|warn|error" $R/logs/trainer.log $R/logs/orchestrator.log | tail -15
