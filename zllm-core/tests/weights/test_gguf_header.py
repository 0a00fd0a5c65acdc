"""zllm.weights.gguf_header against gguf.GGUFReader, the reference reader.

Every shipped GGUF file, files written by ``gguf.GGUFWriter`` (every value type, every
tensor type) and hand-built files for what the writer cannot write (empty arrays, arrays
of arrays whose first element is empty, version 2, broken files) must read to the same
metadata, tensor infos and tensor bytes as ``GGUFReader``; damaged files must raise
``GGUFFormatError`` saying what is wrong, never an ``IndexError``/``struct.error``.
"""

from __future__ import annotations

import itertools
import math
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weights_helpers import (
    MODELS,
    STORIES_GGUF_F32,
    STORIES_GGUF_Q8_0,
    assert_backed_by,
    finish_gguf,
    open_checkpoint,
    tiny_llama_kv,
    tiny_llama_tensors,
    write_gguf,
)  # fmt: skip

from zllm.spec.errors import CheckpointError, TensorError
from zllm.weights.gguf_header import (
    GGUFFormatError,
    GGUFPartialBlockError,
    GGUFUnsupportedError,
    read_gguf_header,
)  # fmt: skip

V, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
SHARED_GGUF = sorted(MODELS.rglob("*.gguf"))
_PSEUDO_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # GGUFReader's, not the file's


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types (NaN equal to NaN)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def assert_reads_as_gguf_reader(path: Path) -> None:
    ours, ref = read_gguf_header(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in ref.fields.items() if k not in _PSEUDO_KEYS}
    assert list(ours.fields) == list(fields)
    for key, field in fields.items():
        assert _same(ours.fields[key].value, field.contents()), key
        assert list(ours.fields[key].types) == list(field.types), key
    assert _same(ours.metadata(), {k: f.contents() for k, f in fields.items()})
    assert ours.version == int(ref.fields["GGUF.version"].contents())
    assert (ours.alignment, ours.data_offset, ours.size) == (ref.alignment, ref.data_offset, path.stat().st_size)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors, strict=True):
        assert (t.tensor_type, t.shape, t.n_elements, t.n_bytes, t.data_offset) == (
            r.tensor_type, tuple(int(d) for d in r.shape), int(r.n_elements), int(r.n_bytes), int(r.data_offset)
        ), t.name  # fmt: skip
        assert (t.data.dtype, t.data.shape) == (r.data.dtype, r.data.shape), t.name
        assert t.data.tobytes() == r.data.tobytes(), t.name


# --------------------------------------------------------------------------- equal to GGUFReader


@pytest.mark.parametrize("path", SHARED_GGUF, ids=lambda p: p.name)
def test_shipped_files_read_as_gguf_reader_reads_them(path):
    assert_reads_as_gguf_reader(path)


def test_the_shipped_files_are_found():
    names = {p.name for p in SHARED_GGUF}
    assert {"stories260K-f32.gguf", "llama-2-tiny-random.gguf", "ggml-vocab-llama-spm.gguf"} <= names


