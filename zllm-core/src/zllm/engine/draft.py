"""Loading the draft model of ``speculative.method: draft`` (:mod:`zllm.runtime.draft`).

The draft goes through the same load pipeline as the target
(:func:`zllm.engine.loader.load_model`), on the target's backend, with a paged KV cache of
its own: the target's blocks plus each running sequence's lookahead. Before any of its
weights is read it must agree with the target on what a token id means and reach as far:
its token table must hold the target's, id for id (llama.cpp's
``common_speculative_are_compatible`` compares token texts the same way; padded vocabulary
sizes may differ), and its context window must not be shorter than the target's.
"""

from __future__ import annotations

import math
from typing import cast

import attrs

from zllm.domain.family import Model, model_kv_spec
from zllm.engine.loader import LoadedModel, kv_cache_dtype, load_model, resolve_family
from zllm.plugins.host import PluginHost
from zllm.runtime.draft import DraftProposer
from zllm.runtime.kv_cache import PagedKVCache
from zllm.runtime.runner import ModelRunner
from zllm.spec.config import ModelConfig
from zllm.spec.errors import ConfigError
from zllm.tokenizer import Tokenizer
from zllm.weights import open_checkpoint

DRAFT_PATH = "speculative.draft.model.path"


def check_same_tokens(target: Tokenizer, draft: Tokenizer, target_path: str, draft_path: str) -> None:
    """Require ``draft``'s token table to cover ``target``'s: the same text at every id of
    the target's vocabulary.

    Raises:
        ConfigError: (``speculative.draft.model.path``) the draft's vocabulary is smaller, or
            the first id whose text differs; names both checkpoints.
    """
    both = f"draft {draft_path} vs target {target_path}"
    if draft.vocab_size < target.vocab_size:
        raise ConfigError(DRAFT_PATH, f"the draft's tokenizer has {draft.vocab_size} tokens, fewer than the "
                                      f"target's {target.vocab_size}; a draft needs the target's tokenizer ({both})")
    for i in range(target.vocab_size):
        mine, theirs = draft.id_to_token(i), target.id_to_token(i)
        if mine != theirs:
            raise ConfigError(DRAFT_PATH, f"the draft's tokenizer differs from the target's at token id {i} "
                                          f"({mine!r} vs {theirs!r}); a draft needs the target's tokenizer ({both})")


def load_draft(target: LoadedModel, host: PluginHost, sample_width: int) -> DraftProposer:
    """The draft proposer of ``target.config.speculative.draft``.

    Args:
        target: the loaded target model.
        host: the plugin host the target was loaded with.
        sample_width: logits columns the target samples from; the draft proposes among them.

    Raises:
        ConfigError: (``speculative.draft.model.path``) a different tokenizer, a shorter
            context window or fewer logits columns than the target samples from; and what
            :func:`~zllm.engine.loader.load_model` raises for the draft checkpoint.
    """
    cfg = target.config
    draft = cfg.speculative.draft.model
    assert draft is not None  # the config contract requires it for method: draft
    ckpt = open_checkpoint(draft.path, draft.format, gguf_maps=host.gguf_maps)
    spec = resolve_family(host, ckpt).load().parse_config(ckpt.config, str(ckpt.path))
    check_same_tokens(target.tokenizer, ckpt.load_tokenizer(), str(target.checkpoint.path), str(ckpt.path))
    if spec.context_length < target.context_length:
        raise ConfigError(DRAFT_PATH, f"the draft {ckpt.path} has a context window of {spec.context_length} tokens, "
                                      f"shorter than the target's {target.context_length}; set "
                                      f"runtime.context_length to at most {spec.context_length}")
    # The target's blocks plus each running sequence's lookahead and a partial block: the draft
    # holds what the target's running sequences hold, never a prefix cache.
    block_size = cfg.runtime.kv_cache.block_size
    per_seq = math.ceil(cfg.speculative.num_tokens / block_size) + 1
    num_blocks = target.kv_num_blocks + cfg.runtime.max_num_seqs * per_seq
    runtime = attrs.evolve(cfg.runtime, context_length=target.context_length,
                           kv_cache=attrs.evolve(cfg.runtime.kv_cache, num_blocks=num_blocks))
    loaded = load_model(attrs.evolve(cfg, model=ModelConfig(draft.path, draft.format, draft.dtype), runtime=runtime,
                                     backend=attrs.evolve(cfg.backend, name=target.backend_choice.info.name)), host)
    model = cast(Model, loaded.model)
    if model.vocab_size < sample_width:
        raise ConfigError(DRAFT_PATH, f"the draft {ckpt.path} computes {model.vocab_size} logits, fewer than "
                                      f"the {sample_width} tokens the target samples from")
    kv = PagedKVCache(model_kv_spec(loaded.model), loaded.kv_num_blocks, block_size,
                      dtype=kv_cache_dtype(cfg), device=loaded.backend.device, eviction_lag=cfg.speculative.num_tokens)
    return DraftProposer(ModelRunner(loaded.model, loaded.ops, kv, loaded.backend.device,
                                     cfg.runtime.batch_invariant, sample_width))
