#!/usr/bin/env python3
"""Fail unless every test named in compat/verified.toml ran and passed in a junit report.

Usage::

    python -m pytest --junitxml=junit.xml          # from the repository root
    python tools/check_verified.py junit.xml [compat/verified.toml]

The file names tests in two kinds of table: ``[[cell]]`` (the tests behind a verified cell)
and ``[[kernel]]`` (the tests behind one backend kernel; a cell whose every kernel has them
is kernel-verified). Both count: a cell of COMPATIBILITY.md is only as true as the tests
behind it, and this check keeps an entry from outliving its test (renamed, deleted,
skipped, failing). Exit status:
0 all listed tests passed; 1 some did not (each is named with what happened); 2 usage or
unreadable input.

Node IDs are matched the way pytest writes them into junit XML: ``path/to/test_x.py::Cls::
test_y[p]`` becomes ``classname="path.to.test_x.Cls"`` and ``name="test_y[p]"``, with the
path relative to pytest's rootdir — so run pytest from the repository root, where the node
IDs in verified.toml are rooted. The default verified file is the one in this script's
repository (``../compat/verified.toml``), independent of the current directory.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_VERIFIED = Path(__file__).resolve().parents[1] / "compat" / "verified.toml"


def junit_key(node_id: str) -> tuple[str, str]:
    """``(classname, name)`` pytest's junitxml writes for a node ID (``mangle_test_address``)."""
    path, *rest = node_id.split("::")
    if not rest:
        raise ValueError(f"{node_id!r} is not a test node ID (expected 'path.py::test_name')")
    module = path.replace("\\", "/").removesuffix(".py").replace("/", ".")
    return ".".join([module, *rest[:-1]]), rest[-1]


def outcomes(junit_xml: Path) -> dict[tuple[str, str], str]:
    """``(classname, name)`` -> ``passed`` | ``failed`` | ``error`` | ``skipped`` for every testcase."""
    result: dict[tuple[str, str], str] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        tags = {child.tag for child in case}
        outcome = ("failed" if "failure" in tags else "error" if "error" in tags
                   else "skipped" if "skipped" in tags else "passed")
        # a test that passed but errored in teardown appears twice; the worst outcome wins
        if result.get(key, "passed") == "passed":
            result[key] = outcome
    return result


def listed_tests(verified_toml: Path) -> list[tuple[str, str]]:
    """``(what it backs, node_id)`` for every test the verified file lists: the ``[[cell]]``
    claims (``llama x cpu x hf-f32 (verified)``) and the ``[[kernel]]`` evidence behind
    kernel-verified cells (``cuda rms_norm[f32] (kernel-verified)``)."""
    from zllm.compat import load_verified  # one parser for the schema: the one `zllm compat` uses

    return load_verified(verified_toml).tests()


def check(junit_xml: Path, verified_toml: Path) -> list[str]:
    """One line per listed test that did not run and pass; empty when all did."""
    ran = outcomes(junit_xml)
    problems = []
    for cell, node in listed_tests(verified_toml):
        outcome = ran.get(junit_key(node), "did not run")
        if outcome != "passed":
            problems.append(f"{node}: {outcome} (listed for {cell})")
    return problems


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2 or argv[0] in ("-h", "--help"):
        print("\n\n".join(__doc__.strip().split("\n\n")[1:3]), file=sys.stderr)
        return 2
    junit_xml = Path(argv[0])
    verified_toml = Path(argv[1]) if len(argv) == 2 else DEFAULT_VERIFIED
    from zllm.spec.errors import ConfigError

    try:
        problems = check(junit_xml, verified_toml)
        count = len(listed_tests(verified_toml))
    except (OSError, ET.ParseError, ValueError, ConfigError) as exc:  # ConfigError names the key path
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if problems:
        print(f"{len(problems)} of {count} tests listed in {verified_toml} did not pass in {junit_xml}:",
              file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"{count} tests listed in {verified_toml}: all ran and passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