EVERY_VALUE = {
    "v.u8": (255, V.UINT8), "v.i8": (-128, V.INT8), "v.u16": (65535, V.UINT16), "v.i16": (-32768, V.INT16),
    "v.u32": (2**32 - 1, V.UINT32), "v.i32": (-(2**31), V.INT32), "v.u64": (2**64 - 1, V.UINT64),
    "v.i64": (-(2**63), V.INT64), "v.f32": (1e-5, V.FLOAT32), "v.f32_nan": (float("nan"), V.FLOAT32),
    "v.f32_inf": (float("-inf"), V.FLOAT32), "v.f64": (math.pi, V.FLOAT64), "v.true": (True, V.BOOL),
    "v.false": (False, V.BOOL), "v.str": ("hello", V.STRING), "v.str_empty": ("", V.STRING),
    "v.str_unicode": ("héllo ▁ 日本語 🦙 \u0000 end", V.STRING),
    "v.a_u8": ([0, 1, 255], V.ARRAY, V.UINT8), "v.a_i8": ([-128, 0, 127], V.ARRAY, V.INT8),
    "v.a_u16": ([1, 65535], V.ARRAY, V.UINT16), "v.a_i16": ([-32768, 7], V.ARRAY, V.INT16),
    "v.a_u32": ([1, 2**32 - 1], V.ARRAY, V.UINT32), "v.a_i32": ([-(2**31), 5], V.ARRAY, V.INT32),
    "v.a_u64": ([2**64 - 1, 3], V.ARRAY, V.UINT64), "v.a_i64": ([-(2**63), 9], V.ARRAY, V.INT64),
    "v.a_f32": ([1e-5, -0.0, float("nan"), 3.5], V.ARRAY, V.FLOAT32), "v.a_f64": ([math.e, -1e300], V.ARRAY, V.FLOAT64),
    "v.a_bool": ([True, False, True], V.ARRAY, V.BOOL), "v.a_one": ([42], V.ARRAY, V.INT32),
    "v.a_str": (["a", "", "ü▁x", "🦙", "<0x0A>"], V.ARRAY, V.STRING),
    "v.a_nested": ([[1, 2], [3], [4, 5, 6]], V.ARRAY, None),
    "v.a_nested_str": ([["a", "bc"], ["", "d"]], V.ARRAY, None),
    "v.a_nested3": ([[[1.5], [2.5, 3.5]], [[4.5]]], V.ARRAY, None),
}  # fmt: skip


def _write_every_value(path: Path, tensors: dict[str, Any] | None = None, **writer_args: Any) -> Path:
    w = gguf.GGUFWriter(str(path), "llama", **writer_args)
    for key, (value, vtype, *sub) in EVERY_VALUE.items():
        w.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    return finish_gguf(w, path, tensors or {})


def _every_tensor_type() -> dict[str, Any]:
    """One small tensor of every GGML type (random bytes for block types)."""
    rng = np.random.default_rng(0)
    tensors: dict[str, Any] = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32), "f16": rng.standard_normal((2, 4)).astype(np.float16),
        "f64": rng.standard_normal(7), "i8": np.arange(-4, 4, dtype=np.int8), "i16": np.arange(6, dtype=np.int16),
        "i32": np.arange(6, dtype=np.int32).reshape(2, 3), "i64": np.arange(3, dtype=np.int64),
        "f32_3d": rng.standard_normal((2, 3, 4)).astype(np.float32), "f32_scalar_row": np.ones(1, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }  # fmt: skip
    for qtype, (_, type_size) in gguf.GGML_QUANT_SIZES.items():
        if qtype in (Q.F32, Q.F16, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64):
            continue
        tensors[f"q.{qtype.name}"] = (rng.integers(0, 256, (2, 2 * type_size), dtype=np.uint8), qtype)
    return tensors


