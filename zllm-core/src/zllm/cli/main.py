"""The ``zllm`` command line. User errors print one line on stderr and exit 2; an engine that
failed while running (its loop ended: a non-finite router input from NaN weights, a dead rank)
prints one line and exits 3; ``--debug`` shows the traceback too."""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence

from zllm.cli.conformance import add_parser as _add_conformance
from zllm.spec.errors import EngineFailedError, ZllmError

EXIT_USER_ERROR = 2
EXIT_ENGINE_FAILED = 3


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one ``error:`` line and exit 2 like every user error."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"error: {self.prog}: {message} (see '{self.prog} --help')\n")


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="generate text from the configured model, streaming to stdout")
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--backend", help="override backend.name")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--prompt", help="prompt text (default: generation.prompt)")
    mode.add_argument("--chat", action="store_true",
                      help="chat through the model's chat template: each stdin line is a user turn, "
                           "each reply is printed; the conversation is kept")
    p.add_argument("--system", metavar="TEXT", help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, help="override generation.max_new_tokens")
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--explain", action="store_true", help="print the kernel chosen for each op and why")
    p.set_defaults(func=_cmd("zllm.cli.run:cmd_run"))


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve OpenAI- and Anthropic-compatible HTTP APIs")
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--host", help="interface to bind (default: server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default: server.port, 8000)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.set_defaults(func=_cmd("zllm.cli.serve:cmd_serve"))


def _add_plugins(sub) -> None:
    p = sub.add_parser("plugins", help="list installed plugins with their status")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd("zllm.cli.info:cmd_plugins"))


def _add_config(sub) -> None:
    p = sub.add_parser("config", help="validate or migrate a config file")
    csub = p.add_subparsers(dest="config_cmd", required=True, metavar="{validate,migrate}")
    v = csub.add_parser("validate", help="check a config file; errors name the key path")
    v.add_argument("file")
    v.set_defaults(func=_cmd("zllm.cli.info:cmd_config_validate"))
    m = csub.add_parser("migrate", help="rewrite a config to the current schema, keeping comments")
    m.add_argument("file")
    m.add_argument("-o", "--output", help="write here instead of stdout")
    m.add_argument("--in-place", action="store_true", help="overwrite FILE")
    m.set_defaults(func=_cmd("zllm.cli.info:cmd_config_migrate"))


def _add_card(sub) -> None:
    p = sub.add_parser("card", help="print a checkpoint's ModelCard as YAML")
    p.add_argument("path", help="HF checkpoint directory or GGUF file")
    p.set_defaults(func=_cmd("zllm.cli.info:cmd_card"))


def _add_compat(sub) -> None:
    p = sub.add_parser("compat", help="print the families x backends x formats compatibility matrix")
    p.add_argument("--format", choices=("text", "md", "json"), default="text")
    p.add_argument(
        "--verified",
        metavar="PATH",
        help="TOML file naming the tests behind verified cells (default: the nearest "
        "compat/verified.toml in the current directory or a parent)",
    )
    p.set_defaults(func=_cmd("zllm.cli.info:cmd_compat"))


def _cmd(ref: str) -> Callable[[argparse.Namespace], int]:
    """Import subcommands lazily so ``zllm --help`` stays fast."""
    def run(args: argparse.Namespace) -> int:
        import importlib

        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zllm", description="LLM inference through plugins")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_serve, _add_plugins, _add_config, _add_card, _add_compat, _add_conformance):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.formatwarning = _format_warning
    try:
        return args.func(args)
    except (ZllmError, EngineFailedError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR if isinstance(exc, ZllmError) else EXIT_ENGINE_FAILED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
