"""GGUF files of a benchmark checkpoint, so zllm and llama.cpp read the very same weights.

Two writers, chosen by ``writer``:

- ``llama.cpp`` — the ``convert_hf_to_gguf.py`` of the llama.cpp sources vendored in the
  ``llama-cpp-python`` sdist, with the ``gguf-py`` bundled beside it (see
  :mod:`llama_cpp_peer`): ``--outtype f32|f16|bf16|q8_0``. What llama.cpp users run.
- ``gguf`` — :func:`write_llama_gguf`, this module's own writer on the ``gguf`` package
  (PyPI), for machines without the llama.cpp sources. Layout, as the converter writes it:
  architecture ``llama``; keys ``llama.context_length``, ``.embedding_length``,
  ``.block_count``, ``.feed_forward_length``, ``.attention.head_count``,
  ``.attention.head_count_kv``, ``.rope.freq_base``, ``.rope.dimension_count``,
  ``.attention.key_length``, ``.attention.value_length``,
  ``.attention.layer_norm_rms_epsilon``, ``.vocab_size``, ``general.file_type``,
  ``general.quantization_version``; the
  ``tokenizer.ggml.*`` keys of the shipped Llama SentencePiece vocabulary; tensors
  ``token_embd``, ``output_norm``, ``output`` (untied only), ``blk.N.{attn_norm, attn_q,
  attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}.weight``. ``attn_q`` /
  ``attn_k`` rows are permuted from HF's half-rotation to llama.cpp's adjacent-pair RoPE
  order (the converter's ``LlamaModel.permute``). Every 2-D tensor is stored in the dtype
  (Q8_0 via ``gguf.quants.quantize``); norms stay F32.

``auto`` uses the converter when the sources are cached or can be downloaded, else the
``gguf`` writer. Each file gets a ``<file>.json`` sidecar naming its writer.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

GGUF_TYPE_NAMES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def written_by(path: Path) -> str | None:
    """How an existing GGUF file was written (its sidecar), or None if it is not (completely) there."""
    side = _sidecar(path)
    if not (path.exists() and side.exists()):
        return None
    return json.loads(side.read_text())["writer"]


def export_gguf(hf_dir: Path, path: Path, dtype: str, writer: str = "auto", dense_ends: str | None = None) -> str:
    """Write ``hf_dir``'s weights as GGUF ``path`` in ``dtype``; return which writer did it.
    ``dense_ends`` (``"bf16"``; the ``gguf`` writer only): ``token_embd`` and ``output`` in that
    dtype instead, as quantized HF checkpoints keep their embeddings and ``lm_head``.

    Raises:
        ValueError: an unknown ``writer``, or ``dense_ends`` with the llama.cpp converter.
        RuntimeError: the converter failed or the llama.cpp sources are unavailable when
            ``writer="llama.cpp"``.
    """
    import llama_cpp_peer

    if writer not in ("auto", "llama.cpp", "gguf"):
        raise ValueError(f"unknown GGUF writer {writer!r}; expected auto, llama.cpp or gguf")
    if dense_ends is not None and writer != "gguf":
        raise ValueError("dense_ends needs writer='gguf' (the converter's --outtype applies to every tensor)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    src = None
    if writer != "gguf":
        try:
            src = llama_cpp_peer.sources(fetch=True)
        except RuntimeError as exc:
            if writer == "llama.cpp":
                raise
            print(f"[bench] llama.cpp sources unavailable ({exc}); writing GGUF with the gguf package", flush=True)
        if src is None and writer == "llama.cpp":
            raise RuntimeError(f"no llama.cpp sources in {llama_cpp_peer.CACHE}")
    if src is not None:
        cmd, env = llama_cpp_peer.converter_command(src)
        proc = subprocess.run([*cmd, str(hf_dir), "--outtype", dtype, "--outfile", str(tmp)],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{(proc.stderr or proc.stdout)[-3000:]}")
        how = f"llama.cpp convert_hf_to_gguf.py (llama-cpp-python {llama_cpp_peer.sdist_version(src)} sdist)"
    else:
        write_llama_gguf(hf_dir, tmp, dtype, dense_ends)
        how = "gguf package writer (bench/gguf_export.py)"
        if dense_ends:
            how += f", {dense_ends} token_embd / output"
    tmp.replace(path)
    _sidecar(path).write_text(json.dumps({"writer": how, "dtype": dtype, "source": str(hf_dir)}) + "\n")
    return how


def _permute_rope_rows(w, n_head: int):
    """HF half-rotation rows -> llama.cpp adjacent pairs (``convert_hf_to_gguf.py`` ``LlamaModel.permute``)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_llama_gguf(hf_dir: Path, path: Path, dtype: str, dense_ends: str | None = None) -> None:
    """Write an HF Llama checkpoint (f32 safetensors) as a llama.cpp-compatible GGUF (layout above),
    with ``token_embd`` and ``output`` in ``dense_ends`` (``f32`` / ``f16`` / ``bf16``) when given
    (``llama-quantize --token-embedding-type / --output-tensor-type``).

    Raises:
        ValueError: the checkpoint's vocabulary is not the 32000-token Llama one stored here.
    """
    import gguf
    import numpy as np
    from models import SPM_VOCAB
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qtypes = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
              "q4_0": gguf.GGMLQuantizationType.Q4_0}
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[dtype]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(hf_dir.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    # transformers 5 saves RoPE settings under rope_parameters; older versions at the top level.
    w.add_rope_freq_base(cfg.get("rope_parameters", cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab = gguf.GGUFReader(str(SPM_VOCAB))
    n_tokens = len(vocab.fields["tokenizer.ggml.tokens"].data)
    if cfg["vocab_size"] != n_tokens:
        raise ValueError(f"{hf_dir}: vocab_size {cfg['vocab_size']} does not match the {n_tokens}-token Llama "
                         f"vocabulary this writer stores ({SPM_VOCAB.name}); use the llama.cpp converter")
    for key, field in vocab.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(key, field.contents(), vtype,
                            sub_type=field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)

    def add(name: str, data: np.ndarray, as_dtype: str = dtype) -> None:
        data = data.astype(np.float32)
        if data.ndim == 1 or as_dtype == "f32":
            w.add_tensor(name, data)
        elif as_dtype == "f16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            qt = qtypes[as_dtype]
            w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)

    add("token_embd.weight", tensors["model.embed_tokens.weight"], dense_ends or dtype)
    add("output_norm.weight", tensors["model.norm.weight"])
    if not cfg.get("tie_word_embeddings", False):
        add("output.weight", tensors["lm_head.weight"], dense_ends or dtype)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            t = tensors[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute_rope_rows(t, heads)
            elif gg == "attn_k":
                t = _permute_rope_rows(t, kv_heads)
            add(f"blk.{i}.{gg}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bytes_per_token(path: Path) -> dict[str, int]:
    """Weight bytes one batch-1 decode step reads from GGUF ``path``.

    Every tensor is read in full, except the input-embedding table (``token_embd``), of which
    one row is read, and the routed experts of a MoE file (``ffn_*_exps``), of which the
    ``expert_used_count`` selected of ``expert_count`` are read; when there is no ``output``
    tensor the output projection is the tied ``token_embd`` and is read in full. Returns
    ``{"bytes_per_token", "weight_bytes"}`` (plus ``routed_expert_bytes``, ``experts``,
    ``experts_per_token`` for a MoE file).
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    experts = reader.fields.get(f"{arch}.expert_count")
    used = reader.fields.get(f"{arch}.expert_used_count")
    total = 0
    routed = 0  # bytes of the routed experts' stacks (ffn_*_exps [E, N, K])
    embed = None
    has_output = False
    for t in reader.tensors:
        n = int(t.n_bytes)
        total += n
        if "_exps." in t.name:
            routed += n
        if t.name == "token_embd.weight":
            embed = (n, int(t.shape[-1]) if len(t.shape) > 1 else 1)
        has_output |= t.name == "output.weight"
    assert embed is not None, f"{path} has no token_embd.weight"
    embed_bytes, rows = embed
    per_token = total - embed_bytes + embed_bytes // rows + (0 if has_output else embed_bytes)
    out = {"bytes_per_token": per_token, "weight_bytes": total}
    if experts is not None and used is not None:
        # A token reads only the experts its router selects: k of E of every stack.
        k, e = int(used.contents()), int(experts.contents())
        out |= {"bytes_per_token": per_token - routed + routed * k // e, "routed_expert_bytes": routed,
                "experts": e, "experts_per_token": k}
    return out
