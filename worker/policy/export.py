"""Export a run's policy as a Hugging Face model directory (``asyncrl export``, the ``export_run`` Celery task).

What is exported (:func:`find_source`):

| ``--step`` | source | kind |
|---|---|---|
| N | ``checkpoints/step_N/trainer/`` of a complete checkpoint (``worker.run.checkpoint.is_complete``) | ``model.safetensors``: full; ``adapter/``: LoRA |
| none | ``final/`` when the run wrote it (the model after its last step), else the newest complete checkpoint | as above; ``final/`` holds ``save_pretrained`` files or a PEFT adapter |

What is written into ``--out`` (:func:`write_export`), always with the base model's tokenizer and chat template
(``save_pretrained``), so the folder loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` or vLLM by path:

- full fine-tune: the base model (``model.name`` of the run's resolved spec, in ``model.dtype``) with the checkpoint's
  weights loaded, ``save_pretrained`` (config, generation config, ``model.safetensors``);
- LoRA, merged (default): the base model with the PEFT adapter applied, ``merge_and_unload`` (W + B A * alpha/r in
  every target module; PEFT ``LoraLayer.merge``), ``save_pretrained`` — an ordinary model, no PEFT needed to load it;
- LoRA, ``adapter_only``: the PEFT adapter (``adapter_config.json`` with ``base_model_name_or_path`` set to the base
  model, ``adapter_model.safetensors``) plus the tokenizer: load with ``PeftModel.from_pretrained(base, out)`` or serve
  with vLLM's ``--enable-lora``.

``provenance.json`` in ``--out`` says where it came from (run directory as given, step, source relative to it, base
model as the spec names it, kind). Only what a Hugging Face model directory holds is written (never the trainer's
``state.pt``), and no path of this machine that the run did not name: an export may be moved or copied elsewhere.

Nothing half-written is left (``worker/run/rundir.py``'s atomic-rename rule): everything is written into a hidden
temporary folder beside the folder ``--out`` names (a link or ``.`` resolved) and renamed to it at the end; a failure
removes the temporary folder.

Bad input raises :class:`ExportError` with one line naming the problem (CLI exit 2, HTTP 4xx): not a run directory,
a step without a complete checkpoint (the complete steps listed), ``--out`` existing and not empty, ``adapter_only``
on a full fine-tune. Imports no torch at module level: the server reads :func:`export_name` and the file names.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from worker.policy.lora_adapters import ADAPTER_DIR, ADAPTER_FILES
from worker.run.checkpoint import complete_steps
from worker.run.rundir import DiskFull, RunDir, writing

EXPORTS_DIR = "exports"
"""In a run's home folder (beside the run directory): one folder per export made through the service
(:func:`export_name`)."""
WEIGHTS_FILE = "model.safetensors"
SOURCE_FILES = frozenset({WEIGHTS_FILE, *ADAPTER_FILES, "config.json", "generation_config.json"})
"""The files of a checkpoint's trainer part (or of ``final/``) an export reads; the rest (``state.pt`` with the
optimizer state, ``meta.json``, PEFT's ``README.md``) is neither read nor copied (:func:`is_source_file`)."""
PROVENANCE_FILE = "provenance.json"

Kind = Literal["full", "lora"]
Stage = Callable[[str], None]
"""Called with a short description as each stage of an export begins (for a progress display)."""


class ExportError(ValueError):
    """Bad input to an export; ``str()`` is one line naming the problem."""


@dataclass(frozen=True)
class ExportSource:
    """What an export reads.

    Attributes:
        run_dir: the run directory.
        step: the checkpoint step, None for ``final/``.
        kind: ``full`` (weights) or ``lora`` (a PEFT adapter).
        path: the folder holding ``model.safetensors`` / the ``save_pretrained`` files (full) or the adapter files
            (lora).
        base: the base model, name or path (``model.name`` of the run's spec).
        dtype: ``model.dtype`` of the run's spec (``float32`` or ``bfloat16``).
    """

    run_dir: Path
    step: int | None
    kind: Kind
    path: Path
    base: str
    dtype: str

    @property
    def label(self) -> str:
        return "final" if self.step is None else f"step {self.step}"


