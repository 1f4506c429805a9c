"""The base of every config section: unknown keys, NaN and infinities rejected, values frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    # NaN and ±inf pass a "gt=0" check (inf) or make it meaningless: no numeric field takes them
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
