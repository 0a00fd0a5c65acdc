"""``zllm run``: stream a generation to stdout; stats on stderr."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import attrs

from zllm.spec.config import load_config
from zllm.spec.errors import ConfigError, RequestError


def _overrides(cfg, args: argparse.Namespace):
    gen = {}
    if args.prompt is not None:
        gen["prompt"] = args.prompt
    for name in ("max_new_tokens", "temperature", "top_p", "seed"):
        if getattr(args, name) is not None:
            gen[name] = getattr(args, name)
    if gen:
        from zllm.spec.config import config_from_dict, config_to_dict

        data = config_to_dict(cfg)
        data["generation"].update(gen)
        if args.backend is not None:
            data["backend"]["name"] = args.backend
        return config_from_dict(data)
    if args.backend is not None:
        cfg = attrs.evolve(cfg, backend=attrs.evolve(cfg.backend, name=args.backend))
    return cfg


def _progress():
    """tqdm byte progress for weight loading, only on a terminal."""
    if not sys.stderr.isatty():
        return None, None
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar: dict = {}

    def on_start(total: int) -> None:
        bar["bar"] = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", leave=False)

    def on_tensor(name: str, nbytes: int) -> None:
        bar["bar"].update(nbytes)

    return on_start, on_tensor


def cmd_run(args: argparse.Namespace) -> int:
    if args.system is not None and not args.chat:
        raise ConfigError("--system", "applies only with --chat")
    # Check the config before importing the engine (torch): config mistakes fail fast.
    cfg = _overrides(load_config(args.config), args)
    from zllm.cli.ranks import start_engine

    on_start, on_tensor = _progress()
    engine = start_engine(cfg, on_start=on_start, on_tensor=on_tensor)
    if engine is None:  # a torchrun rank other than 0: it ran its shard until rank 0 stopped
        return 0
    if args.explain:
        _explain(engine)
    if args.chat:
        return _chat(engine, args.system)
    _generate(engine, {"prompt": cfg.generation.prompt})
    return 0


def _generate(engine, request: dict) -> str:
    """Stream one request's text to stdout and end the line; print its stats on stderr;
    return the text."""
    t0 = time.perf_counter()
    first: float | None = None
    final: dict[str, Any] = {}
    pieces = []
    for event in engine.generate_stream(request):
        if "finish_reason" in event:
            final = event
            break
        if first is None:
            first = time.perf_counter()
        pieces.append(event["text"])
        sys.stdout.write(event["text"])
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    end = time.perf_counter()
    usage = final["usage"]
    n = usage["completion_tokens"]
    ttft_ms = ((first or end) - t0) * 1000
    decode_s = end - (first or end)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
    spec = engine.config.speculative
    accepted = engine.loop.call(lambda llm: llm.spec_stats.acceptance_rate) if spec.method else None
    speculation = "" if not spec.method else (
        f", speculation: {spec.method} K={spec.num_tokens} "
        + ("no proposal" if accepted is None else f"{accepted:.0%} of proposals accepted"))
    print(
        f"prompt tokens: {usage['prompt_tokens']}, cached tokens: {usage['cached_tokens']}, generated tokens: {n}, "
        f"TTFT: {ttft_ms:.1f} ms, decode: {rate:.1f} tokens/s, finish: {final['finish_reason']}{speculation}",
        file=sys.stderr,
    )
    return "".join(pieces)


CHAT_PROMPT_MARKER = "> "


def _chat(engine, system: str | None) -> int:
    """``zllm run --chat``: each stdin line is a user turn; each reply goes to stdout.

    The whole conversation is sent every turn, so each turn's prompt starts with the previous
    turn's prompt and reply, and the engine's prefix cache turns it into an Append Prefill
    (``cached tokens`` on stderr). On a terminal a prompt marker is shown on stderr. Blank
    lines are skipped; end of input ends the chat.

    Raises:
        RequestError: the model has no chat template (before reading any input), or its
            template rejects the conversation (e.g. a system message).
    """
    if engine.tokenizer.chat_template is None:
        raise RequestError(
            "messages", f"model has no chat template ({engine.loaded.checkpoint.path}); --chat needs one"
        )
    messages = [{"role": "system", "content": system}] if system is not None else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write(CHAT_PROMPT_MARKER)
            sys.stderr.flush()
        try:
            line = sys.stdin.readline()
        except UnicodeDecodeError as exc:  # a strict stdin encoding (PYTHONIOENCODING=utf-8)
            raise RequestError("stdin", f"input is not {exc.encoding} text: {exc.reason}") from None
        if not line:
            if interactive:
                sys.stderr.write("\n")
            return 0
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        reply = _generate(engine, {"messages": messages})
        messages.append({"role": "assistant", "content": reply})


def _explain(engine) -> None:
    loaded = engine.loaded
    out = sys.stderr
    print(f"family: {loaded.family_info.name} (architecture {loaded.checkpoint.architecture})", file=out)
    print(f"backend: {loaded.backend_choice.info.name} — {loaded.backend_choice.reason}", file=out)
    for line in loaded.ops.explain():
        print(f"  {line.capability:<18} -> {line.kernel}  ({line.reason})", file=out)
    if loaded.checkpoint.quantization is not None:
        print(f"quantization: {loaded.checkpoint.quantization} (kept quantized)", file=out)
    for note in loaded.checkpoint.quantization_notes:
        print(f"quantization note: {note}", file=out)
    for name, why in loaded.checkpoint.skipped_tensors.items():
        print(f"skipped tensor: {name} ({why})", file=out)
    # A family may change a weight at load (DeepSeek dequantizes a kv_b_proj whose scale
    # blocks straddle its heads); it lists those in its model's optional ``load_notes``.
    for name, why in getattr(loaded.model, "load_notes", {}).items():
        print(f"changed at load: {name} ({why})", file=out)
    spec = engine.config.speculative
    if spec.method:
        adapt = "adapted per sequence to its acceptance" if spec.adaptive else "fixed"
        print(f"speculative decoding: {spec.method}, up to {spec.num_tokens} proposed tokens per step ({adapt})",
              file=out)
        if spec.method == "draft" and spec.draft.model is not None:
            print(f"  draft model: {spec.draft.model.path}", file=out)
