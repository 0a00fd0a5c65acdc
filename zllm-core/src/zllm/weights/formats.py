"""Weight formats: the names zllm uses for dense dtypes, and the weight-format registry.

A *format* is the storage of one weight tensor: a dense torch dtype (``f32``, ``f16``,
``bf16``) or a quantized format declared once in :data:`FORMATS` (a :class:`WeightFormat`:
its named parts with their kernel-layout dtypes and shapes, the f32 reference decode, bytes
per weight, the compatibility-matrix columns of the checkpoints that store it). Every other
list of formats (op variants, the backends' kernel tables, the compatibility matrix, the GGUF
reader) derives from :data:`FORMATS`. A quantized weight is one :class:`QuantizedTensor`: an
N-D logical tensor (leading dimensions such as an expert stack first) made of named parts.

The HF formats' kernel layouts (``N`` out-features = rows, ``K`` in-features = columns,
``[*lead]`` leading dimensions first in every part, every part contiguous):

- ``fp8_e4m3``: ``qweight`` uint8 ``[*lead, N, K]`` (E4M3FN bits), ``scale`` f32
  ``[*lead, ceil(N / bn), ceil(K / bk)]``; ``w[n, k] = e4m3(q[n, k]) * scale[n // bn, k // bk]``
  with ``block = (bn, bk)``: ``(128, 128)`` for DeepSeek-V3-style blocks, ``(1, K)`` per
  channel, ``(N, K)`` per tensor.
- ``int4_g`` / ``int8_g``: ``qweight`` uint8 ``[*lead, N, K / 2]`` (byte ``j``: low nibble =
  column ``2j``, high nibble = column ``2j + 1``) or ``[*lead, N, K]``; ``scales`` f32
  ``[*lead, N, K / g]``; ``zeros`` uint8 ``[*lead, N, K / g]`` (unsigned zero point; symmetric
  checkpoints get 8 resp. 128); ``w[n, k] = scales[n, k // g] * (q[n, k] - zeros[n, k // g])``,
  ``block = (1, g)``. With GPTQ's act-order (``desc_act``) the columns are stored in group
  order and the optional part ``perm`` int64 ``[*lead, K]`` says which logical column each
  stored column is: stored column ``j`` is logical column ``perm[j]``, so
  ``x @ W^T = x[..., perm] @ W_stored^T``.
- ``mxfp4``: ``qweight`` uint8 ``[*lead, N, K / 2]`` (low nibble = even column), ``scales``
  uint8 ``[*lead, N, K / 32]`` (E8M0); ``w = e2m1(nibble) * 2^(scale - 127)``.
- ``nvfp4``: ``qweight`` uint8 ``[*lead, N, K / 2]``, ``scales`` uint8 ``[*lead, N, K / 16]``
  (E4M3FN bits), ``global_scale`` f32 ``[*lead]``;
  ``w = e2m1(nibble) * (e4m3(scales[n, k // 16]) * global_scale)``.

``e2m1`` is the 4-bit float of the OCP Microscaling spec: bit 3 sign, values ``0, .5, 1, 1.5,
2, 3, 4, 6``. The GGUF block formats have one part, ``data``: uint8
``[*lead, N, K / block_size * type_size]``. Their layouts follow ggml
(``ggml/src/ggml-common.h``); all multi-byte fields are little endian:

- ``q8_0``: 32 weights per block, 34 bytes = f16 scale ``d`` + 32 x int8 ``qs``;
  ``w[i] = d * qs[i]``.
- ``q4_0``: 32 weights per block, 18 bytes = f16 scale ``d`` + 16 bytes ``qs``; byte ``j``
  holds weight ``j`` in its low nibble and weight ``j + 16`` in its high nibble;
  ``w = d * (nibble - 8)``.
- ``q4_1``: 32 weights per block, 20 bytes = f16 scale ``d`` + f16 min ``m`` + 16 bytes
  ``qs`` (nibbles placed as in ``q4_0``); ``w = d * nibble + m``.
- ``q5_0``: 32 weights per block, 22 bytes = f16 ``d`` + ``qh[4]`` (one little-endian
  uint32) + 16 bytes ``qs`` (low 4 bits, placed as in ``q4_0``); bit ``i`` of ``qh`` is bit 4
  of weight ``i``'s ``q``; ``w = d * (q - 16)``.
- ``q5_1``: 32 weights per block, 24 bytes = f16 ``d`` + f16 ``m`` + ``qh[4]`` + 16 bytes
  ``qs`` (``q`` as in ``q5_0``); ``w = d * q + m``.

Rows whose length is not a multiple of 256 cannot hold k-quant super-blocks, so llama.cpp's
``Q4_K_M``/``Q5_K_M`` files store such tensors (e.g. MoE expert widths of 1408) in these
32-weight formats.

K-quants (``block_q*_K``) use a *super-block* of ``QK_K = 256`` weights split into
sub-blocks (16 of 16 weights or 8 of 32), each with its own small integer scale (and min)
that multiplies the super-block's f16 ``d`` (and ``dmin``). ``sub(i)`` below is the sub-block
of weight ``i``; ``q`` is the weight's quantized integer:

- ``q2_k``: 84 bytes = ``scales[16]`` (byte ``s``: low nibble = scale, high nibble = min of
  sub-block ``s`` of 16 weights) + ``qs[64]`` (2-bit ``q``) + f16 ``d`` + f16 ``dmin``.
  Weights ``128*h + 32*j + l`` (half ``h``, ``j`` in 0..3, ``l`` in 0..31) sit in bits
  ``2j, 2j+1`` of ``qs[32*h + l]``. ``w = d * scale * q - dmin * min``.
- ``q3_k``: 110 bytes = ``hmask[32]`` + ``qs[64]`` (low 2 bits, placed as in ``q2_k``) +
  ``scales[12]`` (16 6-bit scales: low nibbles in bytes 0..7 — sub-block ``s < 8`` in byte
  ``s``'s low nibble, ``s >= 8`` in byte ``s - 8``'s high nibble — high 2 bits in bytes
  8..11, sub-block ``s`` at bits ``2*(s // 4)`` of byte ``8 + s % 4``) + f16 ``d``. Bit
  ``i // 32`` of ``hmask[i % 32]`` is the high bit; ``q = low2 - (0 if high else 4)`` in
  ``[-4, 3]``. ``w = d * (scale6 - 32) * q``.
- ``q4_k``: 144 bytes = f16 ``d`` + f16 ``dmin`` + ``scales[12]`` (8 6-bit scales and 8
  6-bit mins, packed as ggml's ``get_scale_min_k4``: for ``s < 4`` scale = ``b[s] & 63``,
  min = ``b[s+4] & 63``; for ``s >= 4`` scale = ``(b[s+4] & 15) | (b[s-4] >> 6) << 4``,
  min = ``(b[s+4] >> 4) | (b[s] >> 6) << 4``) + ``qs[128]``. Weights ``64*g + l`` and
  ``64*g + 32 + l`` (``g`` in 0..3, ``l`` in 0..31) are the low and high nibble of
  ``qs[32*g + l]``; sub-blocks of 32. ``w = d * scale * q - dmin * min``.
- ``q5_k``: 176 bytes = f16 ``d`` + f16 ``dmin`` + ``scales[12]`` (as ``q4_k``) + ``qh[32]``
  + ``qs[128]`` (low 4 bits, as ``q4_k``). Bit ``i // 32`` of ``qh[i % 32]`` is bit 4 of
  ``q``. ``w = d * scale * q - dmin * min``.
- ``q6_k``: 210 bytes = ``ql[128]`` + ``qh[64]`` + int8 ``scales[16]`` + f16 ``d``. In half
  ``h`` (weights ``128*h ..``), for ``l`` in 0..31, weights ``+l``, ``+l+32``, ``+l+64``,
  ``+l+96`` take their low 4 bits from ``ql[64h+l] & 15``, ``ql[64h+l+32] & 15``,
  ``ql[64h+l] >> 4``, ``ql[64h+l+32] >> 4`` and their high 2 bits from bits 0-1, 2-3, 4-5,
  6-7 of ``qh[32h+l]``; sub-blocks of 16. ``w = d * scale * (q - 32)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import attrs
import torch

DENSE_FORMATS: dict[torch.dtype, str] = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
DTYPE_OF_FORMAT: dict[str, torch.dtype] = {v: k for k, v in DENSE_FORMATS.items()}


@attrs.frozen
class BlockLayout:
    """One GGUF block layout: ``block_size`` weights stored in ``type_size`` bytes."""

    name: str
    block_size: int
    type_size: int


QK_K = 256  # weights per k-quant super-block (ggml's QK_K)

#: How a part follows a selection of a 2-D weight's rows (:meth:`QuantizedTensor.rows`).
ROW = "row"  # its dimension -2 is the weight's row: select the same rows
BLOCK_ROW = "block_row"  # its dimension -2 is the row block ``n // block[0]``: select those
UNROWED = "unrowed"  # no row dimension (a column permutation, a global scale): kept whole
_ROW_KINDS = (ROW, BLOCK_ROW, UNROWED)

Shape = tuple[int, ...]
PartShapes = Callable[[Shape, int, int, tuple[int, int]], dict[str, Shape]]


@attrs.frozen
class Part:
    """One named tensor of a quantized weight, in its kernel layout.

    Attributes:
        name: the part's name (``qweight``, ``scale`` …), a key of :attr:`QuantizedTensor.parts`.
        dtype: its torch dtype.
        shape: its shape in symbols, for documentation (``"[*lead, N, K/2]"``).
        rows: how it follows a row selection: :data:`ROW`, :data:`BLOCK_ROW` or :data:`UNROWED`.
        optional: the part may be absent (GPTQ's act-order ``perm``).
    """

    name: str
    dtype: torch.dtype
    shape: str
    rows: str = attrs.field(validator=attrs.validators.in_(_ROW_KINDS))
    optional: bool = False


@attrs.frozen
class WeightFormat:
    """One quantized weight format: the single declaration every table of formats derives from.

    Attributes:
        name: the format name (``q8_0``, ``fp8_e4m3`` …): op variant, capability, registry key.
        summary: one line for documentation and ``zllm compat``.
        parts: the named parts of one logical weight, in their kernel layouts.
        part_shapes: ``(lead, N, K, block) -> {part: shape}`` for a weight of logical shape
            ``(*lead, N, K)``; optional parts included (a weight without one simply lacks it).
        bits: bits of one quantized value (the scales come on top; see :meth:`nbytes`).
        reference: ``"module:function"`` of the f32 reference decode, ``QuantizedTensor ->
            f32 [*lead, N, K]`` (imported on first use: the weights layer never imports the
            domain layer).
        columns: the compatibility matrix's columns for checkpoints storing this format
            (``gguf-Q8_0``, ``hf-fp8`` …).
        fixed_block: ``(rows, cols)`` of the weights one scale covers when the format fixes
            it (GGUF blocks, MXFP4, NVFP4); None when each weight says (:attr:`QuantizedTensor.block`).
        column_multiple: a weight's columns must be a multiple of this.
        gguf: the GGUF block layout, for the GGUF formats.
    """

    name: str
    summary: str
    parts: tuple[Part, ...]
    part_shapes: PartShapes
    bits: int
    reference: str
    columns: tuple[str, ...]
    fixed_block: tuple[int, int] | None = None
    column_multiple: int = 1
    gguf: BlockLayout | None = None

    def part(self, name: str) -> Part:
        """The declaration of part ``name``. Raises KeyError naming the format's parts."""
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(f"format {self.name!r} has no part {name!r}; its parts: {', '.join(p.name for p in self.parts)}")

    def nbytes(self, shape: Shape, block: tuple[int, int] | None = None, optional: bool = False) -> int:
        """Bytes of a weight of logical ``shape`` (``(*lead, N, K)``) in this format: the sum
        of its parts' bytes (optional parts counted when ``optional``)."""
        *lead, n, k = shape
        block = block or self.fixed_block or (1, k)
        shapes = self.part_shapes(tuple(lead), n, k, block)
        return sum(math.prod(s) * self.part(name).dtype.itemsize for name, s in shapes.items()
                   if optional or not self.part(name).optional)

    def bits_per_weight(self, shape: Shape, block: tuple[int, int] | None = None) -> float:
        """Bits per logical weight of a weight of ``shape`` (scales and zero points included)."""
        return 8 * self.nbytes(shape, block) / math.prod(shape)


def _gguf_shapes(layout: BlockLayout) -> PartShapes:
    return lambda lead, n, k, block: {"data": (*lead, n, k // layout.block_size * layout.type_size)}


def _gguf(name: str, block_size: int, type_size: int, bits: int, summary: str) -> WeightFormat:
    layout = BlockLayout(name, block_size, type_size)
    return WeightFormat(
        name=name, summary=summary,
        parts=(Part("data", torch.uint8, f"[*lead, N, K/{block_size}*{type_size}]", ROW),),
        part_shapes=_gguf_shapes(layout), bits=bits,
        reference=f"zllm.domain.quant:dequantize_{name}", columns=(f"gguf-{name.upper()}",),
        fixed_block=(1, block_size), column_multiple=block_size, gguf=layout,
    )  # fmt: skip


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_shapes(lead: Shape, n: int, k: int, block: tuple[int, int]) -> dict[str, Shape]:
    return {"qweight": (*lead, n, k), "scale": (*lead, _ceil(n, block[0]), _ceil(k, block[1]))}


def _int_shapes(bits: int) -> PartShapes:
    def shapes(lead: Shape, n: int, k: int, block: tuple[int, int]) -> dict[str, Shape]:
        groups = k // block[1]
        return {"qweight": (*lead, n, k * bits // 8), "scales": (*lead, n, groups), "zeros": (*lead, n, groups),
                "perm": (*lead, k)}
    return shapes


def _fp4_shapes(group: int, global_scale: bool) -> PartShapes:
    def shapes(lead: Shape, n: int, k: int, block: tuple[int, int]) -> dict[str, Shape]:
        out = {"qweight": (*lead, n, k // 2), "scales": (*lead, n, k // group)}
        return {**out, "global_scale": tuple(lead)} if global_scale else out
    return shapes


def _int_format(bits: int) -> WeightFormat:
    packed = "K/2" if bits == 4 else "K"
    return WeightFormat(
        name=f"int{bits}_g",
        summary=f"{bits}-bit integers in groups of g columns with an f32 scale and a zero point each "
                "(GPTQ, AWQ, compressed-tensors pack-quantized; int-quantized W8A8 weights, run weight-only)",
        parts=(Part("qweight", torch.uint8, f"[*lead, N, {packed}]", ROW),
               Part("scales", torch.float32, "[*lead, N, K/g]", ROW),
               Part("zeros", torch.uint8, "[*lead, N, K/g]", ROW),
               Part("perm", torch.int64, "[*lead, K]", UNROWED, optional=True)),
        part_shapes=_int_shapes(bits), bits=bits, reference="zllm.domain.quant_hf:dequantize_int_g",
        columns=(f"hf-gptq-int{bits}", *(("hf-awq-int4",) if bits == 4 else ()), f"hf-ct-int{bits}",
                 *(("hf-ct-w8a8",) if bits == 8 else ())),
        column_multiple=2 if bits == 4 else 1,
    )  # fmt: skip


#: The weight-format registry: format name -> declaration. GGUF block layouts (ggml
#: ``ggml-common.h``, byte layouts in the module doc) first, then the HF checkpoints' formats.
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    _gguf("q8_0", 32, 34, 8, "GGUF Q8_0: 32 int8 and an f16 scale per block"),
    _gguf("q4_0", 32, 18, 4, "GGUF Q4_0: 32 4-bit values and an f16 scale per block"),
    _gguf("q4_1", 32, 20, 4, "GGUF Q4_1: 32 4-bit values, an f16 scale and min per block"),  # 2 + 2 + 16
    _gguf("q5_0", 32, 22, 5, "GGUF Q5_0: 32 5-bit values and an f16 scale per block"),  # 2 + 4 + 16
    _gguf("q5_1", 32, 24, 5, "GGUF Q5_1: 32 5-bit values, an f16 scale and min per block"),  # 2 + 2 + 4 + 16
    _gguf("q2_k", QK_K, 84, 2, "GGUF Q2_K super-blocks"),  # 16 + 64 + 2 + 2
    _gguf("q3_k", QK_K, 110, 3, "GGUF Q3_K super-blocks"),  # 32 + 64 + 12 + 2
    _gguf("q4_k", QK_K, 144, 4, "GGUF Q4_K super-blocks"),  # 2 + 2 + 12 + 128
    _gguf("q5_k", QK_K, 176, 5, "GGUF Q5_K super-blocks"),  # 2 + 2 + 12 + 32 + 128
    _gguf("q6_k", QK_K, 210, 6, "GGUF Q6_K super-blocks"),  # 128 + 64 + 16 + 2
    WeightFormat(
        name="fp8_e4m3",
        summary="FP8 E4M3FN with f32 scales per block, channel or tensor (HF fp8, compressed-tensors "
                "float-quantized, modelopt FP8)",
        parts=(Part("qweight", torch.uint8, "[*lead, N, K]", ROW),
               Part("scale", torch.float32, "[*lead, ceil(N/bn), ceil(K/bk)]", BLOCK_ROW)),
        part_shapes=_fp8_shapes, bits=8, reference="zllm.domain.quant_hf:dequantize_fp8_e4m3",
        columns=("hf-fp8", "hf-ct-fp8", "hf-modelopt-fp8"),
    ),
    _int_format(4),
    _int_format(8),
    WeightFormat(
        name="mxfp4",
        summary="OCP MXFP4: E2M1 values in blocks of 32 with an E8M0 scale (gpt-oss, compressed-tensors)",
        parts=(Part("qweight", torch.uint8, "[*lead, N, K/2]", ROW),
               Part("scales", torch.uint8, "[*lead, N, K/32]", ROW)),
        part_shapes=_fp4_shapes(32, False), bits=4, reference="zllm.domain.quant_hf:dequantize_mxfp4",
        columns=("hf-mxfp4", "hf-ct-mxfp4", "gguf-MXFP4"), fixed_block=(1, 32), column_multiple=32,
    ),
    WeightFormat(
        name="nvfp4",
        summary="NVFP4: E2M1 values in blocks of 16 with an E4M3 scale, times an f32 global scale "
                "(modelopt, compressed-tensors)",
        parts=(Part("qweight", torch.uint8, "[*lead, N, K/2]", ROW),
               Part("scales", torch.uint8, "[*lead, N, K/16]", ROW),
               Part("global_scale", torch.float32, "[*lead]", UNROWED)),
        part_shapes=_fp4_shapes(16, True), bits=4, reference="zllm.domain.quant_hf:dequantize_nvfp4",
        columns=("hf-modelopt-nvfp4", "hf-ct-nvfp4"), fixed_block=(1, 16), column_multiple=16,
    ),
)}

#: The GGUF block layouts: format name -> layout (derived from :data:`FORMATS`).
BLOCK_LAYOUTS: dict[str, BlockLayout] = {name: f.gguf for name, f in FORMATS.items() if f.gguf is not None}

#: Every format a weight can have: the dense dtypes, then :data:`FORMATS` in order.
ALL_FORMATS: tuple[str, ...] = (*DENSE_FORMATS.values(), *FORMATS)


def format_of(weight: torch.Tensor | QuantizedTensor) -> str:
    """The format name of a weight: ``f32``/``f16``/``bf16`` or its :data:`FORMATS` name.

    Raises:
        ValueError: a dense tensor of a dtype zllm does not store weights in.
    """
    if isinstance(weight, QuantizedTensor):
        return weight.fmt
    try:
        return DENSE_FORMATS[weight.dtype]
    except KeyError:
        raise ValueError(
            f"unsupported weight dtype {weight.dtype}; expected one of {sorted(DENSE_FORMATS.values())}"
        ) from None


def _as_parts(value: torch.Tensor | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GGUF format's single byte tensor becomes its one part ``data``."""
    return {"data": value} if isinstance(value, torch.Tensor) else dict(value)


def _as_shape(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


@attrs.frozen(eq=False)
class QuantizedTensor:
    """A quantized weight kept in its stored form: one logical tensor ``(*lead, N, K)`` (2-D, or
    N-D with leading dimensions such as an expert stack ``[E, N, K]``) made of named parts.

    ``QuantizedTensor(data, "q8_0", shape)`` builds a GGUF-format weight from its bytes;
    ``QuantizedTensor({"qweight": q, "scale": s}, "fp8_e4m3", shape, block=(128, 128))`` one of
    several parts.

    Attributes:
        parts: part name -> tensor in the kernel layout of :data:`FORMATS` ``[fmt]`` (the
            module doc); every part has the weight's leading dimensions first.
        fmt: the format name, a key of :data:`FORMATS`.
        shape: logical ``(*lead, N, K)`` of the dequantized tensor.
        block: ``(rows, cols)`` of the weights one scale covers, for the formats whose weights
            choose it (``fp8_e4m3``, ``int4_g``, ``int8_g``); None takes the format's fixed block.
    """

    parts: dict[str, torch.Tensor] = attrs.field(converter=_as_parts)
    fmt: str
    shape: tuple[int, ...] = attrs.field(converter=_as_shape)
    block: tuple[int, int] | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        spec = FORMATS[self.fmt]
        *lead, n, k = self.shape
        block = self.block_shape
        assert len(self.shape) >= 2 and k % spec.column_multiple == 0, (self.fmt, self.shape)
        expected = spec.part_shapes(tuple(lead), n, k, block)
        for part in spec.parts:
            if part.name not in self.parts:
                assert part.optional, (self.fmt, "missing part", part.name)
                continue
            t = self.parts[part.name]
            assert t.dtype == part.dtype, (self.fmt, part.name, t.dtype, part.dtype)
            assert tuple(t.shape) == expected[part.name], (self.fmt, part.name, tuple(t.shape), expected[part.name])
        assert set(self.parts) <= {p.name for p in spec.parts}, (self.fmt, sorted(self.parts))

    @property
    def spec(self) -> WeightFormat:
        """The format's declaration in :data:`FORMATS`."""
        return FORMATS[self.fmt]

    @property
    def block_shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of the weights one scale covers: :attr:`block`, else the format's
        fixed block."""
        block = self.block or FORMATS[self.fmt].fixed_block
        assert block is not None, (self.fmt, "needs an explicit block")
        return block

    @property
    def data(self) -> torch.Tensor:
        """The one byte tensor of a GGUF block format: uint8 ``[*lead, rows, bytes per row]``;
        row ``r`` holds the blocks of logical row ``r`` in order (ggml's layout)."""
        assert "data" in self.parts, (self.fmt, "has parts", sorted(self.parts))
        return self.parts["data"]

    @property
    def layout(self) -> BlockLayout:
        """The GGUF block layout of a GGUF-format weight."""
        layout = FORMATS[self.fmt].gguf
        assert layout is not None, (self.fmt, "is not a GGUF block format")
        return layout

    @property
    def nbytes(self) -> int:
        """Bytes of all parts together."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def _with(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...],
              block: tuple[int, int] | None = None) -> QuantizedTensor:
        return QuantizedTensor(parts, self.fmt, shape, block=block or self.block)

    def __getitem__(self, index: int) -> QuantizedTensor:
        """Slice ``index`` of the first dimension (expert ``e`` of ``[E, N, K]`` -> ``[N, K]``),
        sharing every part. Only N-D (N >= 3) tensors slice; a 2-D weight's rows come from
        :meth:`rows`.

        Raises:
            IndexError: ``index`` is outside ``[-shape[0], shape[0])``.
        """
        assert len(self.shape) >= 3 and isinstance(index, int), (self.shape, index)
        if not -self.shape[0] <= index < self.shape[0]:
            raise IndexError(f"index {index} out of range for the first dimension of "
                             f"{list(self.shape)}")
        return self._with({name: t[index] for name, t in self.parts.items()}, self.shape[1:])

    def rows(self, index: torch.Tensor | slice) -> QuantizedTensor:
        """Rows ``index`` (int64 ``[n]``, or a step-1 slice) of a 2-D weight as a new quantized
        weight ``(n, K)``. Row parts are gathered (a slice shares them); a block-row scale is
        gathered per selected row, so the result's block becomes ``(1, bk)``."""
        assert len(self.shape) == 2, self.shape
        spec = FORMATS[self.fmt]
        if isinstance(index, slice):
            start, stop, step = index.indices(self.shape[0])
            assert step == 1, index
            ids = torch.arange(start, max(start, stop))
        else:
            ids = index
        parts: dict[str, torch.Tensor] = {}
        block = self.block
        for name, t in self.parts.items():
            kind = spec.part(name).rows
            if kind == ROW:
                parts[name] = t[index]
            elif kind == BLOCK_ROW:
                parts[name] = t[ids.to(t.device) // self.block_shape[0]]
                block = (1, self.block_shape[1])
            else:
                parts[name] = t
        return self._with(parts, (int(ids.numel()), self.shape[1]), block)

    def to(self, device: torch.device) -> QuantizedTensor:
        """Every part moved to ``device``."""
        return self.map(lambda t: t.to(device))

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensor:
        """``fn`` applied to every part (placing on a device, cloning), shape and block kept."""
        return self._with({name: fn(t) for name, t in self.parts.items()}, self.shape)


def concat_rows(
    weights: list[torch.Tensor] | list[QuantizedTensor],
) -> torch.Tensor | QuantizedTensor | None:
    """Weights ``[N_i, K]`` that multiply the same input as one ``[sum N_i, K]`` weight whose
    rows are theirs in order (q, k and v projections as one QKV projection), in their format;
    None when they cannot be joined without changing a value: different formats, columns or
    blocks, a scale block of rows that would straddle two of them, or a part without rows (a
    global scale, a column permutation) that differs between them.

    A linear kernel computes each output row from its weight row and the input alone, so the
    joined weight's outputs are the separate ones', side by side. The result is a new tensor
    (the parts concatenated), not a view.
    """
    first = weights[0]
    if not isinstance(first, QuantizedTensor):
        dense = [w for w in weights if not isinstance(w, QuantizedTensor)]
        if len(dense) != len(weights) or any(w.dim() != 2 or w.dtype != first.dtype or w.shape[1] != first.shape[1]
                                              for w in dense):
            return None
        return torch.cat(dense)
    quantized = [w for w in weights if isinstance(w, QuantizedTensor)]
    if len(quantized) != len(weights) or len({(w.fmt, len(w.shape), w.shape[-1], w.block_shape, tuple(sorted(w.parts)))
                                              for w in quantized}) != 1 or len(first.shape) != 2:
        return None
    spec = FORMATS[first.fmt]
    parts: dict[str, torch.Tensor] = {}
    for name in first.parts:
        kind = spec.part(name).rows
        pieces = [w.parts[name] for w in quantized]
        if kind == UNROWED:
            if not all(torch.equal(p, pieces[0]) for p in pieces[1:]):
                return None
            parts[name] = pieces[0]
            continue
        if kind == BLOCK_ROW and any(w.shape[0] % first.block_shape[0] for w in quantized):
            return None
        parts[name] = torch.cat(pieces, dim=-2)
    return QuantizedTensor(parts, first.fmt, (sum(w.shape[0] for w in quantized), first.shape[1]), block=first.block)


def concat_projections(
    weights: list[torch.Tensor] | list[QuantizedTensor], biases: list[torch.Tensor | None],
) -> tuple[torch.Tensor | QuantizedTensor, torch.Tensor | None] | None:
    """Projections of the same input (weights ``[N_i, K]``, biases f32 ``[N_i]`` or None) as one:
    ``(concat_rows(weights), the biases concatenated or None)``; None where :func:`concat_rows`
    refuses or where some but not all have a bias (a zero bias would add a step the others do
    not take)."""
    if len({b is None for b in biases}) != 1:
        return None
    joined = concat_rows(weights)
    if joined is None:
        return None
    present = [b for b in biases if b is not None]
    return joined, torch.cat(present) if present else None


def stack_weights(weights: list[torch.Tensor] | list[QuantizedTensor]) -> torch.Tensor | QuantizedTensor:
    """``E`` weights ``[N, K]`` (per-expert checkpoint tensors) as one ``[E, N, K]`` stack: dense
    tensors by ``torch.stack``, quantized ones part by part (each part gains the leading ``E``).

    Raises:
        ValueError: the weights differ in format, shape or block (names what differs).
    """
    first = weights[0]
    if not isinstance(first, QuantizedTensor):
        return torch.stack(weights)  # type: ignore[arg-type]
    quantized = [w for w in weights if isinstance(w, QuantizedTensor)]
    kinds = {(w.fmt, w.shape, w.block_shape, tuple(sorted(w.parts))) for w in quantized}
    if len(quantized) != len(weights) or len(kinds) != 1:
        raise ValueError(f"cannot stack weights of different formats, shapes or blocks: {sorted(map(str, kinds))}")
    parts = {name: torch.stack([w.parts[name] for w in quantized]) for name in first.parts}
    return QuantizedTensor(parts, first.fmt, (len(quantized), *first.shape), block=first.block)
