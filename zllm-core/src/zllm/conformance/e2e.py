"""End-to-end check: a model's logits and greedy tokens on the backend against the f32 reference.

Each model is loaded the way the engine loads it (checkpoint headers -> family -> spec ->
needed capabilities -> bound kernels -> weights) twice: on the backend with its kernels, and
on the CPU with every op bound to its f32 reference (config ``backend.force_reference`` for
all ops). Both run through a real paged KV cache (small blocks, so contexts cross block
edges; a sliding-window model frees blocks). The backend side prefills the prompt in two
chunks (a New Prefill, then an Append Prefill) where the reference prefills it at once.

Two pass criteria, by the weights the backend receives:

- ``exact`` (every dense weight f32): greedy tokens identical for :data:`NEW_TOKENS` tokens,
  each the argmax of the side's logits (the runtime sampler's greedy pick), and every logit within
  :data:`EXACT_TOLERANCE` (``|out - ref| <= atol + rtol * |ref|``) at every position.
- ``top1`` (16-bit or quantized weights, where rounding legitimately flips near-ties): the
  backend is teacher-forced with the reference's tokens, the argmax of its logits must agree
  with the reference's at >= :data:`TOP1_THRESHOLD` of the positions, and every logit must be
  within :data:`LOW_PRECISION_TOLERANCE`.

Models: two tiny random checkpoints written on the fly (a llama with GQA and a mistral with
a sliding window, so that ``attention_sliding`` runs end to end), the shipped stories260K
when the source tree has it, and any ``--model`` path.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import torch

from zllm.capabilities import missing_capabilities
from zllm.capabilities.backend import BackendInfo
from zllm.capabilities.ops import AttentionMetadata
from zllm.conformance.kernels import compare, device_unsupported, place_weight, where_raised
from zllm.conformance.report import E2EResult
from zllm.domain.family import model_kv_spec
from zllm.domain.ops import without_retired
from zllm.engine.loader import resolve_family
from zllm.kernels.bound import BoundOps
from zllm.plugins.host import PluginHost
from zllm.runtime.kv_cache import PagedKVCache, SeqKV
from zllm.spec.errors import TensorError, UnknownArchitectureError, ZllmError
from zllm.weights import load_weights, open_checkpoint
from zllm.weights.formats import DTYPE_OF_FORMAT

NEW_TOKENS = 16
PROMPT_TOKENS = 12
BLOCK_SIZE = 4
EXACT_TOLERANCE = (1e-2, 1e-2)  # (atol, rtol) on logits with f32 weights
LOW_PRECISION_TOLERANCE = (2e-1, 2e-1)  # (atol, rtol) on logits with 16-bit or quantized weights
TOP1_THRESHOLD = 0.9
STORIES_PROMPT = "Once upon a time"

#: Where the shipped stories260K checkpoint sits in a source checkout of zllm.
STORIES_RELATIVE = Path("assets") / "models" / "stories260k" / "hf"


@attrs.frozen
class ModelSource:
    """A model to check: its name and checkpoint path, or None when it was not found.

    ``shown`` is what the report gives as its path (a generated checkpoint's temporary
    directory is gone once the run ends); default: the path.
    """

    name: str
    path: Path | None
    missing_reason: str = ""
    shown: str = ""


def source_roots() -> list[Path]:
    """Where a zllm checkout may be: the current directory, and the source tree this module
    was installed from (an editable install; an installed wheel has no such tree)."""
    return [Path.cwd(), Path(__file__).resolve().parents[4]]


def find_stories260k(roots: list[Path]) -> Path | None:
    """The shipped stories260K HF checkpoint under the first of ``roots`` that has it, or None
    (e.g. zllm-core installed from PyPI, run outside a checkout)."""
    return next((r / STORIES_RELATIVE for r in roots if (r / STORIES_RELATIVE / "config.json").is_file()), None)


def default_models(root: Path, seed: int, roots: list[Path] | None = None) -> list[ModelSource]:
    """The tiny random checkpoints (written under ``root``) and stories260K, looked up under
    ``roots`` (default :func:`source_roots`), or an entry saying it was not found."""
    shown = f"(generated: random weights, seed {seed})"
    models = [ModelSource("tiny-llama", write_tiny_checkpoint(root / "tiny-llama", seed, sliding_window=None),
                          shown=shown),
              ModelSource("tiny-mistral-sliding", write_tiny_checkpoint(root / "tiny-mistral", seed, sliding_window=6),
                          shown=shown)]
    roots = source_roots() if roots is None else roots
    stories = find_stories260k(roots)
    if stories is None:
        where = " or ".join(str(r / STORIES_RELATIVE) for r in roots)
        models.append(ModelSource("stories260k", None, f"not found (looked for {where}); pass --model PATH"))
    else:
        models.append(ModelSource("stories260k", stories))
    return models


def write_tiny_checkpoint(dst: Path, seed: int, sliding_window: int | None) -> Path:
    """A random HF checkpoint (``config.json`` + ``model.safetensors``, f32, no tokenizer):
    2 layers, hidden 64, 4 query heads over 2 KV heads of dim 16, FFN 88, vocabulary 97.
    ``sliding_window`` makes it a mistral whose every layer attends to that many tokens.
    Weights are scaled so activations stay O(1) and logits spread over a few units (few
    near-ties for the greedy comparison)."""
    from safetensors.torch import save_file

    hidden, heads, kv_heads, head_dim, ffn, vocab, layers = 64, 4, 2, 16, 88, 97, 2
    config = {
        "architectures": ["MistralForCausalLM" if sliding_window else "LlamaForCausalLM"],
        "model_type": "mistral" if sliding_window else "llama",
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if sliding_window:
        config["sliding_window"] = sliding_window
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w = {"model.embed_tokens.weight": randn(vocab, hidden, scale=1.0),
         "model.norm.weight": 1.0 + randn(hidden, scale=0.1),
         "lm_head.weight": randn(vocab, hidden, scale=3.0 / math.sqrt(hidden))}
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
              "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + randn(hidden, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1.0 + randn(hidden, scale=0.1)
        for name, (n, k) in shapes.items():
            w[p + name + ".weight"] = randn(n, k, scale=1.0 / math.sqrt(k))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(w, str(dst / "model.safetensors"))
    return dst


# ---------------------------------------------------------------------------- running a model


@attrs.define
class _Side:
    """One model instance with its own KV cache and one sequence in it."""

    model: Any
    ops: BoundOps
    kv: PagedKVCache
    device: torch.device
    seq: SeqKV = attrs.Factory(SeqKV)

    def forward(self, ids: list[int], all_rows: bool) -> torch.Tensor:
        """Feed ``ids`` (the sequence's next tokens); f32 ``[len(ids) or 1, V]`` logits on the CPU."""
        start = self.seq.num_tokens
        slots = self.kv.append(self.seq, len(ids))
        dev = self.device
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64, device=dev),
                                 self.kv.block_table([self.seq], dev), (len(ids),), (self.seq.num_tokens,),
                                 self.kv.spec.attention_scale)
        rows = list(range(len(ids))) if all_rows else [len(ids) - 1]
        with torch.inference_mode():
            logits = self.model.forward(torch.tensor(ids, dtype=torch.int64, device=dev),
                                        torch.arange(start, start + len(ids), dtype=torch.int64, device=dev),
                                        meta, self.kv.layers, torch.tensor(rows, dtype=torch.int64, device=dev))
        return logits

    def greedy(self, logits: torch.Tensor) -> int:
        """The greedy token of f32 ``logits [V]``: ``argmax``, lowest index on ties, as the
        runtime's sampler picks it (:mod:`zllm.runtime.sampler`)."""
        return int(torch.argmax(logits))


