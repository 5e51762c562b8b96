"""Reading specs: TOML/JSON files and ``--dotted.key value`` overrides, the unknown-key check, validation.

Every error is a ``SpecError`` of one line naming the dotted key.
"""

from __future__ import annotations

import json
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal, overload

from pydantic import BaseModel, ValidationError

from worker.dotted_keys import closest, with_keys
from worker.spec.orchestrator import (
    AdvantageRangeGate,
    DifficultyPoolCurriculum,
    GrpoAdvantage,
    HierarchicalGrpoAdvantage,
    MaxRLAdvantage,
    RaeAdvantage,
    StandardCurriculum,
)
from worker.spec.runs import ENV_TAGS, SPEC_TYPES, EvalSpec, RLSpec, SFTSpec
from worker.spec.strict import BoolText, SpecError
from worker.spec.trainer import AipoLoss, DppoKlLoss, IcePopLoss, IpoLoss

MAX_DEPTH = 32
"""Deepest nesting of tables and lists a spec (or a JSON request body) may have; the spec itself needs 4 (e.g.
``launcher.slurm.env``), the rest is room for ``env.args``. Deeper input would exhaust the parsers' recursion."""


def nesting_depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Levels of dicts and lists in ``value`` (a scalar is 0, ``{"a": [1]}`` is 2), counted without recursion;
    stops counting once past ``limit`` (returns ``limit + 1``)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > limit:
            return limit + 1
        stack.extend((child, depth + 1) for child in children)
    return deepest


MAX_SPEC_BYTES = 256 * 1024
"""Largest spec, as compact JSON: a spec is a few KiB (100 alert rules about 20 KiB); the rest is room for
``env.args`` (a system prompt). Every run list and comparison carries the specs it shows."""


def check_size(data: Any) -> None:
    """Raises:
    SpecError: ``spec: 300000 bytes as JSON; at most 262144`` (:data:`MAX_SPEC_BYTES`)."""
    size = len(json.dumps(data, separators=(",", ":"), default=str).encode())
    if size > MAX_SPEC_BYTES:
        raise SpecError(f"spec: {size} bytes as JSON; at most {MAX_SPEC_BYTES}")


def check_depth(data: Any, where: str = "spec") -> None:
    """Raises:
    SpecError: ``spec: nested deeper than 32 levels``."""
    if nesting_depth(data) > MAX_DEPTH:
        raise SpecError(f"{where}: nested deeper than {MAX_DEPTH} levels")


def parse_text(text: str | bytes, fmt: Literal["JSON", "TOML"], where: str = "spec") -> Any:
    """Parse JSON or TOML text (bytes: UTF-8) whose nesting is at most ``MAX_DEPTH`` levels. A leading UTF-8 byte
    order mark (editors on Windows write one) is dropped: every spec file, upload and pasted spec is read here.

    Raises:
        SpecError: nested deeper (``<where>: nested deeper than 32 levels``), also when the parser runs out of
            recursion on it.
            A number of more than 4300 digits (Python's limit on converting text to an integer) is a SpecError too.
        json.JSONDecodeError, tomllib.TOMLDecodeError: the text does not parse.
        UnicodeDecodeError: bytes that are not UTF-8 (TOML).
    """
    text = text.removeprefix("\ufeff") if isinstance(text, str) else text.removeprefix(b"\xef\xbb\xbf")
    try:
        data = json.loads(text) if fmt == "JSON" else tomllib.loads(text if isinstance(text, str) else text.decode())
    except RecursionError:
        raise SpecError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:
        if isinstance(err, json.JSONDecodeError | tomllib.TOMLDecodeError | UnicodeDecodeError):
            raise
        raise SpecError(f"{where}: a number has more than {sys.get_int_max_str_digits()} digits") from None
    check_depth(data, where)
    return data


