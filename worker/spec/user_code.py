"""Code a spec names: which import paths a run submitted to the service may name (the one rule).

Some spec fields name code to import: ``env.id`` (a verifiers Taskset), ``orchestrator.harness.id`` (a verifiers
harness) and the ``import_path`` of every ``type = "custom"`` table (:class:`CustomCode`: losses, advantages). Each is
declared by its type, ``Annotated[str, ImportPath(...)]``; :func:`import_paths` finds them in a spec and
:func:`check_import_path` is the rule every one of them goes through. A value is allowed when it is

- a built-in id of that field (``BUILTIN_ENVS``; verifiers' own harnesses),
- the name of an entry point of the field's group (``asyncrl.environments``): a package the admin installed
  registered it, or
- code from a package the admin allows: its top-level package is in ``allowed`` (the service passes its
  ``ALLOWED_CODE_PACKAGES``; default none).

A local ``asyncrl rl`` (no service) does not check: its user runs their own code. Reading entry points and the
built-in tables imports nothing (``importlib.metadata`` only), so the server checks without verifiers or torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from worker.spec.strict import SpecError, StrictModel

BUILTIN_ENVS = {
    "arithmetic": "worker.envs.arithmetic:ArithmeticTaskset",
    "reverse_text": "worker.envs.reverse_text:ReverseTextTaskset",
    "reverse_twice": "worker.envs.reverse_twice:ReverseTwiceTaskset",
    "reverse_tool": "worker.envs.reverse_tool:ReverseToolTaskset",
    "self_play": "worker.envs.self_play:SelfPlayTaskset",
}
"""Built-in environment ids and the Taskset class each names (``module:attr``)."""
ENV_ENTRY_POINTS = "asyncrl.environments"
"""Entry point group of environments installed packages register: ``name = "package.module:attr"``."""
PLUGIN_ENTRY_POINTS = "asyncrl.plugins"
"""Entry point group of plugin functions (custom losses and advantages) installed packages register."""
SETTING = "ALLOWED_CODE_PACKAGES"
"""The server setting that lists the allowed top-level packages (named in refusals)."""

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class CodeNotAllowed(SpecError):
    """A spec names code the service does not run (one line naming the key and what is allowed)."""


def verifiers_harnesses() -> list[str]:
    """verifiers' built-in harness ids (its ``verifiers.v1.harnesses`` subpackages), read from the installed files
    without importing verifiers; empty when it is not installed."""
    try:
        files = importlib.metadata.distribution("verifiers").files or []
    except importlib.metadata.PackageNotFoundError:
        return []
    prefix = "verifiers/v1/harnesses/"
    names = {str(f)[len(prefix) :].split("/")[0] for f in files if str(f).startswith(prefix) and str(f).endswith(".py")}
    return sorted(n for n in names if _IDENT.match(n) and not n.startswith("_") and n != "utils")


@dataclass(frozen=True)
class ImportPath:
    """Marks a spec field whose value names code: ``Annotated[str, ImportPath("environment", ...)]``.

    ``form`` is how a value names code: ``"attr"`` = ``package.module:attr``; ``"module"`` = a module name as
    verifiers' plugin loader takes it (``owner/name@version`` hub ids import ``name``, ``-`` becomes ``_``)."""

    what: str
    """What the field names, for messages (``environment``)."""
    builtins: Callable[[], Collection[str]] = tuple
    """The field's built-in ids (always allowed)."""
    entry_points: str | None = None
    """Entry point group whose names are allowed (registered by installed packages)."""
    form: Literal["attr", "module"] = "attr"

    def registered(self) -> dict[str, str]:
        """Entry point name -> value (``package.module:attr``) of the field's group."""
        if self.entry_points is None:
            return {}
        return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=self.entry_points)}

    def package(self, value: str) -> str | None:
        """The top-level package ``value`` imports, None when it is not a well-formed path of the field's form."""
        if self.form == "module":
            module = value.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
            attr = "x"
        else:
            module, _, attr = value.partition(":")
        parts = module.split(".")
        if not all(_IDENT.match(p) for p in parts) or not _IDENT.match(attr) or attr.startswith("_"):
            return None
        return parts[0]


ENV_ID = ImportPath("environment", builtins=lambda: BUILTIN_ENVS, entry_points=ENV_ENTRY_POINTS)
"""``env.id``."""
HARNESS_ID = ImportPath("harness", builtins=lambda: {"null", *verifiers_harnesses()}, form="module")
"""``orchestrator.harness.id``: verifiers imports ``verifiers.v1.harnesses.<id>``, else the module ``<id>``. The
default ``null`` is always allowed (a server without verifiers installed still takes default specs)."""


PLUGIN = ImportPath("plugin function", entry_points=PLUGIN_ENTRY_POINTS)
"""``import_path`` of a ``type = "custom"`` loss or advantage: ``package.module:function``, or the name of an entry
point of ``asyncrl.plugins``."""


