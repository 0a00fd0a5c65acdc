"""f32 reference of rotary position embeddings (RoPE), GPT-NeoX / HF half-rotation layout,
and the RoPE scaling variants HF checkpoints use.

Dimension legend: ``T`` tokens, ``H`` heads, ``D`` head dim (even), ``D2 = D // 2``.

Formula (Su et al. 2021, "RoFormer"; HF ``LlamaRotaryEmbedding`` +
``apply_rotary_pos_emb``): the pairs are ``(x[i], x[i + D2])`` and rotate by angle
``pos * inv_freq[i]`` with ``inv_freq[i] = 1 / theta^(2i / D)``:

    out[i]      = x[i] * cos - x[i + D2] * sin
    out[i + D2] = x[i + D2] * cos + x[i] * sin

Scaling variants change ``inv_freq`` and may scale ``cos``/``sin`` by an attention factor
(HF ``LlamaRotaryEmbedding.forward``: ``cos = emb.cos() * attention_scaling``). Each
follows transformers 5.x ``modeling_rope_utils`` line by line, in the same f32 operations,
so that the logits agree to rounding:

- ``default``: ``compute_default_rope_parameters``.
- ``linear`` (kaiokendev; Chen et al. 2023, "Position Interpolation"):
  ``_compute_linear_scaling_rope_parameters`` — ``inv_freq / factor``.
- ``dynamic`` (dynamic NTK, /u/bloc97 and /u/emozilla): ``_compute_dynamic_ntk_parameters``
  — ``theta * (factor * L / max_pos - (factor - 1)) ** (D / (D - 2))`` with
  ``L = max(seq_len, max_pos)``. zllm caps the context at ``max_position_embeddings``, so
  every cached position has ``L == max_pos`` and the base is unchanged: the cached keys and
  new queries always share one set of frequencies, exactly as HF for such lengths.
- ``llama3`` (Meta, Llama 3.1): ``_compute_llama3_parameters`` — low frequencies divided by
  ``factor``, high ones kept, a smooth ramp between.
- ``yarn`` (Peng et al. 2023, "YaRN", arXiv:2309.00071): ``_compute_yarn_parameters`` —
  per-dimension blend of interpolated and extrapolated frequencies over the correction
  range from ``beta_fast``/``beta_slow``, and the attention factor
  ``0.1 * ln(factor) + 1`` (or ``mscale``/``mscale_all_dim``, or an explicit
  ``attention_factor``) applied to ``cos`` and ``sin``.
- GGUF files store llama3's per-frequency divisors as the tensor ``rope_freqs.weight``
  (``convert_hf_to_gguf.py`` ``LlamaModel.generate_extra_tensors``; llama.cpp divides
  ``theta_i`` by ``freq_factors[i]`` in ``ggml_rope_ext``): :attr:`RopeParams.freq_factors`.

Partial rotary (``partial_rotary_factor < 1``) and per-layer-type RoPE are rejected: the
llama-style layers rotate the whole head.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from zllm.capabilities.ops import OpDeclaration

#: RoPE types :func:`rope_inv_freq` implements (HF ``rope_type`` names).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@attrs.frozen
class RopeParams:
    """RoPE parameters of one model, read from an HF config by :func:`rope_params_from_config`.

    Attributes:
        rope_type: one of :data:`ROPE_TYPES`.
        theta: the base (``rope_theta``).
        max_position_embeddings: the model's context window in tokens.
        factor: context extension factor (linear, dynamic, llama3, yarn).
        original_max_position_embeddings: pre-training context (llama3, yarn).
        low_freq_factor, high_freq_factor: llama3's wavelength bounds.
        attention_factor, mscale, mscale_all_dim, beta_fast, beta_slow, truncate: YaRN.
        freq_factors: per-frequency divisors ``[D2]`` (GGUF ``rope_freqs.weight``), or None.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    max_position_embeddings: int = 2048
    factor: float = 1.0
    original_max_position_embeddings: int = 2048
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    freq_factors: tuple[float, ...] | None = None


