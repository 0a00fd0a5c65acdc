"""Values of a checkpoint's ``config.json`` read as transformers reads them, with a clear
error where transformers would coerce a wrong type silently."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zllm.spec.errors import CheckpointError


def config_flag(cfg: Mapping[str, Any], key: str, default: bool, source: str) -> bool:
    """``cfg[key]`` as a flag: ``default`` when absent, false when null (a transformers config
    stores the null and its model tests it for truth).

    Raises:
        CheckpointError: on ``source`` naming ``key``, unless the value is true, false or null
            (``bool("false")`` is True, so a string is refused rather than read).
    """
    value = cfg.get(key, default)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise CheckpointError(source, f"{key} {value!r} is not true or false")
    return value


def config_int(cfg: Mapping[str, Any], key: str, source: str, default: int | None = None, *,
               model_type: str = "") -> int:
    """``cfg[key]`` as an integer >= 1; ``default`` when absent or null. An integral float
    (``64.0``, as some exporters write sizes) reads as its integer.

    Raises:
        CheckpointError: on ``source`` naming ``key``: it is absent or null and there is no
            default (``"<model_type> config lacks required key"``), or the value (the default
            included: a computed one can be 0) is a bool, a string, a fractional float, zero or
            negative.
    """
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(source, f"{model_type + ' ' if model_type else ''}config lacks required key {key!r}")
        value = default
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not value.is_integer()) or value < 1):
        raise CheckpointError(source, f"{key} {value!r} is not a positive integer")
    return int(value)
