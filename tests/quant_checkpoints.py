"""Quantized HF checkpoint directories written as their quantizers write them, for tests.

Each writer takes a dense f32 state dict (what ``save_pretrained`` wrote) and quantizes the
linear weights of the decoder layers, leaving embeddings, norms and ``lm_head`` dense (as the
configs' ``ignore`` / ``modules_to_not_convert`` lists do). The values come from zllm's tiny
quantizers (``zllm.conformance.quantizers``); the packings are written here from each format's
definition (bit layouts commented) or by compressed-tensors' own compressors. Every writer
returns the dequantized state dict: the f32 weights the checkpoint means, for an oracle run.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zllm.conformance import quantizers
from zllm.domain.quant import dequantize
from zllm.weights.formats import QuantizedTensor

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]

StateDict = dict[str, torch.Tensor]


def is_quantized(name: str, modules: tuple[str, ...] = QUANTIZED) -> bool:
    """Whether a writer quantizes weight ``name`` (a decoder layer's linear weight named in ``modules``)."""
    return name.endswith(".weight") and name.split(".")[-2] in modules


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values ``[..., M]`` (``M`` a multiple of ``32 / bits``) -> int32 ``[..., M * bits / 32]``:
    value ``i`` of each group of ``32 / bits`` at bits ``bits * i`` (little-endian streams, as
    GPTQ's and compressed-tensors' packers write them)."""
    per = 32 // bits
    v = values.to(torch.int64).unflatten(-1, (-1, per))  # [..., W, per]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (v << shifts).sum(-1)  # [..., W] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unsigned(w: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q uint8 [N, K], scales f32 [N, G], zeros uint8 [N, G])`` of an ``int*_g`` weight."""
    q = w.parts["qweight"]
    if w.fmt == "int4_g":
        q = torch.stack([q & 0x0F, q >> 4], dim=-1).flatten(-2)
    return q, w.parts["scales"], w.parts["zeros"]


def _finish(src: Path, dst: Path, tensors: StateDict, qconfig: dict) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})


def _rewrite(src: Path, dst: Path, qconfig: dict,
             quantize: Callable[[str, torch.Tensor, StateDict], torch.Tensor],
             modules: tuple[str, ...] = QUANTIZED) -> StateDict:
    """Copy ``src`` to ``dst`` with ``quantize(prefix, w, out)`` storing each quantized weight's
    tensors into ``out`` and returning its dequantized f32 value."""
    dense = load_file(str(src / "model.safetensors"))
    out: StateDict = {}
    deq: StateDict = {}
    for name, t in dense.items():
        if is_quantized(name, modules):
            deq[name] = quantize(name.removesuffix("weight"), t.float(), out)
        else:
            out[name] = t
            deq[name] = t.float()
    _finish(src, dst, out, qconfig)
    return deq


def write_fp8(src: Path, dst: Path, block: tuple[int, int] | None, naming: str = "transformers",
              modules: tuple[str, ...] = QUANTIZED) -> StateDict:
    """transformers ``fp8``: ``weight`` F8_E4M3 + ``weight_scale_inv`` F32 (``block`` per
    ``weight_block_size``; None = one scale per tensor with a static ``activation_scale``).
    ``naming="autofp8"``: per-tensor ``weight_scale`` + ``input_scale`` as AutoFP8/vLLM write."""
    def quantize(prefix: str, w: torch.Tensor, out: StateDict) -> torch.Tensor:
        q = quantizers.quantize_fp8_e4m3(w, block)
        out[prefix + "weight"] = q.parts["qweight"].view(torch.float8_e4m3fn)
        scale = q.parts["scale"] if block else q.parts["scale"].reshape(())
        if naming == "autofp8":
            out[prefix + "weight_scale"], out[prefix + "input_scale"] = scale, torch.tensor(0.05)
        else:
            out[prefix + "weight_scale_inv"] = scale
            if block is None:
                out[prefix + "activation_scale"] = torch.tensor(0.05)
        return dequantize(q)

    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic" if block else "static",
               "weight_block_size": list(block) if block else None, "modules_to_not_convert": ["lm_head"]}
    return _rewrite(src, dst, qconfig, quantize, modules)


