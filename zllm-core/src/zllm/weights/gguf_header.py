"""Read a GGUF file's header: metadata key/values, tensor infos, and views of the tensor data.

Why not ``gguf.GGUFReader``: it builds a numpy memmap view for every part of every value,
so a 32,000-token vocabulary (``tokenizer.ggml.tokens``/``scores``/``token_type``) costs
about 400,000 memmap ``__getitem__``/``__array_finalize__`` calls, ~3 s of the ~3.5 s that
opening a 110M-parameter Llama GGUF took. This reader parses the same header with
``struct`` and one ``numpy.frombuffer`` per numeric array (strings in a tight loop), in
tens of milliseconds.

The format is ggml's ``docs/gguf.md`` as ``gguf-py``'s ``GGUFReader`` reads it; the
``gguf`` package stays the definition of its constants (value and tensor types, block
sizes, magic, default alignment) and is the test oracle: for every file,
:attr:`GGUFHeader.fields` decode to what ``ReaderField.contents()`` gives (arrays of arrays
flattened as it flattens them), and tensor names, shapes, types, offsets and bytes are
``GGUFReader``'s. Little-endian files of versions 2 and 3 are read (the two layouts are the
same); big-endian files and other versions raise :class:`GGUFUnsupportedError`.

Every read is bounds-checked against the file size before it happens, so a truncated or
corrupt file raises :class:`GGUFFormatError` saying what was being read and where, never an
``IndexError``/``struct.error`` or a short value. Also checked: the magic, that value and
tensor types are known, UTF-8 of keys, strings and tensor names, duplicate keys and
tensor names, ``general.alignment`` (``UINT32``, a power of two; default 32), rows that do
not split into whole quantization blocks (:class:`GGUFPartialBlockError`, naming the
tensor), that a tensor's dimensions fit numpy, that arrays of arrays nest at most 32 deep,
and that each tensor's data lies inside the file.

Tensor data are numpy views of one copy-on-write mapping (``np.memmap(path, mode="c")``):
writable without a copy (``torch.from_numpy`` shares them) and nothing written reaches the
file. Types numpy has (F32, F16, F64, I8..I64) come as that dtype in numpy order
(``ne0`` last); others as uint8 rows of whole blocks
(``gguf.quant_shape_to_byte_shape``), as ``GGUFReader`` gives them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
    quant_shape_to_byte_shape,
)  # fmt: skip

SUPPORTED_VERSIONS = (2, 3)

# struct format and numpy dtype of each fixed-size value type (little-endian).
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, np.dtype]] = {
    t: (struct.Struct("<" + f), np.dtype(d))
    for t, f, d in (
        (GGUFValueType.UINT8, "B", "<u1"), (GGUFValueType.INT8, "b", "<i1"),
        (GGUFValueType.UINT16, "H", "<u2"), (GGUFValueType.INT16, "h", "<i2"),
        (GGUFValueType.UINT32, "I", "<u4"), (GGUFValueType.INT32, "i", "<i4"),
        (GGUFValueType.UINT64, "Q", "<u8"), (GGUFValueType.INT64, "q", "<i8"),
        (GGUFValueType.FLOAT32, "f", "<f4"), (GGUFValueType.FLOAT64, "d", "<f8"),
        (GGUFValueType.BOOL, "?", "?"),
    )
}  # fmt: skip
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_MAX_ELEMENTS = 2**60
_MAX_ARRAY_DEPTH = 32  # arrays of arrays: bounds the recursion on a crafted file

# GGML tensor types numpy holds natively; the others are bytes.
_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file; the message says what is wrong and where."""


class GGUFUnsupportedError(GGUFFormatError):
    """A well-formed GGUF file this reader does not read (big-endian, another version)."""


class GGUFPartialBlockError(GGUFFormatError):
    """A tensor's rows do not split into whole blocks of its quantization type."""

    def __init__(self, tensor: str, qtype: GGMLQuantizationType, cols: int, block: int):
        self.tensor = tensor
        super().__init__(
            f"stored as GGUF type {qtype.name} with rows of {cols} weights, not a multiple of its {block}-weight block"
        )


