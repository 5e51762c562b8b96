"""The base of every spec table and the spec's error type."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class SpecError(ValueError):
    """A spec that cannot be used; the message is one line naming the field and what is allowed."""


class StrictModel(BaseModel):
    """A spec table: unknown keys refused, assignments validated, numbers taken as text where text is expected."""

    # coerce_numbers_to_str: ``--name 123`` or ``--model.name 2024`` parse as TOML numbers; text fields take them as text
    # allow_inf_nan=False: `lr = inf` or `--trainer.optim.lr nan` is refused naming the key (JSON would store null)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True, allow_inf_nan=False)
