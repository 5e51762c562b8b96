"""The base of every spec table and the spec's error type."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, model_validator

MAX_TEXT = 4096
"""Longest text value of a spec table (names, paths, URLs, ids, options); free-form ``env.args`` are bounded by the
spec's size (``worker.spec.loading.MAX_SPEC_BYTES``)."""


MIN_PORT = 1024
"""Lowest TCP port a spec may name for a run's own servers (vLLM, torchrun's rendezvous, the weight-sync store): below
it are the system services' ports (ssh 22, http 80, ...), which only root may bind and a run never needs."""


def check_port(v: int, *, free: bool) -> int:
    """A port a run's process listens on: ``MIN_PORT``-65535, or 0 (``free``: a free port is picked).

    Raises:
        ValueError: one line saying what is allowed and the value given.
    """
    if (free and v == 0) or MIN_PORT <= v <= 65535:
        return v
    zero = "0 (a free port) or " if free else ""
    raise ValueError(
        f"expected {zero}a port from {MIN_PORT} to 65535 (below {MIN_PORT}: system services' ports), got {v}"
    )


class SpecError(ValueError):
    """A spec that cannot be used; the message is one line naming the field and what is allowed."""


class BoolText(str):
    """A boolean given where a number is expected, passed on as its text (``"true"``) so the number field refuses it;
    ``worker.spec.loading`` words that refusal as "expected an integer/a number, got true (a boolean)"."""

    __slots__ = ()


class StrictModel(BaseModel):
    """A spec table: unknown keys refused, assignments validated, numbers taken as text where text is expected."""

    # coerce_numbers_to_str: ``--name 123`` or ``--model.name 2024`` parse as TOML numbers; text fields take them as text
    # allow_inf_nan=False: `lr = inf` or `--trainer.optim.lr nan` is refused naming the key (JSON would store null)
    # str_max_length: a name, path, URL or id is short; a 7 MB `model.name` was stored and sent with every run list
    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        coerce_numbers_to_str=True,
        allow_inf_nan=False,
        str_max_length=MAX_TEXT,
    )

    @model_validator(mode="before")
    @classmethod
    def _bool_is_not_a_number(cls, data: Any) -> Any:
        """``true`` is not a number, though pydantic reads it as 1 (``--orchestrator.batch_size true``): it is passed
        on as the text ``"true"`` (a :class:`BoolText`), which the number field refuses naming its key."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if isinstance(value, bool) and field is not None:
                kinds = set(get_args(field.annotation)) or {field.annotation}
                if bool not in kinds and kinds & {int, float}:
                    out[name] = BoolText(str(value).lower())
        return out