def test_every_value_and_tensor_type_reads_as_gguf_reader(tmp_path):
    path = _write_every_value(tmp_path / "all.gguf", _every_tensor_type())
    assert_reads_as_gguf_reader(path)
    fields = read_gguf_header(path).fields
    assert fields["v.u64"].value == 2**64 - 1 and fields["v.true"].value is True and fields["v.str_empty"].value == ""
    assert fields["v.a_nested"].value == [1, 2, 3, 4, 5, 6]  # flattened, as GGUFReader does
    assert fields["v.a_nested"].types == (V.ARRAY, V.ARRAY, V.INT32)


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_general_alignment_is_used(tmp_path, alignment):
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_custom_alignment(alignment)
    w.add_tensor("a", np.arange(3, dtype=np.float32))
    w.add_tensor("b", np.arange(5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_reads_as_gguf_reader(tmp_path / "a.gguf")
    header = read_gguf_header(tmp_path / "a.gguf")
    assert header.alignment == alignment and header.data_offset % alignment == 0
    assert header.tensors[1].data.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_version_2_reads_as_version_3(tmp_path):
    data = bytearray(_write_every_value(tmp_path / "v3.gguf", {"w": np.ones((2, 2), np.float32)}).read_bytes())
    data[4:8] = struct.pack("<I", 2)
    (tmp_path / "v2.gguf").write_bytes(data)
    assert_reads_as_gguf_reader(tmp_path / "v2.gguf")
    assert read_gguf_header(tmp_path / "v2.gguf").version == 2


# Hand-built files: what GGUFWriter cannot write.


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _arr(itype: int, count: int, items: bytes = b"") -> bytes:
    return struct.pack("<IQ", itype, count) + items


def _tensor_info(name: str | bytes, dims: tuple[int, ...], ttype: int, offset: int) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)


def _nested(depth: int) -> bytes:
    """An array of one array of one … array of one UINT8, ``depth`` arrays deep."""
    value = _arr(V.UINT8, 1, b"\x01")
    for _ in range(depth - 1):
        value = _arr(V.ARRAY, 1, value)
    return value


def _gguf(kvs: list[bytes], infos: list[bytes] = (), data: bytes = b"", version: int = 3, alignment: int = 32) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data


ODD_ARRAYS = [
    _kv("a.empty_u32", V.ARRAY, _arr(V.UINT32, 0)),
    _kv("a.empty_str", V.ARRAY, _arr(V.STRING, 0)),
    _kv("a.empty_bad_type", V.ARRAY, _arr(1234, 0)),  # GGUFReader never reads the type of an empty array
    _kv("a.empty_first", V.ARRAY, _arr(V.ARRAY, 2, _arr(V.INT32, 0) + _arr(V.INT32, 2, struct.pack("<2i", 7, 8)))),
    _kv("a.empty_first_str", V.ARRAY, _arr(V.ARRAY, 2, _arr(V.STRING, 0) + _arr(V.STRING, 1, _str("ab")))),
    _kv("a.mixed", V.ARRAY, _arr(V.ARRAY, 2, _arr(V.UINT8, 1, b"\x05") + _arr(V.UINT16, 1, b"\x06\x00"))),
    _kv("a.str_then_u8", V.ARRAY, _arr(V.ARRAY, 2, _arr(V.STRING, 1, _str("hi")) + _arr(V.UINT8, 1, b"A"))),
    _kv("a.deep", V.ARRAY, _nested(20)),
    _kv("a.bool_bytes", V.ARRAY, _arr(V.BOOL, 3, b"\x00\x01\x02")),
    _kv("a.bool_two", V.BOOL, b"\x02"),
    _kv("GGUF.custom", V.STRING, _str("left out of metadata")),
]


def test_odd_arrays_read_as_gguf_reader(tmp_path):
    path = tmp_path / "odd.gguf"
    path.write_bytes(_gguf(ODD_ARRAYS, [_tensor_info("t", (4,), Q.F32, 0)], np.arange(4, dtype=np.float32).tobytes()))
    assert_reads_as_gguf_reader(path)
    fields = read_gguf_header(path).fields
    assert fields["a.empty_bad_type"].value == [] and fields["a.empty_first"].value == [7, 8]
    assert fields["a.empty_first_str"].value == [97, 98]  # GGUFReader: a string's bytes when the first element is empty
    # as GGUFCheckpoint always did
    assert "GGUF.custom" in fields and "GGUF.custom" not in open_checkpoint(path).metadata


def test_vocabulary_only_file_without_tensors(tmp_path):
    path = tmp_path / "vocab.gguf"
    path.write_bytes(_gguf([_kv("tokenizer.ggml.tokens", V.ARRAY, _arr(V.STRING, 2, _str("a") + _str("b")))]))
    assert_reads_as_gguf_reader(path)
    assert read_gguf_header(path).tensors == []


# --------------------------------------------------------------------------- tensor data


def test_tensor_data_are_writable_copy_on_write_views(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", {}, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    before = path.read_bytes()
    (t,) = read_gguf_header(path).tensors
    assert t.data.flags.writeable and t.data.tolist() == [[0, 1, 2], [3, 4, 5]]
    shared = torch.from_numpy(t.data)
    if Path("/proc/self/maps").exists():
        assert_backed_by(shared, path)
    shared[0, 0] = 42.0
    assert t.data[0, 0] == 42.0 and path.read_bytes() == before  # copy-on-write: the file keeps its bytes


# --------------------------------------------------------------------------- damaged files


def test_truncated_tensor_data_names_the_tensor(tmp_path):
    path = tmp_path / "cut.gguf"
    data = STORIES_GGUF_Q8_0.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFFormatError, match=r"truncated: tensor '[\w.]+' ends at byte \d+, the file has \d+ bytes"):
        read_gguf_header(path)


def _header_end(path: Path) -> int:
    """Where GGUFReader's last header part ends (before the alignment padding)."""
    r = gguf.GGUFReader(path)
    last = (r.tensors[-1].field if r.tensors else list(r.fields.values())[-1])
    return last.offset + sum(int(p.nbytes) for p in last.parts)


_CUT_FILES: dict[str, bytes] = {}


def _cut_source(name: str, tmp: Path) -> bytes:
    if name not in _CUT_FILES:
        src = STORIES_GGUF_F32 if name == "stories" else _write_every_value(tmp / "all.gguf", _every_tensor_type())
        _CUT_FILES[name] = src.read_bytes()[: _header_end(src)]
    return _CUT_FILES[name]


_cut_counter = itertools.count()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(source=st.sampled_from(["stories", "every_value"]), where=st.floats(0, 1, exclude_max=True))
def test_a_header_cut_anywhere_says_truncated(tmp_path, source, where):
    header = _cut_source(source, tmp_path)
    cut = int(where * len(header))
    path = tmp_path / f"cut{next(_cut_counter)}.gguf"
    path.write_bytes(header[:cut])
    with pytest.raises(GGUFFormatError, match="^truncated GGUF header: ") as e:
        read_gguf_header(path)
    assert f"the file has {cut} bytes" in str(e.value) or cut == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupt_header_bytes_raise_format_errors_only(tmp_path, data):
    """Overwriting header bytes gives a header that reads or a GGUFFormatError, nothing else."""
    header = bytearray(_cut_source("every_value", tmp_path))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(4, len(header) - 1))
        header[at] = data.draw(st.sampled_from([0x00, 0x01, 0x07, 0x0C, 0x80, 0xFF]))
    path = tmp_path / f"bad{next(_cut_counter)}.gguf"
    path.write_bytes(bytes(header) + bytes(4096))
    try:
        read_gguf_header(path)
    except GGUFFormatError:
        pass


