"""f32 reference of Multi-head Latent Attention (MLA), in its expanded and absorbed forms,
over a paged latent cache.

Dimension legend: ``T`` tokens in the flattened batch, ``K`` hidden size, ``H`` heads,
``Dn`` ``qk_nope_head_dim``, ``Dr`` ``qk_rope_head_dim``, ``Dv`` ``v_head_dim``, ``R``
``kv_lora_rank``, ``Rq`` ``q_lora_rank``, ``W = R + Dr`` the width of one cached latent row,
``Q`` query tokens of one sequence, ``L`` its context length, ``NB`` cache blocks, ``BS``
block size, ``MB`` max blocks per sequence.

Sources: DeepSeek-V2 (arXiv:2405.04434 §2.1, eqs. 9-19) and DeepSeek-V3 (arXiv:2412.19437
§2.1.1); transformers 5 ``DeepseekV2Attention`` / ``DeepseekV3Attention``; the absorbed
decode of vLLM's ``MLACommonImpl`` and DeepSeek's ``model.py`` (``attn_impl="absorb"``).

Per token ``x``:

- query: ``q = q_proj(x)``, or with ``q_lora_rank`` ``q_b_proj(RMSNorm(q_a_proj(x)))``;
  per head ``q = [q_nope (Dn) | q_pe (Dr)]``.
- ``kv_a_proj_with_mqa(x) = [c_kv (R) | k_pe (Dr)]``; the latent is ``RMSNorm(c_kv)``
  (``kv_a_layernorm``) and ``k_pe`` is one rope key shared by every head.
- RoPE rotates ``q_pe`` and ``k_pe`` only: adjacent pairs ``(x[2i], x[2i+1])`` for
  ``deepseek_v2`` always and for ``deepseek_v3`` when ``rope_interleave`` (its default),
  the half-split pairs otherwise. The cache holds ``[RMSNorm(c_kv) | rotated k_pe]``, ``W``
  values per token and layer, no V.
- ``kv_b_proj`` ``[H * (Dn + Dv), R]`` maps the latent to per-head ``k_nope`` and ``v``:
  row block ``h`` is ``[W_UK[h] (Dn rows) | W_UV[h] (Dv rows)]``.
- score ``= (q_nope · k_nope + q_pe · k_pe) · softmax_scale``, causal; output per head
  ``sum_j p_j v_j``, concatenated and ``o_proj``'d.

The *expanded* form rebuilds ``k = [k_nope | k_pe]`` and ``v`` for every cached token and
runs ordinary attention (cheap per query for prefill). The *absorbed* form never rebuilds
them: ``q_nope · k_nope_j = (W_UK[h]^T q_nope) · c_kv_j``, so each query is moved into
latent space once, scored against the cached rows, and the weighted latent sum goes out
through ``W_UV[h]`` (cheap per cached token for decode). Both are exact rewrites of one
another and agree to f32 rounding.

transformers' DeepSeek-V3 with ``rope_interleave`` rotates adjacent pairs but writes the
result de-interleaved (all first elements, then all second ones); that is one fixed
permutation of the ``Dr`` dims applied to ``q_pe`` and ``k_pe`` alike, so scores are equal.
This reference keeps each rotated pair in place (DeepSeek's own code, llama.cpp's
``deepseek2``), so its cached ``k_pe`` is the interleave of transformers' V3 cache entry.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch

from zllm.capabilities.ops import AttentionMetadata, OpDeclaration
from zllm.domain.attention import causal_softmax_attention, gather_context
from zllm.domain.linear import linear, weight_to_f32
from zllm.domain.norm import rms_norm
from zllm.domain.rope import (
    RopeParams,
    apply_rope,
    apply_rope_gptj,
    deepseek_softmax_scale,
    rope_params_from_config,
)
from zllm.weights.formats import QuantizedTensor

Weight = torch.Tensor | QuantizedTensor
#: HF ``model_type`` values :func:`mla_config_from_hf` reads.
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
#: The two forms of :func:`mla_paged_attention`.
MLA_FORMS = ("expanded", "absorbed")


def _default_scale(self: MlaConfig) -> float:
    return float((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)


@attrs.frozen
class MlaConfig:
    """Shapes and settings of one MLA layer (HF DeepSeek config names).

    Attributes:
        hidden_size: ``K``.
        num_heads: ``H`` (``num_attention_heads``).
        q_lora_rank: ``Rq``, or None for a plain ``q_proj``.
        kv_lora_rank: ``R``.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: ``Dn``, ``Dr`` (even), ``Dv``.
        rope_interleave: rotate adjacent pairs (True) or half-split pairs (False).
        softmax_scale: multiplies every score; default ``(Dn + Dr) ** -0.5``, under YaRN
            :func:`~zllm.domain.rope.deepseek_softmax_scale`.
        latent_norm_eps: epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``; DeepSeek and
            transformers build them with the RMSNorm default 1e-6, not ``rms_norm_eps``.
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    softmax_scale: float = attrs.field(default=attrs.Factory(_default_scale, takes_self=True))
    latent_norm_eps: float = 1e-6

    def __attrs_post_init__(self) -> None:
        for key in (
            "hidden_size",
            "num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} {value!r} is not an integer >= 1")
        if self.q_lora_rank is not None and (
            isinstance(self.q_lora_rank, bool)
            or not isinstance(self.q_lora_rank, int)
            or self.q_lora_rank < 1
        ):
            raise ValueError(f"q_lora_rank {self.q_lora_rank!r} is not null or an integer >= 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim {self.qk_rope_head_dim} is not even (RoPE rotates pairs)"
            )

    @property
    def qk_head_dim(self) -> int:
        """``Dn + Dr``, the width of one head's query and key."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """``W = R + Dr``, the values one token caches per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_config_from_hf(cfg: dict[str, Any]) -> tuple[MlaConfig, RopeParams]:
    """The MLA settings and RoPE parameters of an HF DeepSeek-V2/V3 config dict.

    The rope part is ``qk_rope_head_dim`` wide: pass that as the head dim to
    :func:`~zllm.domain.rope.rope_inv_freq`. ``deepseek_v2`` always rotates adjacent pairs;
    ``deepseek_v3`` reads ``rope_interleave`` (default True, as transformers).

    Raises:
        ValueError: an unsupported ``model_type``, a missing key (``kv_lora_rank`` ...) or a
            bad value, naming the key; RoPE errors from
            :func:`~zllm.domain.rope.rope_params_from_config`.
    """
    model_type = cfg.get("model_type")
    if model_type not in MLA_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} has no MLA attention "
            f"(supported: {', '.join(MLA_MODEL_TYPES)})"
        )

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{model_type} config needs {key!r}")
        return cfg[key]

    interleave = True if model_type == "deepseek_v2" else cfg.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise ValueError(f"rope_interleave {interleave!r} is not true or false")
    rope = rope_params_from_config(cfg)
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.rope_type not in ("default", "yarn") and raw.get("mscale_all_dim"):
        raise ValueError(
            f"mscale_all_dim with RoPE type {rope.rope_type!r} is not supported (supported: yarn)"
        )
    qk_head_dim = int(need("qk_nope_head_dim")) + int(need("qk_rope_head_dim"))
    mla = MlaConfig(
        hidden_size=need("hidden_size"),
        num_heads=need("num_attention_heads"),
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"),
        rope_interleave=interleave,
        softmax_scale=deepseek_softmax_scale(qk_head_dim, rope),
    )
    return mla, rope


