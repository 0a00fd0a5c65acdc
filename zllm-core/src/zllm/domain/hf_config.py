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