class CustomCode(StrictModel):
    """The fields of every ``type = "custom"`` table: the function to call and its keyword arguments.

    What the function must accept is its registry's (``worker/trainer/loss/__init__.py``,
    ``worker/orchestrator/advantages/__init__.py``); :func:`load_function` checks it at launch and in
    ``asyncrl rl --dry-run``, the service checks the path at submit (:func:`check_spec_code`)."""

    import_path: Annotated[str, PLUGIN] = Field(min_length=1)
    """``package.module:function`` (or an ``asyncrl.plugins`` entry point name); at the service only code of an
    allowed package (``ALLOWED_CODE_PACKAGES``)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the function on every call (a TOML table)."""

    @field_validator("import_path")
    @classmethod
    def _form(cls, v: str) -> str:
        if PLUGIN.package(v) is None and v not in PLUGIN.registered():
            raise ValueError(f"expected package.module:function, got {v!r}")
        return v


def load_function(key: str, value: str, *, args: Sequence[str], kwargs: Mapping[str, Any]) -> Callable[..., Any]:
    """Import the plugin function ``value`` of the dotted spec ``key`` and check that it takes the positional
    arguments ``args`` (names, for messages) plus ``kwargs``. Imports user code: call it at launch, never at submit.

    Returns:
        The function.

    Raises:
        SpecError: one line naming ``key``: the module does not import, it has no such attribute, the attribute is
            not callable, or its parameters do not take ``args`` and ``kwargs``
            (``trainer.loss.import_path: pkg.mod:fn(x) cannot be called as fn(inputs, scale=...): got an unexpected
            keyword argument 'scale'``).
    """
    target = PLUGIN.registered().get(value, value)
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure of user code to import is the spec's error
        reason = " ".join(str(err).split())  # one line, whatever the module raised
        raise SpecError(f"{key}: cannot import {module_name!r}: {type(err).__name__}: {reason}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise SpecError(f"{key}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise SpecError(f"{key}: {target} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin without a signature: trusted as called
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        call = ", ".join([*args, *(f"{k}=..." for k in kwargs)])
        bare = signature.replace(  # parameters as written, without annotations: short and one line
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        raise SpecError(f"{key}: {target}{bare} cannot be called as {attr}({call}): {err}") from None
    return fn


def check_import_path(key: str, value: str, allowed: Collection[str], kind: ImportPath | None = None) -> None:
    """Refuse ``value`` of the dotted spec ``key`` unless it is allowed (see the module docstring); ``kind`` is the
    field's :class:`ImportPath` (default: a plain ``package.module:attr`` with no built-ins).

    Raises:
        CodeNotAllowed: ``env.id: 'os:system' is not allowed in a run submitted to the service; allowed: a
            built-in environment (arithmetic, reverse_text, reverse_tool, reverse_twice) or code from an allowed
            package (ALLOWED_CODE_PACKAGES: none)``.
    """
    kind = kind or ImportPath("import path")
    builtins = sorted(kind.builtins())
    registered = kind.registered()
    if value in builtins or value in registered:
        return
    package = kind.package(value)
    if package is not None and package in allowed:
        return
    options = [f"a built-in {kind.what} ({', '.join(builtins)})"] if builtins else []
    if registered:
        options.append(f"one registered under the {kind.entry_points!r} entry points ({', '.join(sorted(registered))})")
    form = "package.module:attr" if kind.form == "attr" else "a module"
    options.append(f"{form} from an allowed package ({SETTING}: {', '.join(sorted(allowed)) or 'none'})")
    shown = ", ".join(options[:-1]) + (" or " if len(options) > 1 else "") + options[-1]
    raise CodeNotAllowed(f"{key}: {value!r} is not allowed in a run submitted to the service; allowed: {shown}")


def import_paths(spec: BaseModel, prefix: str = "") -> Iterator[tuple[str, str, ImportPath]]:
    """(dotted key, value, kind) of every :class:`ImportPath` field set in ``spec``, nested tables and lists of
    tables included."""
    for name, field in type(spec).model_fields.items():
        value: Any = getattr(spec, name)
        key = f"{prefix}{name}"
        marks = [m for m in field.metadata if isinstance(m, ImportPath)]
        if marks and isinstance(value, str):
            yield key, value, marks[0]
        elif isinstance(value, BaseModel):
            yield from import_paths(value, f"{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from import_paths(item, f"{key}.{i}.")


def check_spec_code(spec: BaseModel, allowed: Collection[str]) -> None:
    """:func:`check_import_path` on every import path of ``spec`` (a validated spec).

    Raises:
        CodeNotAllowed: the first one not allowed, naming its key.
    """
    for key, value, kind in import_paths(spec):
        check_import_path(key, value, allowed, kind)
