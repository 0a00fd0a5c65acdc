"""A rank other than 0: load this rank's shard, then run every step rank 0 broadcasts
(:mod:`zllm.engine.distributed`)."""

from __future__ import annotations

import logging

import torch.distributed as dist

from zllm.domain.family import model_kv_spec
from zllm.engine.distributed import Launch, per_rank_config, serve_steps, start_heartbeat
from zllm.engine.engine import plugin_allowlist_from_env
from zllm.engine.loader import kv_cache_dtype, load_model
from zllm.plugins.host import PluginHost
from zllm.runtime.kv_cache import PagedKVCache
from zllm.spec.config import ZllmConfig

log = logging.getLogger(__name__)


def run_worker(cfg: ZllmConfig, launch: Launch, host: PluginHost | None = None) -> None:
    """Serve rank ``launch.rank`` until rank 0 stops the job.

    Raises:
        ZllmError subclasses: loading failed (as :func:`zllm.engine.loader.load_model`).
        RuntimeError: from torch.distributed when another rank died or a collective timed
            out (``parallel.timeout_s``; ``parallel.startup_timeout_s`` before the first step).
    """
    assert launch.rank != 0, "rank 0 runs the engine, not a worker"
    cfg = per_rank_config(cfg, launch)
    host = host or PluginHost(allowlist=plugin_allowlist_from_env())
    loaded = load_model(cfg, host, launch=launch)
    kv_spec = model_kv_spec(loaded.model)
    kv = PagedKVCache(kv_spec, loaded.kv_num_blocks, cfg.runtime.kv_cache.block_size, dtype=kv_cache_dtype(cfg),
                      device=loaded.backend.device)
    log.info("rank %d of %d: shard loaded in %.1f s, serving steps", launch.rank, launch.world_size,
             loaded.load_seconds)
    heartbeat = start_heartbeat(launch.rank)
    try:
        serve_steps(loaded.model, kv.layers, loaded.backend.device, kv_spec.attention_scale)
    finally:
        heartbeat.set()
        dist.destroy_process_group()
