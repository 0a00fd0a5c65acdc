"""Entry point of the ``zllm-model-llama`` distribution (group ``zllm``, name ``llama``).

One distribution, one layer code, several HF ``model_type`` values: each published
:class:`FamilyInfo` names a small family class in :mod:`zllm_model_llama.family` and
hands the core the GGUF architectures it reads (:mod:`zllm_model_llama.gguf`; Mistral and
Mixtral GGUF files are written as ``llama``, which the ``llama`` map reads as ``mixtral`` when
the file has experts).
"""

from zllm.plugin_api import FamilyInfo, hookimpl
from zllm_model_llama.gguf import GGUF_ARCHITECTURES

ZLLM_PLUGIN_API = "1.3"


@hookimpl
def zllm_model_families() -> list[FamilyInfo]:
    return [
        FamilyInfo(
            name="llama",
            model_types=("llama",),
            factory="zllm_model_llama.family:LlamaFamily",
            gguf_architectures={"llama": GGUF_ARCHITECTURES["llama"]},
            description="Llama architecture: MHA/GQA/MQA, RMSNorm, RoPE (+ linear/dynamic/llama3/yarn scaling), SwiGLU",
        ),
        FamilyInfo(
            name="mistral",
            model_types=("mistral",),
            factory="zllm_model_llama.family:MistralFamily",
            description="Mistral: llama layers with an optional sliding window on every layer",
        ),
        FamilyInfo(
            name="qwen2",
            model_types=("qwen2",),
            factory="zllm_model_llama.family:Qwen2Family",
            gguf_architectures={"qwen2": GGUF_ARCHITECTURES["qwen2"]},
            description="Qwen2: llama layers with q/k/v biases, per-layer full or sliding attention",
        ),
        FamilyInfo(
            name="qwen3",
            model_types=("qwen3",),
            factory="zllm_model_llama.family:Qwen3Family",
            gguf_architectures={"qwen3": GGUF_ARCHITECTURES["qwen3"]},
            description="Qwen3: llama layers with per-head q/k RMSNorm, per-layer full or sliding attention",
        ),
        FamilyInfo(
            name="mixtral",
            model_types=("mixtral",),
            factory="zllm_model_llama.family:MixtralFamily",
            description="Mixtral: Mistral layers with a top-k softmax Mixture-of-Experts FFN",
        ),
        FamilyInfo(
            name="qwen2_moe",
            model_types=("qwen2_moe",),
            factory="zllm_model_llama.family:Qwen2MoeFamily",
            gguf_architectures={"qwen2moe": GGUF_ARCHITECTURES["qwen2moe"]},
            description="Qwen2-MoE: Qwen2 layers with a MoE FFN and a sigmoid-gated shared expert",
        ),
        FamilyInfo(
            name="qwen3_moe",
            model_types=("qwen3_moe",),
            factory="zllm_model_llama.family:Qwen3MoeFamily",
            gguf_architectures={"qwen3moe": GGUF_ARCHITECTURES["qwen3moe"]},
            description="Qwen3-MoE: Qwen3 layers (q/k RMSNorm) with a MoE FFN",
        ),
    ]