def _side(family, spec, weights: dict, ops: BoundOps, device: torch.device, n_tokens: int) -> _Side:
    model = family.build(spec, weights, ops)
    # The cache follows the model's declaration, as the engine's: an all-sliding model frees old blocks (-1).
    kv = PagedKVCache(model_kv_spec(model), -(-n_tokens // BLOCK_SIZE) + 1, BLOCK_SIZE, device=device)
    return _Side(model, ops, kv, device)


def _prompt(ckpt, vocab: int, seed: int) -> list[int]:
    """The tokenized stories prompt when the checkpoint has a tokenizer, else seeded random ids."""
    try:
        tok = ckpt.load_tokenizer()
        ids = tok.encode(STORIES_PROMPT, add_special_tokens=True)
        if ids and all(0 <= i < vocab for i in ids):
            return ids
    except ZllmError:
        pass
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (PROMPT_TOKENS,), generator=g).tolist()


def check_model(host: PluginHost, info: BackendInfo, backend: Any, source: ModelSource, *, dtype: str = "auto",
                seed: int = 0, new_tokens: int = NEW_TOKENS) -> E2EResult:
    """Run one model on the backend and on the f32 reference and compare (module docstring).

    Args:
        dtype: load dtype for dense weights (``auto`` keeps the stored one; config ``model.dtype``).

    Returns:
        The result; a model that is not found, needs a family that is not installed, needs
        capabilities the backend does not declare (or its device cannot run) is ``skipped``
        with the reason. A checkpoint that fails to open or load is ``failed`` with the error,
        and so is one that makes the family's or the backend's code raise: this never raises.
    """
    try:
        return _check_model(host, info, backend, source, dtype, seed, new_tokens)
    except Exception as exc:  # plugin code (family, kernels) failing is that model's result, not a crash
        return E2EResult(source.name, source.shown or str(source.path), "failed",
                         detail=f"raised {type(exc).__name__}: {exc}{where_raised(exc)}")


def _check_model(host: PluginHost, info: BackendInfo, backend: Any, source: ModelSource, dtype: str, seed: int,
                 new_tokens: int) -> E2EResult:
    if source.path is None:
        return E2EResult(source.name, None, "skipped", detail=source.missing_reason)
    path = source.shown or str(source.path)
    try:
        ckpt = open_checkpoint(source.path, gguf_maps=host.gguf_maps)
    except ZllmError as exc:
        return E2EResult(source.name, path, "failed", detail=f"checkpoint rejected: {exc}")
    try:
        family_info = resolve_family(host, ckpt)
    except UnknownArchitectureError as exc:
        return E2EResult(source.name, path, "skipped", detail=f"no model family installed for it: {exc}")
    family = family_info.load()
    try:
        spec = family.parse_config(ckpt.config, str(source.path))
        specs = family.tensor_specs(spec)
        present = set(ckpt.tensor_names())
        missing = next((n for n, t in specs.items() if n not in present and not t.optional), None)
        if missing is not None:  # as the engine's loader checks, before asking the family for capabilities
            raise TensorError(str(source.path), missing, "missing from the checkpoint")
        formats = {n: _loaded_format(ckpt.tensor_shape_format(n)[1], dtype) for n in specs if n in present}
    except ZllmError as exc:
        return E2EResult(source.name, path, "failed", detail=f"checkpoint rejected: {exc}")
    needed = without_retired(family.required_capabilities(spec, formats))
    lacking = missing_capabilities(needed, info.capabilities)
    if lacking:
        return E2EResult(source.name, path, "skipped",
                         detail=f"backend {info.name!r} does not declare {', '.join(lacking)} "
                                f"(family {family_info.name!r})")
    unsupported = {c: why for c, why in device_unsupported(backend).items() if c in {str(n) for n in needed}}
    if unsupported:
        return E2EResult(source.name, path, "skipped", detail="the backend says this device cannot run "
                         + "; ".join(f"{c} ({why})" for c, why in sorted(unsupported.items())))
    exact = all(f == "f32" for f in formats.values())
    try:
        weights = load_weights(ckpt, specs, dtype)
        backend_ops = BoundOps(host.kernels, info.name, needed, ops=host.ops)
        reference_ops = BoundOps(host.kernels, info.name, needed, force_reference={c.op for c in needed}, ops=host.ops)
    except ZllmError as exc:
        return E2EResult(source.name, path, "failed", detail=f"load failed: {exc}")
    prompt = _prompt(ckpt, spec.vocab_size, seed)
    n_tokens = len(prompt) + new_tokens
    if n_tokens > spec.context_length:
        return E2EResult(source.name, path, "skipped",
                         detail=f"context window {spec.context_length} < {n_tokens} tokens")
    reference = _side(family, spec, weights, reference_ops, torch.device("cpu"), n_tokens)
    try:
        placed = {k: place_weight(backend, v) for k, v in weights.items()}
        mine = _side(family, spec, placed, backend_ops, backend.device, n_tokens)
        return _compare_runs(source.name, path, mine, reference, prompt, new_tokens, exact)
    except Exception as exc:  # a kernel failing inside the model is a failed check, not a crash of the kit
        return E2EResult(source.name, path, "failed", "exact" if exact else "top1",
                         detail=f"the backend raised {type(exc).__name__}: {exc}")


def _loaded_format(stored: str, dtype: str) -> str:
    return stored if dtype == "auto" or stored not in DTYPE_OF_FORMAT else dtype


def _compare_runs(name: str, path: str, mine: _Side, reference: _Side, prompt: list[int], new_tokens: int,
                  exact: bool) -> E2EResult:
    """Reference: one New Prefill, then greedy decode. Backend: the prompt in two chunks, then
    decode on its own tokens (``exact``) or on the reference's (``top1``, teacher-forced)."""
    ref_logits = [reference.forward(prompt, all_rows=True)]
    ref_tokens = [reference.greedy(ref_logits[-1][-1])]
    for _ in range(new_tokens - 1):
        ref_logits.append(reference.forward(ref_tokens[-1:], all_rows=False))
        ref_tokens.append(reference.greedy(ref_logits[-1][-1]))
    ref_rows = torch.cat(ref_logits)  # [P + new - 1, V]

    split = max(1, len(prompt) // 2)
    rows = [mine.forward(prompt[:split], all_rows=True), mine.forward(prompt[split:], all_rows=True)] \
        if split < len(prompt) else [mine.forward(prompt, all_rows=True)]
    tokens = [mine.greedy(rows[-1][-1])]
    for i in range(new_tokens - 1):
        fed = tokens[-1] if exact else ref_tokens[i]
        rows.append(mine.forward([fed], all_rows=False))
        tokens.append(mine.greedy(rows[-1][-1]))
    my_rows = torch.cat([r.cpu() for r in rows])  # [P + new - 1, V]

    if exact:
        # Logits after a token divergence have different inputs; compare up to it.
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), len(tokens))
        n_rows = min(len(prompt) + agree, my_rows.shape[0])  # row P - 1 + j gives token j
        atol, rtol = EXACT_TOLERANCE
        close, max_abs, max_rel, detail = compare([my_rows[:n_rows]], [ref_rows[:n_rows]], atol, rtol)
        same = tokens == ref_tokens
        if same and close:
            detail = (f"{len(prompt)} prompt tokens (prefilled in 2 chunks), {new_tokens} greedy tokens identical, "
                      f"logits within tolerance at all {n_rows} positions")
        elif not same:
            margin = _top2_margin(ref_rows[len(prompt) - 1 + agree])
            detail = (f"greedy token {agree} differs: {tokens[agree]} vs reference {ref_tokens[agree]} (reference "
                      f"top-2 logit margin {margin:.3g})" + (f"; {detail}" if detail else ""))
        return E2EResult(name, path, "passed" if same and close else "failed", "exact", max_abs, max_rel, atol, rtol,
                         tokens, ref_tokens, detail=detail)

    atol, rtol = LOW_PRECISION_TOLERANCE
    close, max_abs, max_rel, detail = compare([my_rows], [ref_rows], atol, rtol)
    agreement = float((my_rows.argmax(-1) == ref_rows.argmax(-1)).double().mean())
    ok = close and agreement >= TOP1_THRESHOLD
    if ok:
        detail = f"teacher-forced over {my_rows.shape[0]} positions; top-1 agreement {agreement:.3f}"
    elif agreement < TOP1_THRESHOLD:
        detail = f"top-1 agreement {agreement:.3f} < {TOP1_THRESHOLD}" + (f"; {detail}" if detail else "")
    return E2EResult(name, path, "passed" if ok else "failed", "top1", max_abs, max_rel, atol, rtol, tokens, ref_tokens,
                     agreement, TOP1_THRESHOLD, detail)


def _top2_margin(row: torch.Tensor) -> float:
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])