def export_name(step: int | None, adapter_only: bool) -> str:
    """The folder name of an export under a run's ``exports/``: ``step_<N>`` or ``final``, ``-adapter`` appended for
    an adapter-only export."""
    return ("final" if step is None else f"step_{step}") + ("-adapter" if adapter_only else "")


def source_kind(folder: Path) -> Kind | None:
    """``lora`` for a folder holding the adapter files (in itself or its ``adapter/``), ``full`` for one holding
    ``model.safetensors`` or a ``config.json``, None otherwise."""
    if all((folder / ADAPTER_DIR / f).is_file() for f in ADAPTER_FILES) or all(
        (folder / f).is_file() for f in ADAPTER_FILES
    ):
        return "lora"
    if (folder / WEIGHTS_FILE).is_file() or (folder / "config.json").is_file():
        return "full"
    return None


def is_source_file(rel: PurePosixPath) -> bool:
    """Whether the file ``rel`` (relative to a checkpoint's trainer part or ``final/``) is one an export reads
    (:data:`SOURCE_FILES`, at the top or in ``adapter/``)."""
    return rel.name in SOURCE_FILES and rel.parent in (PurePosixPath("."), PurePosixPath(ADAPTER_DIR))


def source_rel(step: int | None, kind: Kind, path: Path) -> str:
    """Where an export's source is, relative to the run directory (``checkpoints/step_<N>/trainer[/adapter]`` or
    ``final[/adapter]``): what ``provenance.json`` says, true wherever the run directory is moved to."""
    top = "final" if step is None else f"checkpoints/step_{step}/trainer"
    return f"{top}/{ADAPTER_DIR}" if kind == "lora" and path.name == ADAPTER_DIR else top


def adapter_folder(folder: Path) -> Path:
    return folder / ADAPTER_DIR if (folder / ADAPTER_DIR).is_dir() else folder


def read_run_model(run_dir: Path) -> tuple[str, str]:
    """``(model.name, model.dtype)`` of the run's resolved spec (``config.json``); a relative local model path is taken
    relative to the working directory, else to the folder the run was launched in (:func:`launch_relative`).

    Raises:
        ExportError: ``run_dir`` is not a run directory (no folder, no readable ``config.json`` naming ``model.name``).
    """
    config = RunDir(run_dir).config
    if not run_dir.is_dir():
        raise ExportError(f"RUN_DIR: {run_dir} is not a run directory (no such folder)")
    try:
        spec = json.loads(config.read_text())
        model = spec["model"]
        name, dtype = str(model["name"]), str(model.get("dtype", "float32"))
    except FileNotFoundError:
        raise ExportError(f"RUN_DIR: {run_dir} is not a run directory (no config.json)") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ExportError(f"RUN_DIR: {config} does not name model.name ({type(err).__name__}: {err})") from None
    return launch_relative(name, run_dir, spec.get("output_dir")), dtype


def launch_relative(name: str, run_dir: Path, output_dir: Any) -> str:
    """``model.name`` as a path that loads from here: as given when it is absolute, a hub name, or found from the
    working directory; else, for a relative ``output_dir``, taken from the folder the run was launched in (the run
    directory is ``<launch>/<output_dir>/<name>``), where it was found at launch.

    Example: launched in /work with output_dir "outputs" and model.name "outputs/sft/final", the export from /tmp
    reads /work/outputs/sft/final.
    """
    if Path(name).is_absolute() or Path(name).exists() or not isinstance(output_dir, str):
        return name
    out = Path(output_dir)
    root = run_dir.resolve()
    if out.is_absolute() or len(root.parents) <= len(out.parts):
        return name
    launch = root.parents[len(out.parts)]
    candidate = launch / name
    return str(candidate) if candidate.exists() and (launch / out / root.name) == root else name


