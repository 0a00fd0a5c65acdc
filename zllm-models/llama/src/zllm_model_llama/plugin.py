"""Entry point of the ``zllm-model-llama`` distribution (group ``zllm``, name ``llama``)."""

from zllm.plugin_api import FamilyInfo, hookimpl

ZLLM_PLUGIN_API = "1.0"


@hookimpl
def zllm_model_families() -> list[FamilyInfo]:
    return [
        FamilyInfo(
            name="llama",
            model_types=("llama",),
            factory="zllm_model_llama.family:LlamaFamily",
            description="Llama architecture: MHA/GQA/MQA, RMSNorm, RoPE, SwiGLU, tied or untied output",
        )
    ]
