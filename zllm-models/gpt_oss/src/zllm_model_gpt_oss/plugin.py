"""Entry point of the ``zllm-model-gpt-oss`` distribution (group ``zllm``, name ``gpt_oss``).

One family, HF ``model_type`` ``gpt_oss`` and the GGUF architecture ``gpt-oss``
(:mod:`zllm_model_gpt_oss.gguf`).
"""

from zllm.plugin_api import FamilyInfo, hookimpl
from zllm_model_gpt_oss.gguf import GGUF_ARCHITECTURES

ZLLM_PLUGIN_API = "1.3"


@hookimpl
def zllm_model_families() -> list[FamilyInfo]:
    return [
        FamilyInfo(
            name="gpt_oss",
            model_types=("gpt_oss",),
            factory="zllm_model_gpt_oss.family:GptOssFamily",
            gguf_architectures=GGUF_ARCHITECTURES,
            description="gpt-oss: attention sinks, alternating sliding/full layers, YaRN, "
            "MoE with biased experts and a clamped SwiGLU",
        ),
    ]
