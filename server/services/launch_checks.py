"""The launch's checks of a spec against the world that the server can run at submit, so a run that could only fail
at launch is refused with a 422 instead of queued.

Each check is the launcher's own engine function, called here on what this server sees (nothing is repeated):

========================  ===========================================================  ============================
spec key                  refused when                                                 engine function
========================  ===========================================================  ============================
``data.path``,            the file is missing, empty, does not parse or has a row       ``worker.trainer.sft_data``
``data.eval_path`` (SFT)  without an assistant turn (structure only, not tokenized)     ``read_rows``, ``check_rows``
``*lora.target_modules``  an entry matches no linear layer of the model, or a tied one  ``worker.trainer.lora``
                          (a local model folder with a ``config.json``; no weights)     ``check_targets``
``inference.urls``        a server does not answer ``GET /health`` (all probed at       ``worker.launchers.local``
                          once, :data:`URL_PROBE_S` in all)                             ``check_urls``
========================  ===========================================================  ============================

A path under a root the server does not see (``DATA_ROOTS`` / ``MODEL_ROOTS`` mounted on the workers only) and a
hub model id are left to the launch (``worker.launchers.local``, ``worker.trainer.sft.sft_preflight``), which runs
every check again where the run starts. :func:`check` runs after ``spec_policy.check``: only allowed paths and
addresses are read or probed (``runs.create``: the API, ``asyncrl submit``, the Launch page, fork; a sweep's trials
at sweep submit, once per :func:`distinct` trial).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from server.core.config import settings
from server.services.spec_policy import root_here
from worker.spec import EvalSpec, RLSpec, SFTSpec, SpecError

URL_PROBE_S = 2.0
"""Seconds the submit waits, in all, for the servers of ``inference.urls`` to answer ``GET /health``."""


def check_data(spec: SFTSpec) -> None:
    """The rows of an SFT spec's ``data.path`` / ``data.eval_path`` under a ``DATA_ROOTS`` folder this server sees.

    Raises:
        SpecError: ``data.path: /srv/d.jsonl does not exist (...)``, ``... is empty (no rows)``, ``data.path: row 3
            has no assistant turn to train on (roles: ['user'])`` and the other lines of ``read_rows`` /
            ``row_messages``.
    """
    from worker.trainer.sft_data import check_rows, read_rows

    files = [
        ("data.path", spec.data.path, spec.data.split),
        ("data.eval_path", spec.data.eval_path, spec.data.eval_split),
    ]
    for field, path, split in files:
        if path and root_here(path, settings.DATA_ROOTS) is not None:
            check_rows(read_rows(path, field, split), field)


def check_lora(spec: RLSpec | SFTSpec) -> None:
    """The LoRA ``target_modules`` of a spec whose ``model.name`` is a model folder this server can read.

    Raises:
        SpecError: ``trainer.lora.target_modules: ['q_prj'] match no linear layer of qwen3 (its linear layers:
            [...])`` (``lora.target_modules`` for SFT), or entries that target a layer with tied weights.
    """
    lora = spec.lora if isinstance(spec, SFTSpec) else spec.trainer.lora
    config = os.path.join(spec.model.name, "config.json")
    if lora is None or not (os.path.isfile(config) and os.access(config, os.R_OK)):
        return
    from worker.trainer.lora import RL_FIELD, check_targets  # torch: imported only for a LoRA spec of a local model
    from worker.trainer.sft import SFT_LORA_FIELD

    field = SFT_LORA_FIELD if isinstance(spec, SFTSpec) else RL_FIELD
    try:
        check_targets(spec.model.name, lora.target_modules, field=field)
    except ValueError as err:  # ours name the field; transformers' ("Unrecognized model in ...") are worded here
        if str(err).startswith(field):
            raise SpecError(str(err)) from None
        raise SpecError(
            f"model.name: {spec.model.name!r} is not a model folder transformers can load (config.json has no known "
            "model_type)"
        ) from None
    except OSError as err:  # transformers could not read the folder's config (not JSON, not a model config)
        reason = " ".join(str(err).split())[:300]
        raise SpecError(f"model.name: {spec.model.name!r}: its config.json does not load ({reason})") from None


def check(spec: RLSpec | SFTSpec | EvalSpec) -> None:
    """Every check of this module that applies to ``spec`` (see the table above), cheapest first.

    Raises:
        SpecError: one line naming the key (:func:`check_data`, :func:`check_lora`, or ``inference.urls.<i>:
            http://127.0.0.1:8001 does not answer GET /health within 2 s``).
    """
    if isinstance(spec, SFTSpec):
        check_data(spec)
    if isinstance(spec, RLSpec | SFTSpec):
        check_lora(spec)
    if isinstance(spec, RLSpec) and spec.inference.urls:
        from worker.launchers.local import check_urls

        check_urls(spec.inference.replica_urls, timeout_s=URL_PROBE_S)


def distinct(specs: Sequence[RLSpec | SFTSpec | EvalSpec]) -> list[int]:
    """Indices of the specs whose checked keys (model, data, LoRA, ``inference.urls``) differ from every earlier one's:
    :func:`check` of these covers all of ``specs`` (a sweep's trials, which mostly differ in other keys, read each file
    and probe each server once)."""
    seen: set[str] = set()
    out = []
    for i, spec in enumerate(specs):
        dump = spec.model_dump(mode="json")
        keys = {k: dump.get(k) for k in ("model", "data", "lora", "kind")}
        keys["trainer.lora"] = dump.get("trainer", {}).get("lora")
        keys["inference.urls"] = dump.get("inference", {}).get("urls")
        key = json.dumps(keys, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out