@pytest.mark.parametrize(("content", "message"), [
    (b"", "truncated GGUF header: the file is empty"),
    (b"GGU", "truncated GGUF header: magic at byte 0 needs 4 bytes, the file has 3 bytes"),
    (b"GGML" + bytes(20), r"not a GGUF file: first bytes b'GGML', expected b'GGUF'"),
    (b"GGUF" + struct.pack(">I", 3) + bytes(16), "big-endian GGUF files are not supported"),
    (b"GGUF" + struct.pack("<I", 1) + bytes(16), "GGUF version 1 is not supported"),
    (b"GGUF" + struct.pack("<I", 3) + bytes(8), "truncated GGUF header: key/value count at byte 16 needs 8 bytes"),
    (_gguf([_kv("k", 99, b"")]), "key 'k' has unknown value type 99"),
    (_gguf([_kv("k", V.ARRAY, _arr(77, 1, b"x"))]), "key 'k' has unknown element type 77"),
    (_gguf([_kv(b"\xff", V.UINT8, b"\x01")]), "key 0 name is not UTF-8"),
    (_gguf([_kv("k", V.STRING, _str(b"a\xc3"))]), "key 'k' is not UTF-8"),
    (_gguf([_kv("k", V.ARRAY, _arr(V.STRING, 2, _str("ok") + _str(b"\x80")))]), "key 'k' element 1 is not UTF-8"),
    (_gguf([_kv("k", V.UINT8, b"\x01"), _kv("k", V.UINT8, b"\x02")]), "duplicate key 'k'"),
    (_gguf([_kv("k", V.ARRAY, _arr(V.UINT32, 2**62))]), r"key 'k' \(4611686018427387904 x UINT32\) at byte \d+ needs"),
    (_gguf([_kv("k", V.ARRAY, _arr(V.STRING, 2**62))]), r"key 'k' \(4611686018427387904 strings\)"),
    (_gguf([_kv("k", V.ARRAY, _nested(40))]), "key 'k' element 0 element 0 .* nests arrays more than 32 deep"),
    (_gguf([_kv("general.alignment", V.UINT64, struct.pack("<Q", 32))]), "general.alignment is UINT64, not UINT32"),
    (_gguf([_kv("general.alignment", V.UINT32, struct.pack("<I", 24))]), "general.alignment 24 is not a power of two"),
    (_gguf([], [_tensor_info("t", (4,), 1000, 0)]), "tensor 't' has unknown GGML type 1000"),
    (_gguf([], [_tensor_info("t", (1,), Q.F32, 0), _tensor_info("t", (1,), Q.F32, 0)], bytes(8)),
     "duplicate tensor 't'"),
    (_gguf([], [_tensor_info("t", (0, 2**62, 2**62), Q.F32, 0)]),
     r"tensor 't' has dimensions .*, over 2\*\*60 elements"),
    (_gguf([], [_tensor_info("t", (4,), Q.F32, 2**64 - 1)]), "truncated: tensor 't' ends at byte"),
    (_gguf([], [_tensor_info("t", (4,), Q.F32, 0)], bytes(15)),
     "truncated: tensor 't' ends at byte 80, the file has 79 bytes"),
])  # fmt: skip
def test_broken_files_say_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=message):
        read_gguf_header(path)


