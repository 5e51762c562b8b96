# Sourced on the GPU machine, from the checkout's root: unpack the vLLM bundle (.vllm-parts) into /tmp/site and
# asyncrl's missing wheels (.gpuwheels) into /tmp/site2 once, and load vLLM's environment. Exit 5 when the bundle is
# missing or does not unpack. Made by scripts/gpu-prepare.sh on a CPU machine, carried by the `run` tool.
if [ ! -f /tmp/vllm-env.sh ]; then
  bash benchmarks/gpu/vllm/vllm-device-setup.sh .vllm-parts/p1 >/tmp/vllm-setup.log 2>&1 || { cat /tmp/vllm-setup.log; exit 5; }
fi
source /tmp/vllm-env.sh
if [ ! -d /tmp/site2 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 .gpuwheels/*.whl \
    2>&1 | grep -v "WARNING: Running pip as" | tail -3
fi