def rope_params_from_config(cfg: dict[str, Any]) -> RopeParams:
    """RoPE parameters from an HF config dict in either style.

    transformers < 5 writes ``rope_theta`` plus ``rope_scaling`` (``type`` or ``rope_type``);
    transformers 5 writes ``rope_parameters`` holding ``rope_type`` and ``rope_theta``. As in
    ``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``, ``rope_scaling`` wins when
    both are present, and a top-level ``original_max_position_embeddings`` wins over the
    dict's (``standardize_rope_params``). ``rope_freq_factors`` (a list) is what the GGUF
    weights layer writes for ``rope_freqs.weight``.

    Raises:
        ValueError: unsupported type or feature (names it and the supported types), a key
            the type needs is missing, a factor, frequency bound or YaRN attention factor or
            beta is not a finite number > 0, or a YaRN mscale is not finite.
    """
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        raise ValueError(f"{key} {raw!r} is not an object")
    params = dict(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        nested = [k for k in params if isinstance(params[k], dict)]
        what = f"per-layer-type RoPE parameters {nested}" if nested else f"RoPE type {rope_type!r}"
        raise ValueError(f"{what} is not supported (supported rope_type: {', '.join(ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (supported: 1.0, the whole head rotates)")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    theta = _number("rope_theta", params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"rope_theta {theta} is not a finite number > 0")
    original = int(
        cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_pos
    )

    def positive(key: str) -> float:
        value = _number(key, params[key])
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"RoPE type {rope_type!r}: {key} {params[key]!r} is not a finite number > 0")
        return value

    def need(key: str) -> float:
        """A scaling value the type needs: a factor or a frequency bound, finite and > 0."""
        if params.get(key) is None:
            raise ValueError(f"RoPE type {rope_type!r} needs {key!r} in rope_parameters/rope_scaling")
        return positive(key)

    def opt(key: str) -> float | None:
        """An optional YaRN mscale: absent, or a finite number."""
        if params.get(key) is None:
            return None
        value = _number(key, params[key])
        if not math.isfinite(value):
            raise ValueError(f"RoPE type {rope_type!r}: {key} {params[key]!r} is not a finite number")
        return value

    def beta(key: str, default: float) -> float:
        """YaRN's ``beta_fast``/``beta_slow``; absent or 0 is the default, as HF's ``or`` reads it."""
        return positive(key) if params.get(key) else default

    factors = cfg.get("rope_freq_factors")
    common: dict[str, Any] = dict(rope_type=rope_type, theta=theta, max_position_embeddings=max_pos,
                                  original_max_position_embeddings=original,
                                  freq_factors=None if factors is None else tuple(float(f) for f in factors))
    if rope_type == "default":
        return RopeParams(**common)
    if rope_type in ("linear", "dynamic"):
        return RopeParams(**common, factor=need("factor"))
    if rope_type == "llama3":
        return RopeParams(**common, factor=need("factor"), low_freq_factor=need("low_freq_factor"),
                          high_freq_factor=need("high_freq_factor"))
    # yarn: a missing factor is the ratio of the two context lengths (HF, for DeepSeek-V3).
    factor = None if params.get("factor") is None else positive("factor")
    attention_factor = None if params.get("attention_factor") is None else positive("attention_factor")
    return RopeParams(
        **common, factor=max_pos / original if factor is None else factor,
        attention_factor=attention_factor, mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
        beta_fast=beta("beta_fast", 32.0), beta_slow=beta("beta_slow", 1.0),
        truncate=bool(params.get("truncate", True)),
    )