@attrs.frozen(eq=False)
class MlaWeights:
    """The weights of one MLA layer (HF ``self_attn.*`` names; dense or quantized ``[N, K]``).

    Attributes:
        kv_a_proj_with_mqa: ``[R + Dr, K]`` (GGUF ``attn_kv_a_mqa``).
        kv_a_layernorm: ``[R]`` (GGUF ``attn_kv_a_norm``).
        kv_b_proj: ``[H * (Dn + Dv), R]`` (GGUF ``attn_kv_b``, or ``attn_k_b`` + ``attn_v_b``
            re-joined per head).
        o_proj: ``[K, H * Dv]``.
        q_proj: ``[H * (Dn + Dr), K]`` when ``q_lora_rank`` is null, else None.
        q_a_proj: ``[Rq, K]``, q_a_layernorm: ``[Rq]``, q_b_proj: ``[H * (Dn + Dr), Rq]``
            when ``q_lora_rank`` is set, else None.
        q_a_proj_bias, kv_a_proj_with_mqa_bias, o_proj_bias: ``[Rq]``, ``[R + Dr]``, ``[K]``
            when the config sets ``attention_bias``, else None.
    """

    kv_a_proj_with_mqa: Weight
    kv_a_layernorm: torch.Tensor
    kv_b_proj: Weight
    o_proj: Weight
    q_proj: Weight | None = None
    q_a_proj: Weight | None = None
    q_a_layernorm: torch.Tensor | None = None
    q_b_proj: Weight | None = None
    q_a_proj_bias: torch.Tensor | None = None
    kv_a_proj_with_mqa_bias: torch.Tensor | None = None
    o_proj_bias: torch.Tensor | None = None


