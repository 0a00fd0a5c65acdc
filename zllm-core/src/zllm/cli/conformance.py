"""``zllm conformance``: check an installed backend's kernels and models against the f32 references.

stdout: one line per (kernel, op[variant]) and per model, then the verdict. stderr: one
``FAIL`` line per failing kernel case and model. Exit 0 when everything passed, 1 on any
failure, 2 on a usage error (unknown or unavailable backend, ``--ops`` matching nothing,
a rejected ``--device``).
"""

from __future__ import annotations

import argparse
import sys

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
    p.add_argument("--backend", required=True, help="backend name, as `zllm plugins` lists it")
    p.add_argument("--device", help="device passed to the backend's constructor (e.g. cuda:1)")
    p.add_argument("--threads", type=_positive_int, help="threads passed to the backend's constructor")
    p.add_argument("--ops", help="comma-separated op names to check (kernel checks only); default: every op")
    p.add_argument("--quick", action="store_true", help="fewer cases per op")
    p.add_argument("--seed", type=int, default=0, help="seed of every generated input (default 0)")
    p.add_argument("--dtype", choices=("auto", "f32", "f16", "bf16"), default="auto",
                   help="load dtype of dense model weights in the end-to-end check (default: as stored)")
    p.add_argument("--model", action="append", default=[], metavar="PATH",
                   help="also check this checkpoint end to end (HF directory or GGUF file); repeatable")
    p.add_argument("--report", metavar="FILE",
                   help="write FILE.json and FILE.md (FILE.json: FILE and FILE with .md)")
    p.set_defaults(func=cmd_conformance)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def cmd_conformance(args: argparse.Namespace) -> int:
    from zllm.conformance import run_conformance
    from zllm.conformance.report import CaseResult, report_paths

    if args.report is not None:
        for path in report_paths(args.report):
            if not path.parent.is_dir():
                raise ConfigError("--report", f"{path.parent}: no such directory")
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
    if args.report is not None:
        try:
            json_path, md_path = report.write(args.report)
        except OSError as exc:
            raise ConfigError("--report", f"cannot write the report: {exc}") from None
        print(f"report: {json_path} {md_path}")
    n_failed = len(report.failures())
    verdict = "PASSED" if report.passed else f"FAILED ({n_failed} failure{'s' if n_failed != 1 else ''})"
    print(f"conformance of backend {report.backend!r} on {report.device}: {verdict} — "
          f"{len(report.kernels)} kernel cases, {len(report.e2e)} models "
          f"({sum(r.status == 'skipped' for r in report.e2e)} skipped)")
    return 0 if report.passed else EXIT_FAILED


def _print_group(title: str, results: list) -> None:
    passed = sum(r.passed for r in results)
    errs = [r.max_abs_err for r in results if r.max_abs_err is not None]
    err = f"max abs err {max(errs):.3g}" if errs else "compared by contract"
    status = "FAIL" if any(r.failed for r in results) else "PASS" if passed else "SKIPPED"
    if status == "SKIPPED":
        err = results[0].detail
    print(f"{status:7} {title}: {passed}/{len(results)} cases, {err}", flush=True)