def write_gptq(src: Path, dst: Path, bits: int, group: int, version: str = "gptq", desc_act: bool = False,
               seed: int = 0) -> StateDict:
    """GPTQ (AutoGPTQ layout): ``qweight`` I32 ``[K * bits / 32, N]`` (packed along K: word
    ``[i, n]`` holds ``q[n, (32/bits) * i + j]`` at bits ``bits * j``), ``qzeros`` I32
    ``[K/g, N * bits / 32]`` (packed along N; ``gptq`` v1 stores ``z - 1``), ``scales`` F16
    ``[K/g, N]``, ``g_idx`` I32 ``[K]``. ``desc_act``: the columns are grouped in a random
    activation order: group ``j`` holds logical columns ``order[j*g:(j+1)*g]``."""
    gen = torch.Generator().manual_seed(seed)

    def quantize(prefix: str, w: torch.Tensor, out: StateDict) -> torch.Tensor:
        n, k = w.shape
        order = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
        qt = quantizers.quantize_int_g(w[:, order], bits, group, symmetric=False)
        scales16 = qt.parts["scales"].half()  # GPTQ stores f16 scales: decode with those
        qt = QuantizedTensor({**qt.parts, "scales": scales16.float()}, qt.fmt, qt.shape, block=qt.block)
        q_grouped, _, zeros = _unsigned(qt)
        q = torch.empty_like(q_grouped)
        q[:, order] = q_grouped  # back to logical column order
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group).to(torch.int32)
        stored_zeros = zeros.to(torch.int64) - (1 if version == "gptq" else 0)
        out[prefix + "qweight"] = pack_words(q, bits).t().contiguous()
        out[prefix + "qzeros"] = pack_words(stored_zeros.t() & ((1 << bits) - 1), bits)
        out[prefix + "scales"] = scales16.t().contiguous()
        out[prefix + "g_idx"] = g_idx
        deq = torch.empty(n, k)
        deq[:, order] = dequantize(qt)
        return deq

    qconfig = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": False,
               "checkpoint_format": version, "true_sequential": True, "damp_percent": 0.01}
    return _rewrite(src, dst, qconfig, quantize)


def write_awq(src: Path, dst: Path, group: int) -> StateDict:
    """AutoAWQ ``gemm``: ``qweight`` I32 ``[K, N/8]`` (word ``[k, c]`` nibble ``i`` = ``q[8c +
    AWQ_ORDER[i], k]``), ``qzeros`` I32 ``[K/g, N/8]`` alike, ``scales`` F16 ``[K/g, N]``."""
    def interleave(v: torch.Tensor) -> torch.Tensor:  # [rows, N] -> columns in AWQ's nibble order
        n = v.shape[-1]
        cols = torch.arange(n) // 8 * 8 + torch.tensor(AWQ_ORDER)[torch.arange(n) % 8]
        return v[:, cols]

    def quantize(prefix: str, w: torch.Tensor, out: StateDict) -> torch.Tensor:
        qt = quantizers.quantize_int_g(w, 4, group, symmetric=False)
        scales16 = qt.parts["scales"].half()
        qt = QuantizedTensor({**qt.parts, "scales": scales16.float()}, qt.fmt, qt.shape, block=qt.block)
        q, _, zeros = _unsigned(qt)
        out[prefix + "qweight"] = pack_words(interleave(q.t().contiguous()), 4)
        out[prefix + "qzeros"] = pack_words(interleave(zeros.t().contiguous()), 4)
        out[prefix + "scales"] = scales16.t().contiguous()
        return dequantize(qt)

    qconfig = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
               "modules_to_not_convert": None}
    return _rewrite(src, dst, qconfig, quantize)


def write_modelopt_nvfp4(src: Path, dst: Path) -> StateDict:
    """modelopt NVFP4: ``weight`` U8 ``[N, K/2]`` (two E2M1 codes, low nibble first),
    ``weight_scale`` F8_E4M3 ``[N, K/16]``, ``weight_scale_2`` F32, ``input_scale`` F32."""
    def quantize(prefix: str, w: torch.Tensor, out: StateDict) -> torch.Tensor:
        q = quantizers.quantize_nvfp4(w)
        out[prefix + "weight"] = q.parts["qweight"]
        out[prefix + "weight_scale"] = q.parts["scales"].view(torch.float8_e4m3fn)
        out[prefix + "weight_scale_2"] = q.parts["global_scale"]
        out[prefix + "input_scale"] = torch.tensor(0.01)
        return dequantize(q)

    qconfig = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    return _rewrite(src, dst, qconfig, quantize)


def write_modelopt_fp8(src: Path, dst: Path) -> StateDict:
    """modelopt FP8 as its unified HF export writes config.json (``convert_hf_quant_config_format``):
    ``weight`` F8_E4M3 ``[N, K]``, ``weight_scale`` F32 scalar (per tensor), ``input_scale`` F32 scalar."""
    def quantize(prefix: str, w: torch.Tensor, out: StateDict) -> torch.Tensor:
        q = quantizers.quantize_fp8_e4m3(w, None)
        out[prefix + "weight"] = q.parts["qweight"].view(torch.float8_e4m3fn)
        out[prefix + "weight_scale"] = q.parts["scale"].reshape(())
        out[prefix + "input_scale"] = torch.tensor(0.05)
        return dequantize(q)

    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    qconfig = {"config_groups": {"group_0": {"input_activations": fp8, "weights": fp8, "targets": ["Linear"]}},
               "ignore": ["lm_head"], "quant_algo": "FP8", "producer": {"name": "modelopt", "version": "0.37.0"},
               "quant_method": "modelopt"}
    return _rewrite(src, dst, qconfig, quantize)