def find_source(run_dir: str | Path, step: int | None = None) -> ExportSource:
    """What ``asyncrl export RUN_DIR [--step N]`` exports (the table of the module docstring).

    Raises:
        ExportError: not a run directory; ``step`` without a complete checkpoint (the complete steps are listed); no
            ``step`` and neither ``final/`` nor a complete checkpoint; a checkpoint that holds neither weights nor an
            adapter.
    """
    root = Path(run_dir)
    base, dtype = read_run_model(root)
    run = RunDir(root)
    steps = complete_steps(run)
    listed = ", ".join(map(str, steps)) or "none"
    if step is not None:
        if step not in steps:
            raise ExportError(f"--step: {root} has no complete checkpoint at step {step} (complete steps: {listed})")
        folder = run.checkpoint_dir(step) / "trainer"
    elif (kind := source_kind(run.final)) is not None:
        return ExportSource(root, None, kind, adapter_folder(run.final) if kind == "lora" else run.final, base, dtype)
    elif steps:
        step, folder = steps[-1], run.checkpoint_dir(steps[-1]) / "trainer"
    else:
        raise ExportError(f"RUN_DIR: {root} has neither final/ nor a complete checkpoint to export")
    kind_ = source_kind(folder)
    if kind_ is None:
        raise ExportError(f"--step: checkpoint step {step} of {root} holds neither {WEIGHTS_FILE} nor {ADAPTER_DIR}/")
    return ExportSource(root, step, kind_, adapter_folder(folder) if kind_ == "lora" else folder, base, dtype)


def check_out(out: Path) -> None:
    """``out`` may be written: it does not exist, or is an empty folder (or a link to one).

    Raises:
        ExportError: ``out`` is a file, a folder that is not empty, or a link to nothing.
    """
    if out.is_dir():
        if any(out.iterdir()):
            raise ExportError(f"--out: {out} exists and is not empty; choose a new folder")
    elif out.is_symlink() and not out.exists():
        raise ExportError(f"--out: {out} is a link to nothing ({os.readlink(out)}); choose a new folder")
    elif out.exists():
        raise ExportError(f"--out: {out} exists and is not a folder")


def check_adapter_only(source: ExportSource, adapter_only: bool) -> None:
    """Raises ExportError: ``adapter_only`` of a full fine-tune (there is no adapter to write)."""
    if adapter_only and source.kind != "lora":
        raise ExportError(
            f"--adapter-only: {source.label} of {source.run_dir} is a full fine-tune (no {ADAPTER_DIR}/); "
            "export it without --adapter-only"
        )


