"""Inspection subcommands: ``plugins``, ``config validate|migrate``, ``card``, ``compat``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zllm.spec.errors import ConfigError


def _host():
    from zllm.engine.engine import plugin_allowlist_from_env
    from zllm.plugins.host import PluginHost

    return PluginHost(allowlist=plugin_allowlist_from_env())


def _reason(host, rec) -> str:
    """Why a plugin is not loaded or, for a loaded one, why each of its backends cannot run here."""
    from zllm.plugins.selection import unavailable_reason

    backends = [k.removeprefix("backend:") for k in rec.kinds if k.startswith("backend:")]
    whys = [(name, unavailable_reason(host.backends[name])[1]) for name in backends]
    return rec.reason or "; ".join(f"backend {name} unavailable: {why}" for name, why in whys if why)


def cmd_plugins(args: argparse.Namespace) -> int:
    host = _host()
    rows = [
        {"name": r.name, "distribution": r.distribution, "version": r.version, "kind": r.kind,
         "status": r.status, "reason": _reason(host, r), "api": r.api, "requires_core": r.requires_core}
        for r in host.records
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = ("name", "distribution", "version", "kind", "status", "reason")
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in cols}
    print("  ".join(c.upper().ljust(widths[c]) for c in cols).rstrip())
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols).rstrip())
    if not rows:
        print("(no zllm plugins installed)")
    return 0


def cmd_config_validate(args: argparse.Namespace) -> int:
    from zllm.spec.config import load_config

    cfg = load_config(args.file)
    print(f"{args.file}: valid (schema_version {cfg.schema_version})")
    return 0


def cmd_config_migrate(args: argparse.Namespace) -> int:
    from zllm.spec.migrations import migrate_file_text

    path = Path(args.file)
    if args.in_place and args.output:
        raise ConfigError("", "give --in-place or --output, not both")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("", f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"{path}: cannot read: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    migrated = migrate_file_text(text, str(path))
    if args.in_place or args.output:
        out = path if args.in_place else Path(args.output)
        try:
            out.write_text(migrated, encoding="utf-8")
        except OSError as exc:
            raise ConfigError("", f"{out}: cannot write: {exc.strerror}") from None
    else:
        sys.stdout.write(migrated)
    return 0


def cmd_card(args: argparse.Namespace) -> int:
    from zllm.engine.loader import resolve_family
    from zllm.weights import build_model_card, open_checkpoint

    host = _host()
    ckpt = open_checkpoint(args.path, gguf_maps=host.gguf_maps)
    family = resolve_family(host, ckpt).name
    sys.stdout.write(build_model_card(ckpt, family).to_yaml())
    return 0


def cmd_compat(args: argparse.Namespace) -> int:
    from zllm.compat import compute_matrix, render

    verified = Path(args.verified) if args.verified else None
    sys.stdout.write(render(compute_matrix(_host(), verified), args.format))
    return 0