@attrs.frozen(eq=False)
class MlaProjections:
    """What one step's tokens contribute to MLA.

    Attributes:
        q_nope: f32 ``[T, H, Dn]``.
        q_pe: f32 ``[T, H, Dr]``, rotated.
        latent: f32 ``[T, R + Dr]``, the rows to cache: ``[RMSNorm(c_kv) | rotated k_pe]``.
    """

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    latent: torch.Tensor


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    return apply_rope_gptj(x, cos, sin) if interleave else apply_rope(x, cos, sin)


def mla_project(
    x: torch.Tensor, w: MlaWeights, cfg: MlaConfig, cos: torch.Tensor, sin: torch.Tensor
) -> MlaProjections:
    """Queries and latent rows of ``x`` f32 ``[T, K]`` (DeepSeek-V2 §2.1.2-2.1.3).

    ``cos``/``sin`` f32 ``[T, Dr / 2]`` at each token's position, from
    :func:`~zllm.domain.rope.rope_cos_sin` over ``rope_inv_freq(Dr, params)`` (YaRN's
    cos/sin factor included).
    """
    assert x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == cfg.hidden_size, (
        x.shape,
        x.dtype,
    )
    t, h = x.shape[0], cfg.num_heads
    if cfg.q_lora_rank is None:
        assert w.q_proj is not None and w.q_a_proj is None, (
            "q_lora_rank is null: q_proj, not q_a_proj"
        )
        q = linear(x, w.q_proj, None)  # [T, H * (Dn + Dr)]
    else:
        assert (
            w.q_a_proj is not None
            and w.q_a_layernorm is not None
            and w.q_b_proj is not None
            and w.q_proj is None
        )
        q_a = rms_norm(
            linear(x, w.q_a_proj, w.q_a_proj_bias), w.q_a_layernorm, cfg.latent_norm_eps
        )  # [T, Rq]
        q = linear(q_a, w.q_b_proj, None)  # [T, H * (Dn + Dr)]
    q = q.view(t, h, cfg.qk_head_dim)
    q_nope, q_pe = (
        q[..., : cfg.qk_nope_head_dim],
        q[..., cfg.qk_nope_head_dim :],
    )  # [T, H, Dn], [T, H, Dr]
    kv_a = linear(x, w.kv_a_proj_with_mqa, w.kv_a_proj_with_mqa_bias)  # [T, R + Dr]
    c_kv = rms_norm(
        kv_a[:, : cfg.kv_lora_rank].contiguous(), w.kv_a_layernorm, cfg.latent_norm_eps
    )  # [T, R]
    k_pe = kv_a[:, None, cfg.kv_lora_rank :]  # [T, 1, Dr]: one rope key for all heads
    q_pe = _rotate(q_pe.contiguous(), cos, sin, cfg.rope_interleave)
    k_pe = _rotate(k_pe.contiguous(), cos, sin, cfg.rope_interleave)[:, 0]  # [T, Dr]
    return MlaProjections(
        q_nope.contiguous(), q_pe, torch.cat([c_kv, k_pe], dim=-1)
    )  # latent [T, R + Dr]