def test_big_endian_and_other_versions_are_unsupported_not_corrupt(tmp_path):
    path = _write_every_value(tmp_path / "be.gguf", endianess=gguf.GGUFEndian.BIG)
    assert gguf.GGUFReader(path).byte_order == "S"  # the reference reads it, swapped
    with pytest.raises(GGUFUnsupportedError, match="big-endian"):
        read_gguf_header(path)
    with pytest.raises(CheckpointError, match="be.gguf: big-endian GGUF files are not supported$"):
        open_checkpoint(path)


def test_partial_block_rows_name_the_tensor(tmp_path):
    path = tmp_path / "q.gguf"
    path.write_bytes(_gguf([], [_tensor_info("blk.0.ffn_up.weight", (48, 2), Q.Q8_0, 0)], bytes(128)))
    with pytest.raises(GGUFPartialBlockError, match="stored as GGUF type Q8_0 with rows of 48 weights") as e:
        read_gguf_header(path)
    assert e.value.tensor == "blk.0.ffn_up.weight"
    with pytest.raises(TensorError, match="not a multiple of its 32-weight block") as e:
        open_checkpoint(path)
    assert e.value.tensor == "blk.0.ffn_up.weight" and e.value.file == str(path)


def test_checkpoint_errors_name_the_file_and_what_is_wrong(tmp_path):
    path = tmp_path / "t.gguf"
    path.write_bytes(_gguf([], [_tensor_info("token_embd.weight", (4, 4), 1000, 0)], bytes(64)))
    with pytest.raises(
        CheckpointError, match="t.gguf: corrupt GGUF header: tensor 'token_embd.weight' has unknown GGML type 1000"
    ):
        open_checkpoint(path)
    data = write_gguf(
        tmp_path / "m.gguf", "llama", tiny_llama_kv(), tiny_llama_tensors(np.random.default_rng(0))
    ).read_bytes()
    for cut in (30, len(data) - 8):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated") as e:
            open_checkpoint(tmp_path / "cut.gguf")
        assert e.value.file == str(tmp_path / "cut.gguf")