@dataclass(frozen=True, slots=True)
class GGUFField:
    """One metadata key/value.

    ``types`` is ``ReaderField.types``: the value type, then for a non-empty array the
    element's types (the first element's, for arrays of arrays). ``value`` is
    ``ReaderField.contents()``: a Python scalar, a ``str``, or a flat list.
    """

    name: str
    types: tuple[GGUFValueType, ...]
    value: Any


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One tensor: ``shape`` in GGUF order (``ne0``, the row length, first); ``data_offset``
    from the start of the file; ``data`` a view of the file mapping (see the module doc)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """A parsed GGUF file. ``data_offset`` is where the tensor data begin (aligned)."""

    path: Path
    size: int
    version: int
    fields: dict[str, GGUFField]
    tensors: list[GGUFTensorInfo]
    alignment: int
    data_offset: int

    def metadata(self) -> dict[str, Any]:
        """Decoded key/values in file order."""
        return {k: f.value for k, f in self.fields.items()}


class _Parser:
    """Bounds-checked little-endian reads from a buffer of ``size`` bytes."""

    def __init__(self, buf: memoryview, size: int):
        self.buf = buf
        self.size = size
        self.off = 0

    def truncated(self, what: str, off: int, n: int) -> GGUFFormatError:
        return GGUFFormatError(
            f"truncated GGUF header: {what} at byte {off} needs {n} bytes, the file has {self.size} bytes"
        )

    def need(self, n: int, what: str) -> int:
        """Offset of ``n`` bytes for ``what`` at the cursor, which moves past them."""
        off = self.off
        if n > self.size - off:
            raise self.truncated(what, off, n)
        self.off = off + n
        return off

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.need(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.need(8, what))[0]

    def raw_string(self, what: str) -> memoryview:
        n = self.u64(f"{what} length")
        off = self.need(n, what)
        return self.buf[off : off + n]

    def string(self, what: str) -> str:
        raw = self.raw_string(what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"corrupt GGUF header: {what} is not UTF-8 ({e.reason} at byte {e.start})") from None

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.u32(f"{what} type")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFFormatError(f"corrupt GGUF header: {what} has unknown value type {raw}") from None

    def value(self, vtype: GGUFValueType, what: str) -> tuple[tuple[GGUFValueType, ...], Any]:
        """``(types, value)`` of a value of ``vtype`` (``ReaderField.types``/``contents()``)."""
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            st = scalar[0]
            return (vtype,), st.unpack_from(self.buf, self.need(st.size, what))[0]
        if vtype == GGUFValueType.STRING:
            return (vtype,), self.string(what)
        assert vtype == GGUFValueType.ARRAY, vtype
        raw_item = self.u32(f"{what} element type")
        count = self.u64(f"{what} length")
        if count == 0:  # GGUFReader never looks at the element type of an empty array
            return (vtype,), []
        try:
            item = GGUFValueType(raw_item)
        except ValueError:
            raise GGUFFormatError(f"corrupt GGUF header: {what} has unknown element type {raw_item}") from None
        scalar = _SCALARS.get(item)
        if scalar is not None:
            dtype = scalar[1]
            off = self.need(count * dtype.itemsize, f"{what} ({count} x {item.name})")
            return (vtype, item), np.frombuffer(self.buf, dtype, count, off).tolist()
        if item == GGUFValueType.STRING:
            return (vtype, item), self._strings(count, what)
        types, leaves = self._raw_array(item, count, what)
        return (vtype, *types), _flatten_like_gguf(types[-1], leaves, what)

    def _strings(self, count: int, what: str) -> list[str]:
        if count * 8 > self.size - self.off:  # each string has an 8-byte length: refuse absurd counts at once
            raise self.truncated(f"{what} ({count} strings)", self.off, count * 8)
        buf, size, unpack = self.buf, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        off = self.off
        for i in range(count):
            if off + 8 > size:
                raise self.truncated(f"{what} element {i} length", off, 8)
            n = unpack(buf, off)[0]
            off += 8
            end = off + n
            if end > size:
                raise self.truncated(f"{what} element {i}", off, n)
            try:
                append(str(buf[off:end], "utf-8"))
            except UnicodeDecodeError as e:
                raise GGUFFormatError(
                    f"corrupt GGUF header: {what} element {i} is not UTF-8 ({e.reason} at byte {e.start})"
                ) from None
            off = end
        self.off = off
        return out

    def _raw_array(
        self, item: GGUFValueType, count: int, what: str, depth: int = 1
    ) -> tuple[tuple[GGUFValueType, ...], list[tuple[GGUFValueType, memoryview]]]:
        """Element types and ``(type, bytes)`` leaves of an array, arrays of arrays included,
        in the shape ``GGUFReader`` keeps them (types of the first element only)."""
        if depth > _MAX_ARRAY_DEPTH:
            raise GGUFFormatError(f"corrupt GGUF header: {what} nests arrays more than {_MAX_ARRAY_DEPTH} deep")
        min_size = 12 if item == GGUFValueType.ARRAY else 8 if item == GGUFValueType.STRING else _SCALARS[item][0].size
        if count * min_size > self.size - self.off:
            self.need(count * min_size, f"{what} ({count} x {item.name})")
        types: tuple[GGUFValueType, ...] = ()
        leaves: list[tuple[GGUFValueType, memoryview]] = []
        for i in range(count):
            elem = f"{what} element {i}"
            if item == GGUFValueType.ARRAY:
                raw_sub = self.u32(f"{elem} element type")
                sub_count = self.u64(f"{elem} length")
                sub_types: tuple[GGUFValueType, ...] = ()
                if sub_count:
                    try:
                        sub = GGUFValueType(raw_sub)
                    except ValueError:
                        raise GGUFFormatError(
                            f"corrupt GGUF header: {elem} has unknown element type {raw_sub}"
                        ) from None
                    sub_types, sub_leaves = self._raw_array(sub, sub_count, elem, depth + 1)
                    leaves += sub_leaves
                elem_types = (item, *sub_types)
            elif item == GGUFValueType.STRING:
                leaves.append((item, self.raw_string(elem)))
                elem_types = (item,)
            else:
                n = _SCALARS[item][0].size
                off = self.need(n, elem)
                leaves.append((item, self.buf[off : off + n]))
                elem_types = (item,)
            if i == 0:
                types = elem_types
        return types, leaves


