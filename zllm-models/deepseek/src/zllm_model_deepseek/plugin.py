"""Entry point of the ``zllm-model-deepseek`` distribution (group ``zllm``, name ``deepseek``).

One family, two HF ``model_type`` values (``deepseek_v2``, ``deepseek_v3``) and the GGUF
architecture llama.cpp writes for both (``deepseek2``, :mod:`zllm_model_deepseek.gguf`).
"""

from zllm.plugin_api import FamilyInfo, hookimpl
from zllm_model_deepseek.gguf import GGUF_ARCHITECTURES

ZLLM_PLUGIN_API = "1.3"


@hookimpl
def zllm_model_families() -> list[FamilyInfo]:
    return [
        FamilyInfo(
            name="deepseek",
            model_types=("deepseek_v2", "deepseek_v3"),
            factory="zllm_model_deepseek.family:DeepseekFamily",
            gguf_architectures=GGUF_ARCHITECTURES,
            description="DeepSeek-V2/V3: Multi-head Latent Attention (latent KV cache), "
            "MoE with shared experts",
        ),
    ]