def _submodel(annotation: Any, value: Any) -> type[BaseModel] | None:
    """The pydantic model class a field holds, resolving a union by its tag (``type``, or ``kind`` for alert rules);
    None when no variant takes the value's tag (pydantic names the tag then)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = getattr(annotation, "__args__", ()) or ()
    for arg in args:
        inner = _submodel(arg, value)
        if inner is None:
            continue
        tag = next((f for f in ("type", "kind") if f in inner.model_fields), None)
        if tag is None or not isinstance(value, dict):
            return inner
        field = inner.model_fields[tag]
        allowed = set(typing.get_args(field.annotation)) | ({field.default} if not field.is_required() else set())
        if value.get(tag, field.default) in allowed:
            return inner
    return None


RETIRED_KEYS = {
    "launcher.slurm.trainer_nodes": "the trainer runs on the nodes after the inference ones, nodes - inference_nodes: "
    "remove the key",
}
"""Keys a spec once had, with what to do instead (said in place of the closest valid key)."""


def check_unknown_keys(model: type[BaseModel], data: dict[str, Any], prefix: str = "") -> None:
    """Reject keys the schema does not know, naming the dotted key and the closest valid one.

    Tables in arrays are checked too, named by their index: ``unknown key 'env.1.weigth' (did you mean
    'env.1.weight'?)``.

    Raises:
        SpecError: ``unknown key 'trainer.optim.lrr' (did you mean 'trainer.optim.lr'?)``.
    """
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in model.model_fields:
            hint = closest(key, model.model_fields, cutoff=0.5)
            valid = ", ".join(sorted(model.model_fields))
            suggestion = f"did you mean '{prefix}{hint}'?" if hint else f"valid keys here: {valid}"
            suggestion = RETIRED_KEYS.get(dotted, suggestion)
            raise SpecError(f"unknown key '{dotted}' ({suggestion})")
        annotation = model.model_fields[key].annotation
        if isinstance(value, list):  # arrays of tables ([[env]], [[orchestrator.gates]]): keys ``<key>.<i>.<field>``
            for i, item in enumerate(value):
                inner = _submodel(annotation, item) if isinstance(item, dict) else None
                if inner is not None:
                    check_unknown_keys(inner, item, prefix=f"{dotted}.{i}.")
            continue
        inner = _submodel(annotation, value)
        if inner is not None and isinstance(value, dict):
            check_unknown_keys(inner, value, prefix=f"{dotted}.")


_VARIANT_TAGS = (
    frozenset(
        str(cls.model_fields["type"].default)
        for cls in (
            DppoKlLoss,
            IpoLoss,
            IcePopLoss,
            AipoLoss,
            GrpoAdvantage,
            MaxRLAdvantage,
            RaeAdvantage,
            HierarchicalGrpoAdvantage,
            StandardCurriculum,
            DifficultyPoolCurriculum,
            AdvantageRangeGate,
        )
    )
    | {"custom"}
    | frozenset(ENV_TAGS)
)  # custom: CustomLoss, CustomAdvantage, CustomGate
"""The ``type`` tags of the loss, advantage, curriculum and gate unions and the ``env`` union's: pydantic puts them in an
error's location; messages drop them."""


_EXPECTED = {"int_parsing": "an integer (a whole number)", "float_parsing": "a number"}
"""What a number field expects, by pydantic's error type, in the message that refuses a boolean there."""


def _format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and p in _VARIANT_TAGS))
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "union_tag_invalid":
        ctx = first.get("ctx", {})
        field = str(ctx.get("discriminator", "type")).strip("'")
        field = field if field.isidentifier() else "type"  # a callable discriminator (advantages) reads `type`
        return f"{loc}.{field}: expected one of {ctx.get('expected_tags')}, got {ctx.get('tag')!r}"
    given = first.get("input")
    if isinstance(given, BoolText) and first["type"] in _EXPECTED:  # `max_steps = true`: not "unable to parse string"
        return f"{loc}: expected {_EXPECTED[first['type']]}, got {given} (a boolean)"
    if first["type"] != "missing" and not isinstance(given, dict | list):
        shown = repr(given)  # the value as written, e.g. "max_steps: ... greater than or equal to 1, got -1"
        shown = shown if len(shown) <= 80 else shown[:60] + f"... ({len(shown)} characters)"
        if "got " not in msg:
            msg = f"{msg}, got {shown}"
        elif first["type"] == "int_from_float":  # pydantic's "got a number with a fractional part": the value, then why
            before, _, why = msg.partition("got ")
            msg = f"{before}got {shown} ({why})"
    return f"{loc}: {msg}" if loc else msg


