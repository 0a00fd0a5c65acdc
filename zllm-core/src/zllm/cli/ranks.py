"""Where ``zllm run`` and ``zllm serve`` meet torchrun: rank 0 builds the engine, every
other rank serves its shard of the steps (``docs/parallel.md``)."""

from __future__ import annotations

import os
from typing import Any

from zllm.spec.config import ZllmConfig


def is_rank_zero() -> bool:
    """False in a torchrun worker whose ``RANK`` is not 0 (it serves no HTTP and prints nothing)."""
    return os.environ.get("RANK", "0") == "0"


def start_engine(cfg: ZllmConfig, **kwargs: Any) -> Any:
    """Rank 0 (or a single process): the :class:`zllm.Engine` for ``cfg``. Any other
    torchrun rank: run its shard until rank 0 stops the job, then return None.

    Raises:
        ZllmError subclasses: as :meth:`zllm.Engine.from_config` and
            :func:`zllm.engine.worker.run_worker`.
    """
    from zllm.engine.distributed import launch_from_env

    launch = launch_from_env(os.environ)  # the environment is read here, at the edge
    if launch is not None and launch.world_size == 1 and cfg.parallel.world_size == 1:
        launch = None
    if launch is not None and launch.rank != 0:
        from zllm.engine.worker import run_worker

        run_worker(cfg, launch)
        return None
    from zllm.engine.engine import Engine

    return Engine.from_config(cfg, launch=launch, **kwargs)