def _split_kv_b(
    kv_b_proj: Weight, n_heads: int, nope_dim: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK f32 [H, Dn, R], W_UV f32 [H, Dv, R])`` from ``kv_b_proj [H * (Dn + Dv), R]``."""
    kv_b = weight_to_f32(kv_b_proj)
    rows, cols = kv_b.shape
    assert cols == rank and rows % n_heads == 0 and rows // n_heads > nope_dim, (
        kv_b.shape,
        n_heads,
        nope_dim,
        rank,
    )
    kv_b = kv_b.view(n_heads, rows // n_heads, rank)  # [H, Dn + Dv, R]
    return kv_b[:, :nope_dim], kv_b[:, nope_dim:]


def _check_forms(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor) -> None:
    assert q_nope.dim() == 3 and q_pe.dim() == 3 and latent.dim() == 2, (
        q_nope.shape,
        q_pe.shape,
        latent.shape,
    )
    assert q_nope.dtype == q_pe.dtype == latent.dtype == torch.float32, (
        q_nope.dtype,
        q_pe.dtype,
        latent.dtype,
    )
    assert q_nope.shape[:2] == q_pe.shape[:2] and latent.shape[1] > q_pe.shape[2], (
        q_nope.shape,
        q_pe.shape,
        latent.shape,
    )
    assert 0 < q_nope.shape[0] <= latent.shape[0], (q_nope.shape, latent.shape)


def mla_expanded_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_b_proj: Weight, scale: float
) -> torch.Tensor:
    """MLA by rebuilding per-head K and V from the latent rows, then causal attention (prefill).

    Args:
        q_nope: f32 ``[Q, H, Dn]``; q_pe: f32 ``[Q, H, Dr]`` (rotated).
        latent: f32 ``[L, R + Dr]``, the sequence's cached rows; the queries are its last ``Q``.
        kv_b_proj: ``[H * (Dn + Dv), R]``.
        scale: the softmax scale (:attr:`MlaConfig.softmax_scale`).

    Returns:
        f32 ``[Q, H, Dv]``.
    """
    _check_forms(q_nope, q_pe, latent)
    n_ctx, (_, h, nope_dim), rope_dim = latent.shape[0], q_nope.shape, q_pe.shape[2]
    rank = latent.shape[1] - rope_dim
    c_kv, k_pe = latent[:, :rank], latent[:, rank:]  # [L, R], [L, Dr]
    kv = linear(c_kv.contiguous(), kv_b_proj, None).view(n_ctx, h, -1)  # [L, H, Dn + Dv]
    k = torch.cat(
        [kv[..., :nope_dim], k_pe[:, None, :].expand(n_ctx, h, rope_dim)], dim=-1
    )  # [L, H, Dn + Dr]
    v = kv[..., nope_dim:]  # [L, H, Dv]
    return causal_softmax_attention(torch.cat([q_nope, q_pe], dim=-1), k, v, scale)  # [Q, H, Dv]


def mla_absorbed_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_b_proj: Weight, scale: float
) -> torch.Tensor:
    """MLA with ``W_UK`` absorbed into the query and ``W_UV`` after the latent sum (decode).

    Same arguments and result as :func:`mla_expanded_attention`:
    ``score_j = ((W_UK^T q_nope) · c_kv_j + q_pe · k_pe_j) · scale``,
    ``out = W_UV · sum_j p_j c_kv_j`` per head.
    """
    _check_forms(q_nope, q_pe, latent)
    n_q, n_ctx, rope_dim = q_nope.shape[0], latent.shape[0], q_pe.shape[2]
    rank = latent.shape[1] - rope_dim
    w_uk, w_uv = _split_kv_b(
        kv_b_proj, q_nope.shape[1], q_nope.shape[2], rank
    )  # [H, Dn, R], [H, Dv, R]
    c_kv, k_pe = latent[:, :rank], latent[:, rank:]  # [L, R], [L, Dr]
    q_latent = torch.einsum("qhn,hnr->qhr", q_nope, w_uk)  # [Q, H, R]
    scores = (
        torch.einsum("qhr,lr->hql", q_latent, c_kv) + torch.einsum("qhd,ld->hql", q_pe, k_pe)
    ) * scale  # [H, Q, L]
    q_pos = torch.arange(n_ctx - n_q, n_ctx, device=latent.device)
    allowed = (
        torch.arange(n_ctx, device=latent.device)[None, :] <= q_pos[:, None]
    )  # [Q, L], bottom-right causal
    scores = scores.masked_fill(~allowed, float("-inf"))
    scores = scores - scores.amax(
        dim=-1, keepdim=True
    )  # each query sees its own key, so the max is finite
    weights = scores.exp()
    weights = weights / weights.sum(dim=-1, keepdim=True)  # [H, Q, L]
    out_latent = torch.einsum("hql,lr->qhr", weights, c_kv)  # [Q, H, R]
    return torch.einsum("qhr,hvr->qhv", out_latent, w_uv)  # [Q, H, Dv]


def write_latent(
    latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store rows ``latent`` f32 ``[T, W]`` into ``latent_cache [NB, BS, W]`` (in place) at
    ``slot_mapping`` int64 ``[T]``."""
    nb, bs, width = latent_cache.shape
    assert latent.dim() == 2 and latent.shape[1] == width, (latent.shape, latent_cache.shape)
    assert slot_mapping.shape == (latent.shape[0],), (slot_mapping.shape, latent.shape)
    assert latent.shape[0] == 0 or (
        0 <= int(slot_mapping.min()) and int(slot_mapping.max()) < nb * bs
    ), "slot out of range"
    latent_cache.view(nb * bs, width)[slot_mapping] = latent.to(latent_cache.dtype)


