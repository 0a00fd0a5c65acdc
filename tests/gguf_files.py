"""Write GGUF variants of existing files with the `gguf` package's own writer and quantizer:
formats no shipped file covers (Q4_0, Q4_1, Q5_0, Q5_1, BF16), or changed metadata."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# Header pseudo-fields the reader reports and the writer produces by itself.
_WRITER_OWNED = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def _copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, overrides: dict[str, object]) -> None:
    for key, field in reader.fields.items():
        if key in _WRITER_OWNED:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, overrides.get(key, field.contents()), vtype, sub_type=sub)


def with_metadata(src: Path, dst: Path, overrides: dict[str, object]) -> Path:
    """Copy ``src`` to ``dst`` with the values of existing metadata keys replaced (same types)."""
    reader = gguf.GGUFReader(src)
    assert set(overrides) <= set(reader.fields), sorted(set(overrides) - set(reader.fields))
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    _copy_fields(reader, writer, overrides)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(int(d) for d in reversed(t.shape)),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def requantize(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """Copy ``src`` to ``dst`` with every 2-D weight whose rows split into whole blocks
    stored as ``qtype`` (others, e.g. norms, keep their type), as llama.cpp's quantizer does."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    _copy_fields(reader, writer, {})
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.F32 and data.ndim == 2 and data.shape[1] % block == 0:
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
