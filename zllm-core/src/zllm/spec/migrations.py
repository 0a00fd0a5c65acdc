"""Config schema versions and the registered migrations between them.

A config carries ``schema_version``; a file without one is version 0. Each migration is a
function registered with :func:`migration` for the version it upgrades *from*; it edits
the mapping in place and returns what it changed, in words. :func:`migrate` runs them in
order up to :data:`SCHEMA_VERSION`. Migrations work on ruamel's ``CommentedMap`` (keys
are renamed where they stand, with their comments) as well as on plain dicts, so
:func:`migrate_file_text` can rewrite a user's file without losing a comment.

History:

* **0 → 1**: ``model.checkpoint`` became ``model.path``; the top-level ``sampling:``
  section (``temperature``, ``top_p``, ``top_k``, ``max_tokens``) became ``generation:``,
  with ``max_tokens`` renamed ``max_new_tokens``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, MutableMapping
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import MarkedYAMLError

from zllm.spec.errors import ConfigError

SCHEMA_VERSION = 1
"""The config schema version this zllm-core reads; older configs are migrated to it."""

Migration = Callable[[MutableMapping[str, Any]], list[str]]
"""Edits a config mapping in place from one version to the next; returns the changes made."""

_MIGRATIONS: dict[int, Migration] = {}


def migration(from_version: int) -> Callable[[Migration], Migration]:
    """Register the decorated function as the migration from ``from_version`` to the next.

    Raises:
        ValueError: a migration from ``from_version`` is already registered (import order
            must never decide which one runs).
    """
    assert 0 <= from_version < SCHEMA_VERSION, f"no schema_version {from_version + 1} to migrate to"

    def register(fn: Migration) -> Migration:
        if from_version in _MIGRATIONS:
            have = _MIGRATIONS[from_version]
            raise ValueError(
                f"a migration from schema_version {from_version} is already registered: "
                f"{have.__module__}.{have.__qualname__}; refusing {fn.__module__}.{fn.__qualname__}"
            )
        _MIGRATIONS[from_version] = fn
        return fn

    return register


def migrate(data: MutableMapping[str, Any]) -> tuple[MutableMapping[str, Any], list[str]]:
    """Upgrade a config mapping, in place, to :data:`SCHEMA_VERSION`.

    Args:
        data: the top-level config mapping (a ruamel ``CommentedMap`` keeps its comments).

    Returns:
        ``(data, changes)``: the same mapping, now at :data:`SCHEMA_VERSION`, and one
        sentence per change (empty when it already was).

    Raises:
        ConfigError: ``schema_version`` is not an int >= 0, is newer than
            :data:`SCHEMA_VERSION` (the message names both numbers), or the old config
            cannot be translated unambiguously (the path names the old key).
    """
    version = data.get("schema_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError("schema_version", f"expected an int >= 0, got {version!r}")
    if version > SCHEMA_VERSION:
        raise ConfigError(
            "schema_version",
            f"the config has schema_version {version}, but this zllm-core reads schema_version "
            f"{SCHEMA_VERSION} and older; upgrade zllm-core",
        )
    changes: list[str] = []
    for step in range(version, SCHEMA_VERSION):
        changes += _MIGRATIONS[step](data)
    if version < SCHEMA_VERSION:
        if "schema_version" in data:
            data["schema_version"] = SCHEMA_VERSION
        else:
            _insert_first(data, "schema_version", SCHEMA_VERSION)
        changes.append(f"schema_version {version} -> {SCHEMA_VERSION}")
    return data, changes


def load_yaml_text(text: str, source: str) -> CommentedMap:
    """Parse a config file's text with ruamel's round-trip loader (comments kept).

    Args:
        text: the YAML text.
        source: what to call it in errors, usually the file name.

    Raises:
        ConfigError: malformed YAML or a duplicate key (the message names ``source``, line
            and column), or a top level that is not a mapping.
    """
    try:
        data = _round_trip_yaml().load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "malformed YAML"
        raise ConfigError("", f"invalid YAML in {source}{where}: {problem}") from exc
    if not isinstance(data, CommentedMap):
        got = "an empty file" if data is None else "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        raise ConfigError("", f"{source}: expected a mapping of config sections, got {got}")
    return data


def migrate_file_text(text: str, source: str = "<config>") -> str:
    """Return a config file's text migrated to :data:`SCHEMA_VERSION`, comments preserved.

    Args:
        text: the YAML text of a config file.
        source: name used in error messages.

    Raises:
        ConfigError: as :func:`load_yaml_text` and :func:`migrate`.
    """
    data, _changes = migrate(load_yaml_text(text, source))
    out = io.StringIO()
    _round_trip_yaml().dump(data, out)
    return out.getvalue()


def _round_trip_yaml() -> YAML:
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap a user's long strings
    return yaml


def _insert_first(m: MutableMapping[str, Any], key: str, value: Any) -> None:
    if isinstance(m, CommentedMap):
        m.insert(0, key, value)
        return
    rest = list(m.items())
    m.clear()
    m[key] = value
    m.update(rest)


def _rename(m: MutableMapping[str, Any], old: str, new: str) -> None:
    """Rename ``old`` to ``new`` where it stands, moving a CommentedMap's comment with it."""
    if isinstance(m, CommentedMap):
        position = list(m).index(old)
        comment = m.ca.items.pop(old, None)
        m.insert(position, new, m.pop(old))
        if comment is not None:
            m.ca.items[new] = comment
        return
    items = [(new if k == old else k, v) for k, v in m.items()]
    m.clear()
    m.update(items)


_V0_SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p")


@migration(from_version=0)
def _sampling_becomes_generation(data: MutableMapping[str, Any]) -> list[str]:
    changes = []
    model = data.get("model")
    if isinstance(model, MutableMapping) and "checkpoint" in model:
        if "path" in model:
            raise ConfigError(
                "model.checkpoint", "renamed model.path in schema_version 1, and both are set; keep model.path"
            )
        _rename(model, "checkpoint", "path")
        changes.append("model.checkpoint renamed model.path")
    if "sampling" not in data:
        return changes
    if "generation" in data:
        raise ConfigError(
            "sampling", "became generation: in schema_version 1, and both are set; move its keys into generation:"
        )
    sampling = data["sampling"]
    if isinstance(sampling, MutableMapping):
        for key in sampling:
            if key not in _V0_SAMPLING_KEYS:
                raise ConfigError(
                    f"sampling.{key}",
                    f"unknown key in a schema_version 0 sampling: section; valid keys: {', '.join(_V0_SAMPLING_KEYS)}",
                )
        if "max_tokens" in sampling:
            _rename(sampling, "max_tokens", "max_new_tokens")
            changes.append("sampling.max_tokens renamed generation.max_new_tokens")
    # A non-mapping `sampling:` moves as it is; structuring then reports it at `generation`.
    _rename(data, "sampling", "generation")
    changes.append("section sampling: renamed generation:")
    return changes