@overload
def validate_spec(kind: Literal["rl"], data: dict[str, Any]) -> RLSpec: ...
@overload
def validate_spec(kind: Literal["sft"], data: dict[str, Any]) -> SFTSpec: ...
@overload
def validate_spec(kind: Literal["eval"], data: dict[str, Any]) -> EvalSpec: ...
@overload
def validate_spec(kind: str, data: dict[str, Any]) -> RLSpec | SFTSpec | EvalSpec: ...
def validate_spec(kind: str, data: dict[str, Any]) -> RLSpec | SFTSpec | EvalSpec:
    """Validate a raw mapping into a spec of ``kind`` (``rl``, ``sft`` or ``eval``).

    Raises:
        SpecError: one line naming the field and what is allowed.
    """
    if kind not in SPEC_TYPES:
        raise SpecError(f"kind: expected one of {sorted(SPEC_TYPES)}, got {kind!r}")
    model = SPEC_TYPES[kind]
    data = dict(data)
    data.setdefault("kind", kind)
    if data["kind"] != kind:
        raise SpecError(f"kind: this command runs '{kind}' specs, got {data['kind']!r}")
    check_depth(data)
    check_size(data)
    if (foreign := spec_kind_of_keys(kind, data)) is not None:
        other, keys = foreign
        raise SpecError(
            f"kind: {', '.join(map(repr, keys))} {'is a key' if len(keys) == 1 else 'are keys'} of {other} specs, "
            f"not of {kind!r} ones: this looks like an {other} spec given as kind {kind!r}"
        )
    check_unknown_keys(model, data)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format_validation_error(err)) from None


MIN_FOREIGN_KEYS = 2
"""Unknown top-level keys of one other kind that make a spec read as that kind's (:func:`spec_kind_of_keys`); one
stray key (an ``orchestrator`` table in an SFT spec) is an unknown key, listed with the valid ones."""


def spec_kind_of_keys(kind: str, data: dict[str, Any]) -> tuple[str, list[str]] | None:
    """The other spec kind(s) a mapping given as ``kind`` belongs to: when at least :data:`MIN_FOREIGN_KEYS` top-level
    keys are unknown to ``kind``'s schema (e.g. ``inference``, ``orchestrator`` in an ``eval`` spec) and all are keys
    of another kind's schema (``SPEC_TYPES``), those kinds quoted and joined by "or" (``"'rl' or 'sft'"`` for
    ``max_steps`` and ``ckpt`` in an eval spec: keys both have) and those keys (sorted); else None (``check_unknown_keys`` names
    a stray key or a typo)."""
    own = SPEC_TYPES[kind].model_fields
    unknown = sorted(k for k in data if k not in own)
    if len(unknown) < MIN_FOREIGN_KEYS:
        return None
    others = [o for o, model in SPEC_TYPES.items() if o != kind and all(k in model.model_fields for k in unknown)]
    return (" or ".join(map(repr, others)), unknown) if others else None


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge ``override`` into a copy of ``base``; nested tables merge, other values are replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override_value(text: str, key: str = "value") -> Any:
    """A CLI value as a TOML literal (``1e-5``, ``true``, ``[0.5, 5]``, ``{A = "1"}``), else, when it opens a table
    or an array (``{`` / ``[``), as JSON (``{"A": "1"}`` for a table-valued key such as ``launcher.slurm.env``),
    else as a plain string.

    Raises:
        SpecError: the literal is nested deeper than ``MAX_DEPTH`` levels; a value opening with ``{`` or ``[`` that
            is neither TOML nor JSON (``<key>: not a JSON object or array: ...``: ``key`` as the caller names it,
            ``--launcher.slurm.env``).
    """
    try:
        return parse_text(f"v = {text}", "TOML", "value")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if not text.lstrip().startswith(("{", "[")):
        return text
    try:
        return parse_text(text, "JSON", key)
    except json.JSONDecodeError as err:
        raise SpecError(
            f"{key}: not a JSON object or array ({err}); expected e.g. '{{\"A\": \"1\"}}' or '[1, 2]'"
        ) from None


