#!/bin/bash
# One-GPU smoke + measurement of `asyncrl rl` with configs/reverse_text/rl.toml (vLLM 0.26 + trainer on cuda:0).
set -x
T0=$(date +%s)
bash .gpu/vllm-device-setup.sh .vllm-parts/p1 >/dev/null && source /tmp/vllm-env.sh || exit 5
python3 -m pip install -q --no-index --no-deps --target /tmp/site2 .gpuwheels/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD
python3 -c "import vllm, verifiers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" || exit 6
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "setup $(( $(date +%s) - T0 )) s"
O=$OUT/${OUTSUB:-.}; mkdir -p $O
[ -d /tmp/runs/reverse-text-sft/final ] || { python3 -m worker.cli model init --out /tmp/m 2>&1 | tail -3
python3 -m worker.cli sft @ configs/reverse_text/sft.toml --model.name /tmp/m --output_dir /tmp/runs --threads 8 2>&1 | tail -4; }
rm -rf /tmp/runs/reverse-text-rl
echo "sft done $(( $(date +%s) - T0 )) s"
timeout ${RL_TIMEOUT:-300} python3 -m worker.cli rl @ configs/reverse_text/rl.toml --model.name /tmp/runs/reverse-text-sft/final \
  --output_dir /tmp/runs --trainer.device cuda ${RL_ARGS} > $O/rl_console.log 2>&1
echo "rl rc=$? $(( $(date +%s) - T0 )) s"
tail -8 $O/rl_console.log
R=$(ls -d /tmp/runs/reverse-text-rl* | head -1)
cp -r $R/logs $O/ 2>/dev/null; cp $R/metrics.jsonl $R/summary.json $O/ 2>/dev/null
grep -i -E "weight|warn|error" $R/logs/trainer.log $R/logs/orchestrator.log | tail -15
