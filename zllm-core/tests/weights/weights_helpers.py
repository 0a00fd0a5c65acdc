"""Helpers for the weights-layer tests: paths of the shipped model files, writers of tiny
checkpoints, a check that a tensor lives in a file mapping, and ``open_checkpoint`` with the
GGUF architecture maps of the installed model families (what the engine passes it).

Real files come from ``assets/models`` (see its README for provenance and licenses);
generated checkpoints are written by HF transformers (``save_pretrained``, see conftest.py)
and by ``gguf.GGUFWriter`` into tmp directories. Nothing is downloaded. (A uniquely named
module rather than ``conftest``, which several test folders define.)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import zllm.weights
from zllm.plugins.host import PluginHost
from zllm.weights import Checkpoint

#: GGUF architecture -> map, as the installed llama-style families publish them.
GGUF_MAPS = PluginHost(allowlist=["llama"]).gguf_maps


def open_checkpoint(path: str | Path, fmt: str = "auto") -> Checkpoint:
    """:func:`zllm.weights.open_checkpoint` reading GGUF files through :data:`GGUF_MAPS`."""
    return zllm.weights.open_checkpoint(path, fmt, gguf_maps=GGUF_MAPS)

MODELS = Path(__file__).resolve().parents[3] / "assets" / "models"
STORIES = MODELS / "stories260k"
STORIES_HF = STORIES / "hf"
STORIES_GGUF_F32 = STORIES / "gguf" / "stories260K-f32.gguf"
STORIES_GGUF_F16 = STORIES / "gguf" / "stories260K-f16.gguf"
STORIES_GGUF_Q8_0 = STORIES / "gguf" / "stories260K-q8_0.gguf"
TINY_RANDOM_GGUF = MODELS / "llama-2-tiny-random-gguf" / "llama-2-tiny-random.gguf"

if not STORIES.is_dir():  # pragma: no cover - the shared model folder is part of the workspace
    raise RuntimeError(f"weights tests need the shared model files at {MODELS}")


def copy_hf(dst: Path) -> Path:
    """A writable copy of the stories260k HF directory (without its LICENSE, which sits above it)."""
    shutil.copytree(STORIES_HF, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def write_gguf(path: Path, arch: str, kv: dict[str, tuple[Any, gguf.GGUFValueType]], tensors: dict[str, Any]) -> Path:
    """Write a GGUF file with ``gguf.GGUFWriter``.

    ``tensors`` maps a GGUF name to a numpy array (its own dtype) or to ``(raw_bytes,
    GGMLQuantizationType)`` for block-quantized / BF16 data (uint8 ``[rows, bytes per row]``).
    """
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in kv.items():
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    return finish_gguf(w, path, tensors)


def finish_gguf(w: gguf.GGUFWriter, path: Path, tensors: dict[str, Any]) -> Path:
    """Add ``tensors`` (as :func:`write_gguf` takes them) to ``w`` after its key/values, write and close the file."""
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING


def tiny_llama_kv(**overrides: tuple[Any, gguf.GGUFValueType] | None) -> dict[str, tuple[Any, gguf.GGUFValueType]]:
    """Minimal llama metadata (hidden 32, 1 layer, 4 heads); ``key=None`` drops a key."""
    kv = {
        "llama.context_length": (64, U32),
        "llama.embedding_length": (32, U32),
        "llama.feed_forward_length": (64, U32),
        "llama.block_count": (1, U32),
        "llama.attention.head_count": (4, U32),
        "llama.attention.layer_norm_rms_epsilon": (1e-6, F32),
    }
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if value is None:
            kv.pop(key, None)
        else:
            kv[key] = value
    return kv


def tiny_llama_tensors(rng: np.random.Generator, vocab: int = 16, kv_heads: int = 4) -> dict[str, np.ndarray]:
    """f32 tensors of a 1-layer llama (hidden 32, 4 heads of 8) under GGUF names (numpy order)."""
    h, f, d = 32, 64, 8
    shapes = {
        "token_embd.weight": (vocab, h),
        "output_norm.weight": (h,),
        "blk.0.attn_norm.weight": (h,),
        "blk.0.attn_q.weight": (h, h),
        "blk.0.attn_k.weight": (kv_heads * d, h),
        "blk.0.attn_v.weight": (kv_heads * d, h),
        "blk.0.attn_output.weight": (h, h),
        "blk.0.ffn_norm.weight": (h,),
        "blk.0.ffn_gate.weight": (f, h),
        "blk.0.ffn_up.weight": (f, h),
        "blk.0.ffn_down.weight": (h, f),
    }
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges this process has mapped from ``path`` (Linux /proc/self/maps)."""
    target = str(path.resolve())
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == target:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def assert_backed_by(tensor, path: Path) -> None:
    """Assert that ``tensor``'s bytes lie inside a mapping of ``path`` (no copy in RAM)."""
    ptr, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    ranges = file_mappings(path)
    assert any(lo <= ptr and end <= hi for lo, hi in ranges), f"{ptr:#x} not in a mapping of {path}: {ranges}"


needs_proc = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc/self/maps")