def _flatten_like_gguf(
    leaf_type: GGUFValueType, leaves: list[tuple[GGUFValueType, memoryview]], what: str
) -> list[Any]:
    """``ReaderField.contents()`` of an array of arrays: all leaves in one list, as strings if
    the first element's innermost type is STRING, else as numbers (a string's bytes as ints)."""
    if leaf_type == GGUFValueType.STRING:
        try:
            return [str(raw, "utf-8") for _, raw in leaves]
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"corrupt GGUF header: a string in {what} is not UTF-8 ({e.reason})") from None
    out: list[Any] = []
    for t, raw in leaves:
        out += list(raw) if t == GGUFValueType.STRING else np.frombuffer(raw, _SCALARS[t][1]).tolist()
    return out


def read_gguf_header(path: Path | str) -> GGUFHeader:
    """Parse ``path``'s header and map its tensor data (see the module doc).

    Raises:
        GGUFFormatError: truncated or corrupt (the message says what and where);
            :class:`GGUFUnsupportedError` for big-endian files and versions other than 2
            and 3; :class:`GGUFPartialBlockError` (``.tensor``) for rows of partial blocks.
        OSError: the file cannot be opened or mapped.
    """
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise GGUFFormatError("truncated GGUF header: the file is empty")
    mapping = np.memmap(path, mode="c")  # copy-on-write: writable views, the file stays as it is
    p = _Parser(memoryview(mapping.data), size)

    magic = p.u32("magic")
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"not a GGUF file: first bytes {bytes(p.buf[:4])!r}, expected {_U32.pack(GGUF_MAGIC)!r}")
    version = p.u32("version")
    if version & 0xFFFF == 0 and version:  # GGUFReader's test for the other byte order
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in SUPPORTED_VERSIONS:
            raise GGUFUnsupportedError("big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFUnsupportedError(
            f"GGUF version {version} is not supported (versions {' and '.join(map(str, SUPPORTED_VERSIONS))} are)"
        )
    n_tensors = p.u64("tensor count")
    n_kv = p.u64("key/value count")

    fields: dict[str, GGUFField] = {}
    for i in range(n_kv):
        start = p.off
        key = p.string(f"key {i} name")
        what = f"key {key!r}"
        vtype = p.value_type(what)
        types, value = p.value(vtype, what)
        if key in fields:
            raise GGUFFormatError(f"corrupt GGUF header: duplicate key {key!r} at byte {start}")
        fields[key] = GGUFField(key, types, value)

    infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = p.string(f"tensor info {i} name")
        what = f"tensor info {i} ({name!r})"
        n_dims = p.u32(f"{what} dimension count")
        off = p.need(8 * n_dims, f"{what} {n_dims} dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", p.buf, off)
        raw_type = p.u32(f"{what} type")
        offset = p.u64(f"{what} data offset")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            qtype = None
        if qtype not in GGML_QUANT_SIZES:
            raise GGUFFormatError(f"corrupt GGUF header: tensor {name!r} has unknown GGML type {raw_type}")
        if name in names:
            raise GGUFFormatError(f"corrupt GGUF header: duplicate tensor {name!r}")
        elements = 1
        for d in dims:
            elements *= d or 1
        if elements > _MAX_ELEMENTS:  # numpy's limit on an array's bytes, even with a zero dimension
            raise GGUFFormatError(
                f"corrupt GGUF header: tensor {name!r} has dimensions {list(dims)}, over 2**60 elements"
            )
        names.add(name)
        infos.append((name, dims, qtype, offset))

    alignment = GGUF_DEFAULT_ALIGNMENT
    align_field = fields.get("general.alignment")
    if align_field is not None:
        if align_field.types != (GGUFValueType.UINT32,):
            raise GGUFFormatError(f"corrupt GGUF header: general.alignment is {align_field.types[0].name}, not UINT32")
        alignment = align_field.value
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"corrupt GGUF header: general.alignment {alignment} is not a power of two")
    data_offset = -(-p.off // alignment) * alignment

    for name, dims, qtype, _ in infos:  # every tensor's rows, before any data is looked at
        block = GGML_QUANT_SIZES[qtype][0]
        if block > 1 and (not dims or dims[0] % block):
            raise GGUFPartialBlockError(name, qtype, dims[0] if dims else 1, block)

    data = mapping.view(np.ndarray)  # plain ndarray views: no memmap bookkeeping per slice
    tensors: list[GGUFTensorInfo] = []
    for name, dims, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = 1
        for d in dims:
            n_elements *= d
        n_bytes = n_elements * type_size // block
        start = data_offset + offset
        end = start + n_bytes
        if end > size:
            raise GGUFFormatError(f"truncated: tensor {name!r} ends at byte {end}, the file has {size} bytes")
        np_shape = tuple(reversed(dims))
        dtype = _TENSOR_DTYPES.get(qtype)
        if dtype is None:
            dtype, np_shape = np.uint8, quant_shape_to_byte_shape(np_shape, qtype)
        array = data[start:end].view(dtype).reshape(np_shape)
        tensors.append(GGUFTensorInfo(name, qtype, dims, n_elements, n_bytes, start, array))
    return GGUFHeader(path, size, version, fields, tensors, alignment, data_offset)
