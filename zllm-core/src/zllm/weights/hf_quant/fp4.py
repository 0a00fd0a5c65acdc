"""``quant_method: mxfp4``: gpt-oss's ``*_blocks`` / ``*_scales`` experts."""

from __future__ import annotations

import torch

from zllm.weights.formats import QuantizedTensor
from zllm.weights.hf_quant.plan import E8M0_DTYPES, Fold, PlanContext, Reader, check_keys


def plan_mxfp4(ctx: PlanContext) -> None:
    """``quant_method: mxfp4``: every ``P_blocks`` with its ``P_scales`` -> the weight ``P``."""
    check_keys(ctx, "quant_method 'mxfp4'", ctx.qconfig, ("quant_method", "modules_to_not_convert"))
    for name, entry in list(ctx.entries.items()):
        if not name.endswith("_blocks"):
            continue
        logical = name.removesuffix("_blocks")
        ctx.need(logical + "_scales", name, "E8M0 scales")
        ctx.expect(name, ("U8",), None, "MXFP4 blocks")
        if len(entry.shape) < 3 or entry.shape[-1] != 16:
            raise ctx.error(name, f"MXFP4 blocks of shape {list(entry.shape)}; expected [..., rows, K/32, 16]")
        *lead, n, groups, _ = entry.shape
        ctx.expect(logical + "_scales", E8M0_DTYPES, (*lead, n, groups), "E8M0 scales")
        shape = (*lead, n, groups * 32)

        def build(read: Reader, name: str = name, scales_name: str = logical + "_scales",
                  shape: tuple[int, ...] = shape) -> QuantizedTensor:
            s = read(scales_name).view(torch.uint8)
            if (s == 255).any():
                raise ctx.error(scales_name, "E8M0 scale byte 255 (NaN)")
            q = read(name).reshape(*shape[:-1], shape[-1] // 2)
            return QuantizedTensor({"qweight": q, "scales": s}, "mxfp4", shape)

        ctx.add(Fold(logical, "mxfp4", shape, None, (name, logical + "_scales"), build))
