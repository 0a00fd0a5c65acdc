"""Weights: safetensors and GGUF files → tensors under canonical (HF) names. Knows no model.

Public API:

- :func:`open_checkpoint` → :class:`Checkpoint` (HF directory or GGUF file);
- :func:`load_weights` checks a checkpoint against a model's ``TensorSpec`` s and loads it;
- :func:`parameter_count`, :func:`build_model_card`;
- :mod:`zllm.weights.formats`: format names and :class:`QuantizedTensor`.
"""

from zllm.weights.card import build_model_card
from zllm.weights.checkpoint import Checkpoint, open_checkpoint
from zllm.weights.formats import QuantizedTensor
from zllm.weights.loading import load_weights, parameter_count

__all__ = ["Checkpoint", "QuantizedTensor", "build_model_card", "load_weights", "open_checkpoint", "parameter_count"]
