"""LoRA RL (``[trainer.lora]``): wrap the trainer's model with PEFT adapters, save and load the adapter.

The update of a targeted linear layer ``W [out, in]`` is ``W + (alpha / rank) * B @ A`` with ``A [rank, in]`` and
``B [out, rank]`` (Hu et al. 2021, "LoRA", arXiv:2106.09685, eq. 3); PEFT initialises ``B = 0``, so policy
version 0 equals the base model. Only ``A`` and ``B`` train (``requires_grad``); the base weights are frozen.

On disk an adapter is PEFT's ``save_pretrained`` format (its files: ``worker/policy/lora_adapters.py``), the one vLLM's
LoRA loading reads (``/v1/load_lora_adapter``) and ``PeftModel.from_pretrained`` loads. It is what ``weights/step_n/``
holds for a LoRA run (``worker/weight_sync/publish.py``) and what a checkpoint's ``trainer/adapter/`` holds
(``worker/trainer/checkpointer.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from worker.policy.lora_adapters import ADAPTER_WEIGHTS
from worker.spec import LoraConfig

__all__ = [
    "adapter_state",
    "check_targets",
    "tied_targets",
    "load_adapter",
    "save_adapter",
    "wrap",
]

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER_NAME = "default"
"""PEFT's name of the one adapter the trainer trains."""


def _matches(module_name: str, target: str) -> bool:
    """PEFT's suffix rule for a ``target_modules`` list entry: the full name, or its last dotted parts."""
    return module_name == target or module_name.endswith("." + target)


def unmatched_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The entries of ``targets`` that match no ``torch.nn.Linear`` of ``model`` (PEFT's suffix matching)."""
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return [t for t in targets if not any(_matches(name, t) for name in linear)]


def tied_modules(model: torch.nn.Module) -> list[str]:
    """Names of the modules of ``model`` that hold a parameter another module holds too (tied weights: ``lm_head``
    and ``embed_tokens`` under ``tie_word_embeddings``), sorted."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    return sorted({name for names in owners.values() if len(names) > 1 for name in names})


def tied_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The entries of ``targets`` that match a module with tied weights (:func:`tied_modules`, PEFT's suffix
    matching): an adapter there trains one copy of a weight two layers share, and merging it
    (``merge_and_unload``: ``worker/policy/export.py``, ``final/``) writes ``W + (alpha / rank) B A`` into the shared
    tensor, changing the other layer too, so the merged model is not the trained policy."""
    tied = tied_modules(model)
    return [t for t in targets if any(_matches(name, t) for name in tied)]


RL_FIELD = "trainer.lora.target_modules"
"""The spec key of the targets in an RL spec; an SFT spec's is ``lora.target_modules``."""


def _check(model: torch.nn.Module, targets: list[str], model_type: str, field: str = RL_FIELD) -> None:
    """Raise the one-line ``field`` error of :func:`check_targets` for ``model``."""
    missing = unmatched_targets(model, targets)
    if missing:
        leaves = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise ValueError(f"{field}: {missing} match no linear layer of {model_type} (its linear layers: {leaves})")
    tied = tied_targets(model, targets)
    if tied:
        raise ValueError(
            f"{field}: {tied} target layers whose weights {model_type} ties "
            f"({', '.join(tied_modules(model))}: tie_word_embeddings), which LoRA cannot merge; leave them out"
        )


def check_targets(model_dir: str | Path, targets: list[str], field: str = RL_FIELD) -> None:
    """Launch check: every ``targets`` entry names a linear layer of the model in ``model_dir`` and none names a
    layer with tied weights (:func:`tied_targets`); the model is built from its config on the meta device, no
    weights are read.

    Raises:
        ValueError: one line naming ``field`` (``trainer.lora.target_modules``; ``lora.target_modules`` for SFT): the
            entries that match nothing and the model's linear layer names that would, or the entries that match a tied
            layer.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _check(model, targets, config.model_type, field)


def wrap(model: torch.nn.Module, cfg: LoraConfig, field: str = RL_FIELD) -> PeftModel:
    """Inject adapters into ``model`` in place (PEFT ``get_peft_model``) and freeze everything else.

    ``model`` keeps working as before (its targeted linears now add the adapter's output); the returned
    ``PeftModel`` is the handle for saving and loading the adapter. Only parameters named ``...lora_A...`` /
    ``...lora_B...`` have ``requires_grad``.

    Raises:
        ValueError: a ``target_modules`` entry matches no linear layer, or a layer with tied weights
            (:func:`check_targets`'s one line).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    _check(model, cfg.target_modules, getattr(getattr(model, "config", None), "model_type", "the model"), field)
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cast(int, cfg.alpha),  # PEFT annotates int; it scales by alpha / r in float
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)


def adapter_state(peft_model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's saved names, detached CPU copies (a snapshot the next step cannot change); with
    FSDP2 gathered from the shards (every rank must call it)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER_NAME)
    return {k: _full(v).detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: an FSDP2 parameter (a ``DTensor``, the trainer on a GPU shards even on one rank) gathered from
    its shards (a collective: every rank calls it), any other tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def save_adapter(peft_model: PeftModel, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into ``folder`` (created), PEFT's format.

    ``state``: the tensors to write (:func:`adapter_state`, taken earlier), default the model's current ones.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = peft_model.peft_config[ADAPTER_NAME]
    cfg.save_pretrained(str(folder))
    save_file(
        state if state is not None else adapter_state(peft_model),
        str(folder / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )


def load_adapter(peft_model: PeftModel, folder: Path) -> None:
    """Load the adapter tensors of ``folder`` (written by :func:`save_adapter`) into ``peft_model`` in place.

    Raises:
        RuntimeError: the folder's tensors do not match the model's adapter (names or shapes).
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state: dict[str, Any] = load_file(folder / ADAPTER_WEIGHTS)
    # torch's _IncompatibleKeys (names the model lacks / the file lacks)
    result: Any = set_peft_model_state_dict(peft_model, state, adapter_name=ADAPTER_NAME)
    unexpected = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if unexpected or missing:
        raise RuntimeError(f"adapter {folder} does not match the model: missing {missing}, unexpected {unexpected}")