def _load_full(source: ExportSource, stage: Stage) -> Any:
    """The base model with the source's weights loaded (raises ExportError when they do not fit the base)."""
    from safetensors.torch import load_file

    from worker.policy.models import load_model
    from worker.trainer.dist import tied_output_keys

    if (source.path / "config.json").is_file() and not (source.path / WEIGHTS_FILE).is_file():
        stage(f"loading {source.label} (save_pretrained)")
        return load_model(source.path, source.dtype)
    stage(f"loading base model {source.base}")
    model = load_model(source.base, source.dtype)
    stage(f"loading the weights of {source.label}")
    weights = load_file(source.path / WEIGHTS_FILE)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = tied_output_keys(model)  # published weights leave a tied output projection out
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ExportError(
            f"--step: the weights of {source.label} do not fit the base model {source.base} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if tied:
        model.tie_weights()
    return model


def _load_merged(source: ExportSource, stage: Stage) -> Any:
    """The base model with the source's LoRA adapter merged in (PEFT ``merge_and_unload``)."""
    from peft import PeftModel

    from worker.policy.models import load_model

    stage(f"loading base model {source.base}")
    base = load_model(source.base, source.dtype)
    stage(f"loading the adapter of {source.label}")
    peft_model = PeftModel.from_pretrained(base, str(source.path))
    stage("merging the adapter into the base weights")
    return peft_model.merge_and_unload()


def _write_adapter(source: ExportSource, tmp: Path) -> None:
    """Copy the adapter files (nothing else of the checkpoint), pointing ``base_model_name_or_path`` at the run's base
    model as its spec names it (a hub id, or the path as given: no absolute path of this machine is written)."""
    for name in ADAPTER_FILES:
        shutil.copyfile(source.path / name, tmp / name)
    config = json.loads((tmp / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = source.base
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))


def write_export(
    source: ExportSource, out: str | Path, *, adapter_only: bool = False, stage: Stage | None = None
) -> Path:
    """Write the Hugging Face model directory of ``source`` at ``out`` (the module docstring says what it holds).

    ``out`` may be a link to a folder, or ``.``: what is written is the folder it names (``Path.resolve``). All of it
    is written into a hidden temporary folder beside that folder first; then that folder is renamed to ``out``, or,
    when ``out`` is an existing empty folder (the working folder, a mount point), its files are moved into it (each a
    rename; ``provenance.json`` last). A failure removes everything written.

    Returns:
        ``out`` resolved.

    Raises:
        ExportError: ``out`` exists and is not empty (or is a link to nothing); ``adapter_only`` of a full fine-tune;
            weights that do not fit the base model.
        FileNotFoundError, ValueError: the base model does not load (``worker.policy.models.load_model``).
        DiskFull: the filesystem is full (nothing is left at ``out``).
    """
    from worker.policy.models import load_tokenizer

    say = stage or (lambda _: None)
    check_out(Path(out))
    check_adapter_only(source, adapter_only)
    out = Path(out).resolve()
    tokenizer = load_tokenizer(source.base)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    what = f"the export of {source.label}"
    try:  # a folder that cannot be made is the user's --out, before any write (a full disk stays DiskFull)
        with writing(what, out, partial=tmp):
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    except DiskFull:
        raise
    except OSError as err:  # EACCES, ENOENT (/proc), EROFS, ENOTDIR: the kernel's errno says it is no space
        raise ExportError(f"--out: cannot create {out} ({err.strerror or err}); choose a writable folder") from None
    with writing(what, out, partial=tmp):
        if adapter_only:
            say("writing the adapter")
            _write_adapter(source, tmp)
        else:
            model = _load_merged(source, say) if source.kind == "lora" else _load_full(source, say)
            say(f"writing {out}")
            model.save_pretrained(tmp)
        say("writing the tokenizer and chat template")
        tokenizer.save_pretrained(tmp)
        provenance = {
            "run_dir": str(source.run_dir),
            "step": source.step,
            "source": source_rel(source.step, source.kind, source.path),
            "base_model": source.base,
            "kind": source.kind,
            "merged": source.kind == "lora" and not adapter_only,
            "adapter_only": adapter_only,
        }
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2))
        check_out(out)  # a folder made meanwhile is not replaced
        if out.is_dir():
            _move_into(tmp, out)
        else:
            os.replace(tmp, out)
    return out


def _move_into(tmp: Path, out: Path) -> None:
    """Rename every entry of ``tmp`` into the empty folder ``out`` (``provenance.json`` last), then remove ``tmp``; on
    a failure the entries already moved are removed from ``out`` again (it is left empty) and the error raised."""
    names = sorted(p.name for p in tmp.iterdir() if p.name != PROVENANCE_FILE) + [PROVENANCE_FILE]
    moved: list[Path] = []
    try:
        for name in names:
            os.rename(tmp / name, out / name)
            moved.append(out / name)
    except BaseException:
        for path in moved:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        raise
    tmp.rmdir()


def export_run(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    adapter_only: bool = False,
    stage: Stage | None = None,
) -> tuple[ExportSource, Path]:
    """:func:`find_source` then :func:`write_export`; the input is checked before anything is loaded or written.

    Returns:
        ``(source, out)``.

    Raises:
        As :func:`find_source` and :func:`write_export`.
    """
    source = find_source(run_dir, step)
    check_out(Path(out))
    check_adapter_only(source, adapter_only)
    return source, write_export(source, out, adapter_only=adapter_only, stage=stage)