def load_spec_data(files: list[str | Path], overrides: list[tuple[str, str]]) -> dict[str, Any]:
    """Read TOML/JSON files (later files win) and apply ``--dotted.key value`` overrides.

    Raises:
        SpecError: a file that is missing, a directory, unreadable, not UTF-8, does not parse (the message
            gives line and column), is nested deeper than ``MAX_DEPTH`` levels or is not a table; an override key
            with an empty part (``--a..b``).
    """
    data: dict[str, Any] = {}
    for f in files:
        path = Path(f)
        fmt: Literal["JSON", "TOML"] = "JSON" if path.suffix == ".json" else "TOML"
        if path.is_dir():
            raise SpecError(f"config file {path} is a directory; expected a {fmt} file")
        if not path.is_file():
            raise SpecError(f"config file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
            layer = parse_text(text, fmt, str(path))
        except OSError as err:
            raise SpecError(f"config file {path}: cannot read ({err.strerror or type(err).__name__})") from None
        except UnicodeDecodeError as err:
            raise SpecError(f"{path}: not valid {fmt}: not UTF-8 text (byte {err.start})") from None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
            raise SpecError(f"{path}: not valid {fmt}: {err}") from None
        if not isinstance(layer, dict):
            raise SpecError(f"{path}: expected a JSON object of spec keys, got {type(layer).__name__}")
        data = deep_merge(data, layer)
    for dotted, raw in overrides:
        if not all(dotted.split(".")):
            raise SpecError(f"--{dotted}: expected a dotted key such as --trainer.optim.lr")
        if dotted.count(".") >= MAX_DEPTH:
            raise SpecError(f"--{dotted.split('.')[0]}...: nested deeper than {MAX_DEPTH} levels")
        data = deep_merge(data, with_keys({}, {dotted: parse_override_value(raw, f"--{dotted}")}))
    return data


CHAINED_MODEL_KEYS: dict[str, tuple[str, ...]] = {"sft": ("name",), "rl": ("name",), "eval": ("name", "run", "step")}
"""The ``model`` keys a pipeline stage after the first takes from the stage it starts from (``server.services.pipelines``
sets them; a stage that gives one is refused)."""


def load_pipeline_data(path: Path) -> dict[str, Any]:
    """A pipeline spec file (TOML, or JSON by its suffix) with each stage's ``base = "run.toml"`` (relative to the
    pipeline file) read inline, as ``POST /api/pipelines`` takes it. A stage after the first starts from an earlier
    stage's weights, so the ``model`` keys it takes from there (:data:`CHAINED_MODEL_KEYS`) are left out of its base
    FILE: a run spec file names its own model for use on its own (``configs/reverse_text/rl.toml``). Written in the
    pipeline file itself (an inline base, ``overrides``), they are refused by the service.

    Raises:
        SpecError: the file or a stage's base is missing, unreadable or does not parse (``stages[i].base: ...``).
    """
    data = load_spec_data([path], [])
    for i, stage in enumerate(data.get("stages") or []):
        if not (isinstance(stage, dict) and isinstance(stage.get("base"), str)):
            continue
        base = Path(stage["base"]) if Path(stage["base"]).is_absolute() else path.parent / stage["base"]
        if not base.is_file():
            raise SpecError(f"stages[{i}].base: run spec file not found: {base}")
        stage["base"] = load_spec_data([base], [])
        model = stage["base"].get("model")
        if i > 0 and isinstance(model, dict):
            for key in CHAINED_MODEL_KEYS.get(str(stage.get("kind")), ()):
                model.pop(key, None)
            if not model:
                del stage["base"]["model"]
    return data
