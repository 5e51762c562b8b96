"""The trainer's side of checkpoints (torch): write a ``trainer`` part in the background, resume from one,
and save the final model.

The layout and rules of checkpoints (atomic parts, completion, pruning, which step to resume, requests)
live in ``worker/run/checkpoint.py``, which imports no torch because the server reads it; this module holds
what needs torch: the ``trainer`` part's files (``model.safetensors``; ``state.pt`` with optimizer,
scheduler, RNG states and step; ``meta.json``), written through ``worker.run.checkpoint.write_part``.

A LoRA run (``[trainer.lora]``) stores the adapter instead of the full weights: ``trainer/adapter/``
(``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's format, ``worker/trainer/lora.py``) beside
``state.pt`` (the adapters' optimizer state) and ``meta.json``; the base weights are the run's ``model.name``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors.torch import load_file, save_file

from worker.policy.lora_adapters import ADAPTER_DIR
from worker.policy.models import readable
from worker.run.checkpoint import prune, write_part
from worker.run.rundir import RunDir, writing
from worker.trainer.dist import full_state_dict, is_main_rank, tied_output_keys, weights_state_dict
from worker.trainer.lora import adapter_state, load_adapter, save_adapter

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


def save_final(model: PreTrainedModel, base_name: str, out: Path, adapter: PeftModel | None = None) -> None:
    """``save_pretrained`` the model with the base model's tokenizer, so ``out`` loads by path.

    With FSDP2 every rank calls it (the weights are gathered) and rank 0 writes. With ``adapter`` (a LoRA run's
    PEFT handle of ``model``): the adapter is merged into the weights (``merge_and_unload``: ``model`` is changed,
    call it last), so ``out`` is a plain model, and the adapter itself is kept in ``out/adapter/``.

    Raises:
        DiskFull: the filesystem is full (the half-written temporary folder is removed, ``out`` is unchanged).
    """
    from transformers import AutoTokenizer

    lora = adapter_state(adapter) if adapter is not None else None
    if adapter is not None:
        model = adapter.merge_and_unload()
    state = full_state_dict(model)
    if not is_main_rank():
        return
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with writing("the final model", out, partial=tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state)
        AutoTokenizer.from_pretrained(base_name).save_pretrained(tmp)
        if adapter is not None:
            save_adapter(adapter, tmp / ADAPTER_DIR, state=lora)
        readable(tmp)  # an SFT model is the base of runs of other uids (the service runs each run as its own)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


class BackgroundCheckpointer:
    """Writes trainer checkpoint parts on a thread so training goes on while files are written.

    The state is copied on the calling thread (a consistent snapshot), then written by the thread.
    One save at a time: a new save first waits for the previous one. Optimizer state is stored by
    parameter name (``get_optimizer_state_dict``), so a checkpoint loads with any number of ranks;
    with FSDP2 every rank calls ``save`` (the state is gathered) and rank 0 writes.

    A write that fails (e.g. :class:`worker.run.rundir.DiskFull`) leaves no half-written folder (``write_part``) and its
    error is raised on the training thread by the next ``check``, ``save`` or ``wait``, so the trainer ends with it
    instead of training on without checkpoints.
    """

    def __init__(self, run: RunDir, keep: int) -> None:
        self.run, self.keep = run, keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def check(self) -> None:
        """Raise the error of a background write that has failed (without waiting for one still running)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        adapter: PeftModel | None = None,
    ) -> None:
        """Snapshot the state of ``step`` and write it as the ``trainer`` part in the background; with ``adapter``
        (a LoRA run's PEFT handle of ``model``) the adapter goes to ``adapter/`` instead of ``model.safetensors``.

        Raises:
            DiskFull, Exception: the previous background write failed (see the class docstring).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self.wait()
        weights = adapter_state(adapter) if adapter is not None else weights_state_dict(model)
        opt_state = get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not is_main_rank():
            return
        # optimizer state tensors are cloned so the next step cannot change them under the writer
        per_param = cast(dict[str, dict[str, Any]], opt_state["state"])  # parameter name -> its state
        snapshot = {
            "state": {
                k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()} for k, s in per_param.items()
            },
            "param_groups": opt_state["param_groups"],
        }
        meta = {"scheduler": scheduler.state_dict(), "rng": _rng_state(), "step": step}

        def write(folder: Path) -> None:
            if adapter is not None:
                save_adapter(adapter, folder / ADAPTER_DIR, state=weights)
            else:
                save_file(weights, folder / "model.safetensors")
            torch.save({"optimizer": snapshot, **meta}, folder / "state.pt")
            (folder / "meta.json").write_text(json.dumps({"step": step}))

        def job() -> None:
            try:
                write_part(self.run, step, "trainer", write)
                prune(self.run, self.keep)
            except BaseException as err:  # raised on the training thread (check, save, wait)
                logger.error("checkpoint step %d failed: %s", step, err)
                self._error = err
                return
            logger.info("checkpoint step %d written", step)

        self._thread = threading.Thread(target=job, name=f"ckpt-{step}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the background write, then raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()


def load_trainer_state(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    adapter: PeftModel | None = None,
) -> int:
    """Load a trainer checkpoint part into model (or, with ``adapter``, its LoRA adapter from ``adapter/``),
    optimizer, scheduler and RNGs; returns its step.

    Works on a plain and on an FSDP2-sharded model (every rank reads the files and keeps its shard).

    Raises:
        RuntimeError: the checkpoint's tensor names do not match the model (or the adapter).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, strict=False)
    if adapter is not None:
        load_adapter(adapter, folder / ADAPTER_DIR)
    else:
        weights: dict[str, Any] = load_file(folder / "model.safetensors")  # Any: set_model_state_dict's value union
        # compared here: set_model_state_dict with full_state_dict reports no missing key; a tied output projection
        # is saved as the embedding (tied_output_keys)
        names = set(model.state_dict())
        missing, unexpected = sorted(names - tied_output_keys(model) - set(weights)), sorted(set(weights) - names)
        if missing or unexpected:
            raise RuntimeError(
                f"checkpoint {folder} does not match the model: missing {missing}, unexpected {unexpected}"
            )
        set_model_state_dict(model, weights, options=full)
    state = torch.load(folder / "state.pt", weights_only=False)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=full)
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return int(state["step"])
