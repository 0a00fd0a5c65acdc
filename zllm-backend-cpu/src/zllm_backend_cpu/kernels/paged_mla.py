"""MLA over a paged latent cache (``mla_attention[paged]``) with native decode in the absorbed
form (:mod:`.native`, ``csrc/mla.c``).

Dimension legend: ``T`` tokens in the batch, ``S'`` decode rows, ``H`` heads, ``Dn``
``qk_nope_head_dim``, ``Dr`` ``qk_rope_head_dim``, ``Dv`` ``v_head_dim``, ``R``
``kv_lora_rank``, ``W = R + Dr`` one cached latent row, ``NB`` cache blocks, ``BS`` block
size, ``Q`` query tokens of a sequence, ``L`` its context length.

Source: DeepSeek-V2 (arXiv:2405.04434 §2.1) and the core's reference
:func:`zllm.domain.mla.mla_paged_attention`; the absorbed decode of vLLM's ``MLACommonImpl``:
a decode row's query moves into latent space (``q_nope · W_UK``), attends over the cached
latent rows where they lie in their blocks (MQA: one ``W``-wide key per token for all ``H``
heads, its first ``R`` values the value), and the attended latent goes out through ``W_UV``.

A call writes the new latent rows of every token into the cache natively (converted to the
cache's type exactly as ``Tensor.to``), then runs every decode row in one native call — a
sequence of at most ``NATIVE_QUERY_ROWS`` query tokens is decode rows, as in
:mod:`.paged_attention` (whose plan this kernel reads); longer prefill sequences go to the
torch kernel of :mod:`.mla` (the expanded form), which writes their rows again (the same
values) before attending. Caches of another
dtype, or not contiguous, take the torch kernel for the whole call.

``W_UK`` f32 ``[H, Dn, R]`` and ``W_UV`` transposed, f32 ``[H, R, Dv]``, are split out of a
dense ``kv_b_proj`` (converted when 16-bit) once per weight and kept while the weight lives
(:func:`absorbed_weights`): ``4 H (Dn + Dv) R`` bytes per layer (8 MiB for DeepSeek-V2-Lite's
shapes), in exchange for no per-step conversion. A quantized ``kv_b_proj`` stays quantized
(an f32 copy would be 4x an FP8 one: 4 GiB over DeepSeek-V3's layers): such a call runs on the
torch kernel of :mod:`.mla`, which decodes one head at a time.

Numerics: f32 throughout; the exp is within 1 ulp, the softmax is the reference's, only the
summation orders differ: within ~1e-6 of :mod:`zllm.domain.mla` in either form. Each decode
row is reduced in a fixed order that depends only on the shapes and its own ``L``
(``csrc/mla.c``), so its output is bit-identical whatever else is in the batch and for any
thread count (batch-invariant for decode; prefill rows are not, so the kernel is not
registered as batch-invariant).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zllm.plugin_api import AttentionMetadata, QuantizedTensor
from zllm_backend_cpu.kernels import mla as torch_mla
from zllm_backend_cpu.kernels.native import F32, I64, INT, P, function
from zllm_backend_cpu.kernels.paged_attention import decode_plan, native_indices

# zllm_mla_latent_write_<c>(latent, l_ts, slots, T, W, cache, NB * BS, threads)
_WRITE_ARGTYPES = (P, I64, P, I64, I64, P, I64, INT)
# zllm_mla_decode_<c>(q_nope, qn_ts, qn_hs, q_pe, qp_ts, qp_hs, q_rows | NULL, seqs | NULL,
#     ctx_lens, block_tables, bt_rs, MB, cache, NB, BS, S', H, Dn, Dr, Dv, R, w_uk, w_uv_t, scale,
#     q_lat, lat, out, threads)
_DECODE_ARGTYPES = (
    P,
    I64,
    I64,
    P,
    I64,
    I64,
    P,
    P,
    P,
    P,
    I64,
    I64,
    P,
    I64,
    I64,
    I64,
    I64,
    I64,
    I64,
    I64,
    I64,
    P,
    P,
    F32,
    P,
    P,
    P,
    INT,
)
_KERNELS = {
    dtype: (
        function(f"zllm_mla_latent_write_{name}", *_WRITE_ARGTYPES),
        function(f"zllm_mla_decode_{name}", *_DECODE_ARGTYPES),
    )
    for dtype, name in ((torch.float32, "f32"), (torch.float16, "f16"), (torch.bfloat16, "bf16"))
}

# weight -> (its version when split, H, Dn, W_UK, W_UV^T); an entry goes with its weight.
_SPLITS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _version(weight: torch.Tensor | QuantizedTensor) -> int:
    """A number that changes when the weight (any part of a quantized one) is written in place."""
    if isinstance(weight, QuantizedTensor):
        return sum(t._version for t in weight.parts.values())
    return weight._version


def absorbed_weights(
    kv_b_proj: torch.Tensor | QuantizedTensor, h: int, dn: int, dv: int, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK f32 [H, Dn, R], W_UV^T f32 [H, R, Dv])``, both contiguous, from ``kv_b_proj
    [H * (Dn + Dv), R]`` (dense or quantized; row block ``h`` is ``[W_UK[h] | W_UV[h]]``).

    Split once per weight and remembered while it lives; split again if the weight was
    written in place since (its version changed) or is asked for with other head shapes.
    """
    version = _version(kv_b_proj)
    hit = _SPLITS.get(kv_b_proj)
    if hit is not None and hit[:3] == (version, h, dn):
        return hit[3], hit[4]
    kv_b = torch_mla._kv_b_f32(kv_b_proj, h, dn, dv, r)  # [H, Dn + Dv, R]
    w_uk = kv_b[:, :dn].contiguous()  # [H, Dn, R]
    w_uv_t = kv_b[:, dn:].transpose(1, 2).contiguous()  # [H, R, Dv]
    _SPLITS[kv_b_proj] = (version, h, dn, w_uk, w_uv_t)
    return w_uk, w_uv_t


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_proj: torch.Tensor | QuantizedTensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """``q_nope`` f32 ``[T, H, Dn]``, ``q_pe`` f32 ``[T, H, Dr]`` (rotated), ``latent`` f32
    ``[T, W]``, ``latent_cache [NB, BS, W]`` (f32/f16/bf16, written at ``meta.slot_mapping``
    first), ``kv_b_proj [H * (Dn + Dv), R]`` (dense or quantized) -> f32 ``[T, H, Dv]``.

    Decode rows natively in the absorbed form, prefill sequences on the torch kernel in the
    expanded form (module doc). A decode row whose block table points outside the cache gets
    NaN instead of a read outside it.
    """
    kernels = _KERNELS.get(latent_cache.dtype)
    if kernels is None or not latent_cache.is_contiguous() or isinstance(kv_b_proj, QuantizedTensor):
        return torch_mla.mla_attention(q_nope, q_pe, latent, latent_cache, kv_b_proj, meta)
    h, dn, dr, dv, r = torch_mla._check(q_nope, q_pe, latent, latent_cache, kv_b_proj, meta)
    write, decode = kernels
    t = q_nope.shape[0]
    nb, bs, width = latent_cache.shape
    if q_nope.stride(2) != 1:
        q_nope = q_nope.contiguous()
    if q_pe.stride(2) != 1:
        q_pe = q_pe.contiguous()
    if latent.stride(1) != 1:
        latent = latent.contiguous()
    slots, tables = native_indices(meta)
    threads = torch.get_num_threads()
    out = torch.empty(t, h, dv)  # [T, H, Dv]
    if t == 0:
        return out
    write(
        latent.data_ptr(),
        latent.stride(0),
        slots.data_ptr(),
        t,
        width,
        latent_cache.data_ptr(),
        nb * bs,
        threads,
    )
    n, info, prefill = decode_plan(meta, t)
    if n:
        w_uk, w_uv_t = absorbed_weights(kv_b_proj, h, dn, dv, r)
        ptr = info.buffer_info()[0]
        if len(meta.query_lens) == t:  # one row per sequence: row i is sequence i; info: the context lengths
            rows = seqs = None
        else:
            rows, seqs, ptr = ptr, ptr + 8 * n, ptr + 16 * n
        q_lat = torch.empty(n, h, width)  # [S', H, W] scratch: the latent queries
        lat = torch.empty(n, h, r)  # [S', H, R] scratch: the attended latents
        decode(
            q_nope.data_ptr(),
            q_nope.stride(0),
            q_nope.stride(1),
            q_pe.data_ptr(),
            q_pe.stride(0),
            q_pe.stride(1),
            rows,
            seqs,
            ptr,
            tables.data_ptr(),
            tables.stride(0),
            tables.shape[1],
            latent_cache.data_ptr(),
            nb,
            bs,
            n,
            h,
            dn,
            dr,
            dv,
            r,
            w_uk.data_ptr(),
            w_uv_t.data_ptr(),
            meta.scale,
            q_lat.data_ptr(),
            lat.data_ptr(),
            out.data_ptr(),
            threads,
        )
    if prefill:
        _prefill(q_nope, q_pe, latent, latent_cache, kv_b_proj, meta, prefill, out)
    return out



def _prefill(
    q_nope,
    q_pe,
    latent,
    latent_cache,
    kv_b_proj,
    meta: AttentionMetadata,
    prefill: list[int],
    out: torch.Tensor,
) -> None:
    """The prefill sequences ``prefill`` through the torch kernel, their rows into ``out``."""
    starts = [0]
    for n_q in meta.query_lens:
        starts.append(starts[-1] + n_q)
    ranges = [(starts[s], starts[s + 1]) for s in prefill]
    idx: slice | torch.Tensor
    if all(
        ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)
    ):  # one contiguous run of rows
        idx = slice(ranges[0][0], ranges[-1][1])
    else:
        idx = torch.cat([torch.arange(a, b) for a, b in ranges])  # [T_prefill]
    sub = AttentionMetadata(
        meta.slot_mapping[idx],
        meta.block_tables[prefill],
        tuple(meta.query_lens[s] for s in prefill),
        tuple(meta.context_lens[s] for s in prefill),
        meta.scale,
    )
    out[idx] = torch_mla.mla_attention(
        q_nope[idx], q_pe[idx], latent[idx], latent_cache, kv_b_proj, sub
    )
