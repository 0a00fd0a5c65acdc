"""``zllm conformance``: check an installed backend's kernels and models against the f32 references.

stdout: one line per (kernel, op[variant]) and per model, then the verdict. stderr: one
``FAIL`` line per failing kernel case and model. Exit 0 when everything passed, 1 on any
failure, 2 on a usage error (unknown or unavailable backend, ``--ops`` matching nothing,
a rejected ``--device``, a ``--seed`` out of range, a ``--report`` that cannot be written).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from zllm.spec.errors import ConfigError

EXIT_FAILED = 1


def add_parser(sub) -> None:
    """Register the ``conformance`` subcommand on ``sub`` (argparse subparsers); importing this
    module imports no torch, so ``zllm --help`` stays fast."""
    p = sub.add_parser(
        "conformance",
        help="check a backend's kernels and end-to-end logits against the f32 references",
        description="Run every kernel the backend registers on generated cases against the f32 "
                    "reference of its op, then small models end to end; exit 0 when all pass, 1 on any failure.",
    )
    p.add_argument("--backend", required=True,
                   help="backend name, as `zllm plugins` lists it, or auto (the one `backend.name: auto` picks here)")
    p.add_argument("--device", help="device passed to the backend's constructor (e.g. cuda:1)")
    p.add_argument("--threads", type=_positive_int, help="threads passed to the backend's constructor")
    p.add_argument("--ops", help="comma-separated op names to check (kernel checks only); default: every op")
    p.add_argument("--quick", action="store_true", help="fewer cases per op")
    p.add_argument("--seed", type=_seed, default=0, help="seed of every generated input, in [0, 2**64) (default 0)")
    p.add_argument("--dtype", choices=("auto", "f32", "f16", "bf16"), default="auto",
                   help="load dtype of dense model weights in the end-to-end check (default: as stored)")
    p.add_argument("--model", action="append", default=[], metavar="PATH",
                   help="also check this checkpoint end to end (HF directory or GGUF file); repeatable")
    p.add_argument("--report", metavar="FILE",
                   help="write FILE.json and FILE.md (FILE.json or FILE.md: both with those suffixes)")
    p.set_defaults(func=cmd_conformance)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {value}")
    return value


def check_report_target(report: str) -> None:
    """Fail before the run, not after it, when ``--report FILE`` cannot be written: an empty
    name, a directory, a missing or read-only parent folder.

    Raises:
        ConfigError: on ``--report``, saying why.
    """
    from zllm.conformance.report import report_paths

    if not report.strip():
        raise ConfigError("--report", "needs a file name, e.g. --report conformance")
    if report.endswith(("/", os.sep)) or Path(report).is_dir():
        raise ConfigError("--report", f"{report} is a directory; give a file name such as "
                                      f"{os.path.join(report, 'conformance')}")
    for path in report_paths(report):
        if path.is_dir():
            raise ConfigError("--report", f"{path} is a directory")
        if not path.parent.is_dir():
            raise ConfigError("--report", f"{path.parent}: no such directory")
        if path.exists() and not os.access(path, os.W_OK):
            raise ConfigError("--report", f"{path} exists and is read-only")
        try:  # the one test that holds for every reason a folder refuses a file (permissions, read-only mount)
            tempfile.NamedTemporaryFile(dir=path.parent, prefix=".zllm-conformance-").close()
        except OSError as exc:
            raise ConfigError("--report", f"cannot write in {path.parent}: {exc.strerror or exc}") from None


def cmd_conformance(args: argparse.Namespace) -> int:
    from zllm.conformance import run_conformance
    from zllm.conformance.report import CaseResult

    if args.report is not None:
        check_report_target(args.report)
    ops = None if args.ops is None else args.ops.split(",")
    groups: dict[str, list[CaseResult]] = {}

    def on_kernel(r: CaseResult) -> None:
        # One line per kernel and capability, printed when the next one starts.
        key = f"{r.title} (priority {r.priority})" if r.priority else r.title
        if groups and key not in groups:
            _print_group(*groups.popitem())
        groups.setdefault(key, []).append(r)

    def on_model(r) -> None:
        if groups:
            _print_group(*groups.popitem())
        mode = f" [{r.mode}]" if r.mode else ""
        print(f"{r.status.upper():7} e2e {r.model}{mode}: {r.detail}", flush=True)

    report = run_conformance(args.backend, device=args.device, threads=args.threads, ops=ops, quick=args.quick,
                             seed=args.seed, dtype=args.dtype, models=args.model, on_kernel=on_kernel,
                             on_model=on_model)
    if groups:
        _print_group(*groups.popitem())
    if "e2e" in report.settings:
        print(f"SKIPPED e2e: {report.settings['e2e']}")
    for line in report.failures():
        print(line, file=sys.stderr)
    write_error: OSError | None = None
    if args.report is not None:
        try:
            written = report.write(args.report)
        except OSError as exc:
            write_error = exc
        else:
            print(f"report: {written[0]} {written[1]}")
    n_failed = len(report.failures())
    verdict = "PASSED" if report.passed else f"FAILED ({n_failed} failure{'s' if n_failed != 1 else ''})"
    print(f"conformance of backend {report.backend!r} on {report.device}: {verdict} — "
          f"{len(report.kernels)} kernel cases, {len(report.e2e)} models "
          f"({sum(r.status == 'skipped' for r in report.e2e)} skipped)")
    if write_error is not None:  # after the verdict, so the run's outcome is not lost
        raise ConfigError("--report", f"cannot write the report: {write_error}")
    return 0 if report.passed else EXIT_FAILED


def _print_group(title: str, results: list) -> None:
    passed = sum(r.passed for r in results)
    failed = [r for r in results if r.failed]
    errs = [r.max_abs_err for r in results if r.max_abs_err is not None]
    status = "FAIL" if failed else "PASS" if passed else "SKIPPED"
    if status == "SKIPPED":
        err = results[0].detail
    elif errs:
        err = f"max abs err {max(errs):.3g}"
    elif failed:  # nothing measured (no kernel, no cases, a contract broken): say why
        err = failed[0].detail
    else:
        err = "compared by contract"
    print(f"{status:7} {title}: {passed}/{len(results)} cases, {err}", flush=True)
