"""The kernels of the HF checkpoints' formats compile ahead of time for GPU targets.

The interpreter runs code the compiler may reject (operand types, globals that are not
constexpr, constexpr branches), and no GPU is here: :data:`SCRIPT` builds each kernel with
``triton.compile`` for sm_90 (H100/H200) and gfx942 (MI300) through Triton's own ptxas and
ld.lld — no device involved — over all five formats: ``linear[fmt]`` (with act-order and a
bias) and the fused MoE's grouped GEMM (gate/up with biases and act-order, the down GEMM with
the combine weights), the FP8 conversion native where CUDA may declare it and by bits as ROCm
declares. The smallest ``tl.dot`` tiles take the same code paths as the backends' tunings and
build five times faster. It runs in a fresh interpreter: this folder's conftest makes every
``@triton.jit`` an interpreted function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import inspect, itertools, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zllm_kernels_triton.moe import _grouped_gemm_kernel
from zllm_kernels_triton.quant_hf import FORMAT_CODES, _quant_linear_kernel

SCALES = {0: "*fp32", 1: "*fp32", 2: "*fp32", 3: "*u8", 4: "*u8"}  # f32, or E8M0 / E4M3 bytes


def signature(kernel, consts, pointers):
    return {p: "constexpr" if p in consts else pointers.get(p, "*fp32" if p.endswith("_ptr") else
            "fp32" if p in ("alpha", "limit", "global_scale") else "i32")
            for p in inspect.signature(kernel.fn).parameters}


builds = []
for consts in json.loads(sys.argv[1]):  # grouped GEMM: w1 and w2 formats, act-order, gating
    pointers = {"pairs_ptr": "*i32", "block_experts_ptr": "*i32"}
    for name in ("w1", "w2"):
        pointers.update({f"{name}_ptr": "*u8", f"{name}_s_ptr": SCALES[consts[f"{name.upper()}_FMT"]],
                         f"{name}_z_ptr": "*u8", f"{name}_perm_ptr": "*i64", f"{name}_gs_ptr": "*fp32"})
    builds.append((_grouped_gemm_kernel, {**consts, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}, pointers))
for code in FORMAT_CODES.values():
    pointers = {"q_ptr": "*u8", "s_ptr": SCALES[code], "z_ptr": "*u8", "perm_ptr": "*i64"}
    consts = dict(FMT=code, HAS_BIAS=True, HAS_PERM=code in (1, 2), BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)
    builds.append((_quant_linear_kernel, consts, pointers))
for (backend, arch, warp), (kernel, consts, pointers) in itertools.product(
        (("cuda", 90, 32), ("hip", "gfx942", 64)), builds):
    consts = {**consts, "FP8_NATIVE": backend == "cuda", "PRECISION": "ieee"}
    out = triton.compile(ASTSource(kernel, signature(kernel, consts, pointers), consts),
                         target=GPUTarget(backend, arch, warp))
    assert out.asm.get("cubin") or out.asm.get("hsaco"), (backend, kernel.fn.__name__, consts, sorted(out.asm))
"""


def test_the_hf_format_kernels_compile_for_cuda_and_rocm_targets(tmp_path):
    moe_gemms = [  # all five formats: fp8 + int4 (act-order), mxfp4 + nvfp4, int8 (act-order) down
        dict(W1_FMT=0, W1_PERM=False, W2_FMT=1, W2_PERM=True, GATED=True, BIASED=True, MUL_WEIGHT=False),
        dict(W1_FMT=3, W1_PERM=False, W2_FMT=4, W2_PERM=False, GATED=True, BIASED=False, MUL_WEIGHT=False),
        dict(W1_FMT=2, W1_PERM=True, W2_FMT=2, W2_PERM=True, GATED=False, BIASED=False, MUL_WEIGHT=True),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # build every time, and leave the user's cache alone
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(moe_gemms)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