def mla_paged_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_proj: Weight,
    meta: AttentionMetadata,
    form: Literal["expanded", "absorbed"] = "absorbed",
) -> torch.Tensor:
    """Causal MLA for a flattened batch over a paged latent cache; see :class:`AttentionMetadata`.

    Writes ``latent`` at ``meta.slot_mapping`` first, then per sequence reads its
    ``context_lens[s]`` rows through its block table (as the GQA reference
    :func:`~zllm.domain.attention.attention` does, with one ``W``-wide row per token instead
    of K and V per head) and runs ``form``. ``meta.scale`` is the softmax scale.

    Args:
        q_nope: f32 ``[T, H, Dn]``; q_pe: f32 ``[T, H, Dr]`` (rotated).
        latent: f32 ``[T, R + Dr]``, the new tokens' rows (:attr:`MlaProjections.latent`).
        latent_cache: ``[NB, BS, R + Dr]`` (any float dtype).
        kv_b_proj: ``[H * (Dn + Dv), R]``.
        meta: slot mapping, block tables, query and context lengths, scale.
        form: ``"expanded"`` or ``"absorbed"`` (:data:`MLA_FORMS`); equal to f32 rounding.

    Returns:
        f32 ``[T, H, Dv]``.
    """
    assert form in MLA_FORMS, form
    t = q_nope.shape[0]
    assert latent.shape[0] == t and latent_cache.dim() == 3, (
        latent.shape,
        latent_cache.shape,
        q_nope.shape,
    )
    n_seq = len(meta.query_lens)
    assert len(meta.context_lens) == n_seq and meta.block_tables.shape[0] == n_seq, meta
    assert sum(meta.query_lens) == t, (meta.query_lens, t)
    assert all(0 < ql <= cl for ql, cl in zip(meta.query_lens, meta.context_lens, strict=True)), (
        meta
    )

    write_latent(latent, latent_cache, meta.slot_mapping)
    attend = mla_absorbed_attention if form == "absorbed" else mla_expanded_attention
    outs = []
    start = 0
    for s in range(n_seq):
        n_q, n_ctx = meta.query_lens[s], meta.context_lens[s]
        rows = gather_context(latent_cache.unsqueeze(2), meta.block_tables[s], n_ctx)[
            :, 0
        ]  # [L, W]
        outs.append(
            attend(
                q_nope[start : start + n_q], q_pe[start : start + n_q], rows, kv_b_proj, meta.scale
            )
        )
        start += n_q
    return torch.cat(outs)  # [T, H, Dv]


def mla_attention(
    x: torch.Tensor,
    w: MlaWeights,
    cfg: MlaConfig,
    cos: torch.Tensor,
    sin: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    form: Literal["expanded", "absorbed"] = "absorbed",
) -> torch.Tensor:
    """One MLA layer: :func:`mla_project`, :func:`mla_paged_attention`, ``o_proj``.

    ``x`` f32 ``[T, K]``; ``cos``/``sin`` f32 ``[T, Dr / 2]``; ``latent_cache``
    ``[NB, BS, R + Dr]`` (written in place); ``meta.scale`` must be ``cfg.softmax_scale``.
    Returns f32 ``[T, K]``.
    """
    assert meta.scale == cfg.softmax_scale, (meta.scale, cfg.softmax_scale)
    p = mla_project(x, w, cfg, cos, sin)
    out = mla_paged_attention(
        p.q_nope, p.q_pe, p.latent, latent_cache, w.kv_b_proj, meta, form
    )  # [T, H, Dv]
    return linear(
        out.reshape(x.shape[0], cfg.num_heads * cfg.v_head_dim), w.o_proj, w.o_proj_bias
    )  # [T, K]


OPS = (
    OpDeclaration(
        name="mla_attention",
        variants=("paged",),
        args=("q_nope", "q_pe", "latent", "latent_cache", "kv_b_proj", "meta"),
        signature="(q_nope f32 [T, H, Dn], q_pe f32 [T, H, Dr] rotated, latent f32 [T, R + Dr], "
        "latent_cache [NB, BS, R + Dr], kv_b_proj [H * (Dn + Dv), R] dense or quantized, "
        "meta AttentionMetadata) -> f32 [T, H, Dv]; writes latent at meta.slot_mapping first; "
        "causal, bottom-right aligned; score (q_nope . k_nope + q_pe . k_pe) * meta.scale with "
        "k_nope, v from kv_b_proj of the cached latent (expanded or absorbed: equal to f32 "
        "rounding)",
        reference="zllm.domain.mla:mla_paged_attention",
        cases="zllm.conformance.cases:mla_attention_cases",
    ),
)