def write_compressed_tensors(src: Path, dst: Path, scheme: str, group: int = 32) -> StateDict:
    """A compressed-tensors checkpoint written by the library's own compressors
    (``compress(state_dict, scheme)``) from zllm quantizers' scales: ``w4a16`` (pack-quantized
    int4, asymmetric groups of ``group``), ``w8a16`` (pack-quantized int8, symmetric per channel),
    ``w8a8`` (int-quantized: int8 weights per channel, activations int8 per token, dynamic),
    ``w8a8-static`` (int-quantized: one weight scale per tensor, a static per-tensor
    ``input_scale``), ``fp8-block`` (float-quantized, 32 x 32 blocks), ``nvfp4``, ``mxfp4``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    int8 = dict(num_bits=8, type="int", symmetric=True)
    activations = {"w8a8": QuantizationArgs(**int8, strategy="token", dynamic=True),
                   "w8a8-static": QuantizationArgs(**int8, strategy="tensor", dynamic=False)}.get(scheme)
    args, fmt = {
        "w4a16": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group), "pack-quantized"),
        "w8a8": (dict(int8, strategy="channel"), "int-quantized"),
        "w8a8-static": (dict(int8, strategy="tensor"), "int-quantized"),
        "w8a16": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "pack-quantized"),
        "fp8-block": (dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[32, 32]),
                      "float-quantized"),
        "nvfp4": (dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16),
                  "nvfp4-pack-quantized"),
        "mxfp4": (dict(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32,
                       scale_dtype=torch.uint8, zp_dtype=torch.uint8), "mxfp4-pack-quantized"),
    }[scheme]
    qscheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args), input_activations=activations,
                                 format=fmt)
    compressor = BaseCompressor.get_value_from_registry(fmt)

    def quantize(prefix: str, w: torch.Tensor, out: StateDict) -> torch.Tensor:
        if scheme == "w4a16":
            qt = quantizers.quantize_int_g(w, 4, group, symmetric=False)
            state = {"weight": w, "weight_scale": qt.parts["scales"],
                     "weight_zero_point": (qt.parts["zeros"].to(torch.int8) - 8)}
        elif scheme in ("w8a16", "w8a8"):
            qt = quantizers.quantize_int_g(w, 8, w.shape[1], symmetric=True)
            state = {"weight": w, "weight_scale": qt.parts["scales"]}
        elif scheme == "w8a8-static":
            state = {"weight": w, "weight_scale": (w.abs().max() / 127).reshape(1)}
            out[prefix + "input_scale"] = torch.tensor([0.02])
        elif scheme == "fp8-block":
            qt = quantizers.quantize_fp8_e4m3(w, (32, 32))
            state = {"weight": w, "weight_scale": qt.parts["scale"]}
        elif scheme == "nvfp4":
            qt = quantizers.quantize_nvfp4(w)
            state = {"weight": w, "weight_scale": qt.parts["scales"].view(torch.float8_e4m3fn).float(),
                     "weight_global_scale": (1.0 / qt.parts["global_scale"]).reshape(1)}
        else:
            qt = quantizers.quantize_mxfp4(w)
            state = {"weight": w, "weight_scale": torch.ldexp(torch.ones(qt.parts["scales"].shape),
                                                               qt.parts["scales"].int() - 127)}
        compressed = compressor.compress(state, qscheme)
        for k, v in compressed.items():
            out[prefix + k] = v
        if scheme == "nvfp4":  # decompress() unpacks to bf16: the same decode, kept in f32
            packed = compressed["weight_packed"]
            values = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
            return ct_dequantize(values, compressed["weight_scale"].float(), args=qscheme.weights,
                                 global_scale=compressed["weight_global_scale"], dtype=torch.float32)
        return compressor.decompress(dict(compressed), qscheme)["weight"].float()

    qconfig = QuantizationConfig(config_groups={"group_0": qscheme}, format=fmt, quantization_status="compressed",
                                 ignore=["lm_head"]).model_dump(mode="json")
    return _rewrite(src, dst, qconfig, quantize)


def write_dense(src: Path, dst: Path, state: StateDict) -> None:
    """A dense f32 copy of ``src`` holding ``state`` (the dequantized weights of a quantized
    checkpoint: the oracle's input where transformers cannot load the quantized directory)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