def _number(key: str, value: Any) -> float:
    """``value`` as a float; ValueError naming ``key`` when it is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"RoPE {key} {value!r} is not a number")
    return float(value)


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies f32 ``[D2]``: ``1 / theta^(arange(0, D, 2) / D)`` (HF ``compute_default_rope_parameters``).

    Raises:
        AssertionError: ``head_dim`` is not even and positive, or ``theta <= 0``.
    """
    assert head_dim > 0 and head_dim % 2 == 0, head_dim
    assert theta > 0, theta
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D2]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, p: RopeParams) -> tuple[torch.Tensor, float]:
    """HF ``_compute_yarn_parameters``, in its order of f32 operations."""
    base, factor = p.theta, p.factor
    if p.attention_factor is not None:
        attention_factor = p.attention_factor
    elif p.mscale and p.mscale_all_dim:
        attention_factor = float(_yarn_mscale(factor, p.mscale) / _yarn_mscale(factor, p.mscale_all_dim))
    else:
        attention_factor = _yarn_mscale(factor)

    # dimension that turns num_rotations times over the original context
    def correction_dim(num_rotations: float) -> float:
        return (
            (dim * math.log(p.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))
        )

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [D2]
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # [D2]
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def deepseek_softmax_scale(qk_head_dim: int, p: RopeParams) -> float:
    """The attention softmax scale of DeepSeek-V2/V3 MLA: ``qk_head_dim ** -0.5 · m²``.

    ``m = 0.1 · mscale_all_dim · ln(factor) + 1`` under YaRN with ``mscale_all_dim`` set
    (``factor > 1``), else 1 — DeepSeek's ``yarn_get_mscale`` applied to the softmax scale
    (DeepSeek-V2 reference code, ``DeepseekV2Attention.__init__``; transformers 5
    ``yarn_apply_mscale``). It multiplies every score, the rotated and the unrotated part
    alike; the cos/sin factor ``mscale / mscale_all_dim`` that :func:`rope_inv_freq` returns
    is separate. ``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``.
    """
    assert qk_head_dim > 0, qk_head_dim
    scale = qk_head_dim ** (-0.5)
    if p.rope_type == "yarn" and p.mscale_all_dim:
        mscale = _yarn_mscale(p.factor, p.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def _llama3_inv_freq(dim: int, p: RopeParams) -> torch.Tensor:
    """HF ``_compute_llama3_parameters``, in its order of f32 operations."""
    inv_freq = 1.0 / (p.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D2]
    old_ctx = p.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_ctx / p.low_freq_factor, old_ctx / p.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / p.factor, inv_freq)
    smooth = (old_ctx / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor)
    smoothed = (1 - smooth) * scaled / p.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, p: RopeParams) -> tuple[torch.Tensor, float]:
    """``(inv_freq f32 [D2], attention_factor)`` for RoPE parameters ``p`` (see the module docstring).

    ``attention_factor`` multiplies ``cos`` and ``sin`` (1.0 except for YaRN).
    """
    assert head_dim > 0 and head_dim % 2 == 0, head_dim
    dim, attention_factor = head_dim, 1.0
    if p.rope_type == "default":
        inv_freq = default_inv_freq(dim, p.theta)
    elif p.rope_type == "linear":
        inv_freq = default_inv_freq(dim, p.theta) / p.factor
    elif p.rope_type == "dynamic":
        seq_len = p.max_position_embeddings  # every position zllm runs is below it (see above)
        base = p.theta * ((p.factor * seq_len / p.max_position_embeddings) - (p.factor - 1)) ** (dim / (dim - 2))
        inv_freq = default_inv_freq(dim, base)
    elif p.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(dim, p)
    elif p.rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(dim, p)
    else:
        raise ValueError(f"RoPE type {p.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if p.freq_factors is not None:
        assert len(p.freq_factors) == dim // 2, (len(p.freq_factors), dim)
        inv_freq = inv_freq / torch.tensor(p.freq_factors, dtype=torch.float32)  # [D2]
    return inv_freq.float(), float(attention_factor)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` f32 ``[T, D2]`` for int64 ``positions [T]`` and f32 ``inv_freq [D2]``,
    both scaled by ``attention_factor`` (YaRN's mscale; HF multiplies after ``cos()``)."""
    assert positions.dim() == 1, positions.shape
    assert inv_freq.dim() == 1 and inv_freq.dtype == torch.float32, (inv_freq.shape, inv_freq.dtype)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D2]
    cos, sin = _row_invariant(torch.cos, freqs), _row_invariant(torch.sin, freqs)
    if attention_factor == 1.0:
        return cos, sin
    return cos * attention_factor, sin * attention_factor


_ROW_CALL_ELEMENTS = 32768  # at::internal::GRAIN_SIZE: a call this small runs on one thread
_ROW_MULTIPLE = 64  # padded row width: every element sits in a full SIMD vector, never a scalar tail


def _row_invariant(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` over ``x [T, N]``, each row bit-identical whatever ``T`` is.

    torch's CPU loops compute whole SIMD vectors and a scalar tail with a different libm
    (Sleef vs ``std::cos``), so ``cos`` of one position could change by an ulp with the
    number of tokens in the step. Rows are padded to a multiple of 64 and computed in calls
    of one fixed shape ``[R, N']`` of at most 32768 elements (one thread, no split), so
    every element always takes the same path (``runtime.batch_invariant``).
    """
    t, n = x.shape
    width = -(-n // _ROW_MULTIPLE) * _ROW_MULTIPLE
    rows = max(1, _ROW_CALL_ELEMENTS // width)
    buf = torch.zeros(rows, width, dtype=x.dtype, device=x.device)  # [R, N']
    out = torch.empty_like(x)  # [T, N]
    for start in range(0, t, rows):
        stop = min(t, start + rows)
        buf[: stop - start, :n] = x[start:stop]
        out[start:stop] = fn(buf)[: stop - start, :n]
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` f32 ``[T, H, D]`` by ``cos``/``sin`` f32 ``[T, D2]`` -> f32 ``[T, H, D]``."""
    assert x.dim() == 3 and x.dtype == torch.float32, (x.shape, x.dtype)
    t, _, d = x.shape
    assert d % 2 == 0, d
    assert tuple(cos.shape) == (t, d // 2) and cos.shape == sin.shape, (cos.shape, sin.shape, x.shape)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]  # [T, H, D2] each
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)  # [T, H, D]


def apply_rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the interleaved (GPT-J / Meta original / ggml ``NORM``) row layout: the pairs are
    ``(x[2i], x[2i + 1])`` rotated by ``cos[:, i]``/``sin[:, i]``.

    ``x`` f32 ``[T, H, D]``, ``cos``/``sin`` f32 ``[T, D2]`` -> f32 ``[T, H, D]``. Equal to
    :func:`apply_rope` on rows permuted as llama.cpp's ``convert_hf_to_gguf.py`` permutes Q/K
    (Mesh-TF / HF ``rotate_half`` vs Meta's complex multiply, Su et al. 2021).
    """
    assert x.dim() == 3 and x.dtype == torch.float32, (x.shape, x.dtype)
    t, h, d = x.shape
    assert d % 2 == 0, d
    assert tuple(cos.shape) == (t, d // 2) and cos.shape == sin.shape, (cos.shape, sin.shape, x.shape)
    pairs = x.reshape(t, h, d // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]  # [T, H, D2] each
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).reshape(t, h, d)  # [T, H, D]


OPS = (
    OpDeclaration(
        name="rope", variants=("neox", "gptj"), args=("x", "cos", "sin"),
        signature="(x f32 [T, H, D], cos f32 [T, D/2], sin f32 [T, D/2]) -> f32 [T, H, D]; "
                  "neox: half-rotation (GPT-NeoX / HF) pairs (i, i + D/2); gptj: interleaved pairs (2i, 2i + 1)",
        reference="zllm.domain.rope:apply_rope", variant_references={"gptj": "zllm.domain.rope:apply_rope_gptj"},
        cases="zllm.conformance.cases:rope_cases",
    ),
)


class RopeTable:
    """:func:`rope_cos_sin` over positions ``0..P-1``, kept and gathered per batch (vLLM's
    ``cos_sin_cache``).

    ``rope_cos_sin`` computes each row independently of the others, so a table row is
    bit-identical to computing that position alone. The table covers every position below
    the batch's longest context (known on the host, so no device sync) and grows to the next
    power of two when a longer context arrives, at most to ``max_positions``: memory follows
    the context actually used.

    Args:
        inv_freq: f32 ``[D2]`` (:func:`rope_inv_freq`).
        attention_factor: YaRN's mscale (:func:`rope_inv_freq`'s second result).
        max_positions: the model's context length.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float, max_positions: int):
        self.inv_freq, self.attention_factor, self.max_positions = inv_freq, attention_factor, max_positions
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def cached_positions(self) -> int:
        """How many positions the table holds now (0 before the first call)."""
        return 0 if self._table is None else self._table[0].shape[0]

    def rows(self, positions: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` f32 ``[T, D2]`` for int64 ``positions [T]``, every one below ``need``
        (the batch's longest context, ``max(meta.context_lens)``)."""
        table = self._table
        if table is None or table[0].shape[0] < need or table[0].device != positions.device:
            size = min(1 << (need - 1).bit_length(), max(need, self.max_positions))
            grid = torch.arange(size, dtype=torch.int64, device=positions.device)
            table = rope_cos_sin(grid, self.inv_freq.to(positions.device), self.attention_factor)  # [P, D2] each
            self._table = table
        return table[0][positions], table[1][positions]
