"""Several processes, one model: starting the ranks, joining their process group, and the
step protocol between rank 0 and the others (torch.distributed; gloo on a CPU, NCCL on CUDA
and ROCm — the backend names it).

Rank 0 owns the engine: its loop, scheduler, KV block allocator and sampler. Each step it
broadcasts the step's packed metadata (token ids, positions, KV slots, logits rows, block
table, query and context lengths) — :class:`DriverModel` — and every rank runs the same
forward on its shards (:func:`run_worker` on the others). The token rank 0 samples reaches
the others as the next step's token ids. The other ranks keep KV tensors for their own heads
only, addressed by rank 0's block ids, so aborting a request on rank 0 frees its blocks on
every rank.

Two ways to start (``docs/parallel.md``): ``torchrun --nproc-per-node N -m zllm serve ...``
(every rank a torchrun worker; :func:`launch_from_env` reads torchrun's variables), or a
plain ``zllm serve`` whose rank 0 spawns ranks ``1..N-1`` on this node itself
(:func:`spawn_workers`).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist

from zllm.capabilities.ops import AttentionMetadata
from zllm.capabilities.parallel import ParallelContext
from zllm.spec.config import ZllmConfig, config_from_dict, config_to_dict
from zllm.spec.errors import ConfigError, PluginError

log = logging.getLogger(__name__)

_STOP = -1  # a header's token count that tells the other ranks to leave their loop
_IDLE = -2  # a header's token count that only says rank 0 is alive and idle


@attrs.frozen
class Launch:
    """Where this process sits among the ranks of one engine, read once at the edge.

    Attributes:
        rank, world_size: this process's rank and the number of ranks.
        local_rank, local_world_size: the same on this node (device index, share of cores).
        init_method: torch.distributed's rendezvous: ``env://`` under torchrun, or
            ``tcp://127.0.0.1:PORT`` for self-spawned ranks.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    init_method: str


def launch_from_env(environ: Mapping[str, str]) -> Launch | None:
    """The launch torchrun describes in ``environ`` (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), or None outside torchrun.

    Raises:
        ConfigError: (``parallel``) a variable is not an int.
    """
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local_rank = int(environ.get("LOCAL_RANK", rank))
        local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError as exc:
        raise ConfigError("parallel", f"torchrun's environment is not readable: {exc}") from None
    return Launch(rank, world, local_rank, local_world, "env://")


def check_launch(cfg: ZllmConfig, launch: Launch) -> None:
    """Refuse a launch whose number of processes differs from the config's.

    Raises:
        ConfigError: (``parallel.tensor``) names both numbers.
    """
    if launch.world_size != cfg.parallel.world_size:
        raise ConfigError("parallel.tensor", f"parallel.tensor {cfg.parallel.tensor} x parallel.pipeline "
                                             f"{cfg.parallel.pipeline} needs {cfg.parallel.world_size} processes, "
                                             f"but {launch.world_size} were started (torchrun --nproc-per-node)")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def per_rank_config(cfg: ZllmConfig, launch: Launch) -> ZllmConfig:
    """``cfg`` with ``backend.threads`` resolved to this rank's share of the node's cores
    when the config leaves it to the machine (ranks on one node never all take every core)."""
    if cfg.backend.threads is not None:
        return cfg
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // launch.local_world_size)
    return attrs.evolve(cfg, backend=attrs.evolve(cfg.backend, threads=threads))


def join_group(backend: object, backend_name: str, launch: Launch, timeout_s: float,
               tensor: int) -> ParallelContext:
    """Join the ranks' process group over the backend's collectives; blocks until every
    rank joined or ``timeout_s`` (``parallel.startup_timeout_s``) passed, which also bounds
    the collectives until :func:`agree_num_blocks` (the ranks load their shards in between).
    Ranks are numbered stage-major (``tensor`` ranks per pipeline stage); each stage's ranks
    get their own tensor-parallel group.

    Raises:
        PluginError: the backend declares no ``process_group_backend`` (it provides no collectives).
        ConfigError: (``parallel.startup_timeout_s``) the other ranks did not join in time (a
            rank that could not start or cannot reach the rendezvous).
    """
    pg_backend = getattr(backend, "process_group_backend", None)
    if not isinstance(pg_backend, str):
        raise PluginError(f"backend {backend_name!r} provides no collectives (no process_group_backend), so it "
                          f"cannot run parallel.tensor > 1")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(pg_backend, init_method=launch.init_method, rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
    except (RuntimeError, ValueError) as exc:  # torch reports a failed rendezvous as either
        raise ConfigError("parallel.startup_timeout_s", f"rank {launch.rank} could not join the other "
                                                f"{launch.world_size - 1} rank(s) at {launch.init_method} within "
                                                f"{timeout_s:g} s: {exc}") from None
    stages = launch.world_size // tensor
    group = None
    if tensor > 1:
        group = dist.group.WORLD
        if stages > 1:
            # Every rank creates every group, in the same order (torch.distributed's rule).
            groups = [dist.new_group(list(range(s * tensor, (s + 1) * tensor)), timeout=timeout)
                      for s in range(stages)]
            group = groups[launch.rank // tensor]
    return ParallelContext(launch.rank % tensor, tensor, group, launch.rank // tensor, stages)


@attrs.frozen
class MicroBatch:
    """One micro-batch of a step: the rows ``rows`` of the flattened batch (whole sequences
    ``seqs``), with its own attention metadata and logits rows (relative to ``rows``)."""

    rows: slice
    seqs: slice
    meta: AttentionMetadata
    logits_indices: torch.Tensor


def micro_batches(meta: AttentionMetadata, logits_indices: torch.Tensor, count: int) -> list[MicroBatch]:
    """Split a step into at most ``count`` micro-batches of whole sequences, each with about
    the same number of tokens; every rank splits the same step the same way.

    ``logits_indices`` must be ascending (rows in batch order), so the micro-batches' logits,
    concatenated, are the step's.
    """
    lens = meta.query_lens
    total, count = sum(lens), max(1, min(count, len(lens)))
    bounds, acc = [0], 0
    for s, n in enumerate(lens[:-1]):
        acc += n
        if acc * count >= total * len(bounds) and len(bounds) < count:
            bounds.append(s + 1)
    bounds.append(len(lens))
    rows = [0, *itertools.accumulate(lens)]
    idx = logits_indices.tolist()
    assert idx == sorted(idx), "micro-batches need logits rows in batch order"
    out = []
    for a, b in itertools.pairwise(bounds):
        first, end = rows[a], rows[b]
        mine = [i - first for i in idx if first <= i < end]
        out.append(MicroBatch(
            slice(first, end), slice(a, b),
            AttentionMetadata(slot_mapping=meta.slot_mapping[first:end], block_tables=meta.block_tables[a:b],
                              query_lens=lens[a:b], context_lens=meta.context_lens[a:b], scale=meta.scale),
            torch.tensor(mine, dtype=torch.int64, device=logits_indices.device),
        ))
    return out


class PipelineModel:
    """One pipeline stage of a model: every rank of a ``parallel.pipeline`` > 1 job runs its
    ``forward`` on every step (rank 0 through :class:`DriverModel`).

    The step is split into up to ``pp_size`` micro-batches of whole sequences; for each, a
    stage after the first receives the previous stage's hidden state and residual (f32
    ``[T, C]`` each), runs its layers and sends them on without waiting for the receiver
    (``isend``), so stage ``k`` computes micro-batch ``i + 1`` while stage ``k + 1`` computes
    micro-batch ``i``. The last stage's tensor-parallel rank 0 sends each micro-batch's
    logits to rank 0, which returns them concatenated; other ranks return None.
    """

    def __init__(self, model: Any, parallel: ParallelContext, device: torch.device):
        self._model, self._par, self._device = model, parallel, device

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, ...]], logits_indices: torch.Tensor) -> torch.Tensor | None:
        """The step's logits f32 ``[S', V]`` on rank 0, None elsewhere."""
        par, model = self._par, self._model
        width = model.hidden_size
        assert par.pp_size > 1, "one stage runs the model itself"
        pending = []
        sent: list[torch.Tensor] = []  # kept alive until their sends complete
        logits = []
        batches = micro_batches(meta, logits_indices, par.pp_size)
        for mb in batches:
            t = mb.rows.stop - mb.rows.start
            hidden = None
            if not par.first_stage:
                hidden = (torch.empty(t, width, device=self._device), torch.empty(t, width, device=self._device))
                for h in hidden:
                    dist.recv(h, src=par.stage_rank(par.pp_rank - 1))
            out = model.forward(token_ids[mb.rows], positions[mb.rows], mb.meta, kv_caches, mb.logits_indices,
                                hidden=hidden)
            if not par.last_stage:
                sent += [h.contiguous() for h in out]
                pending += [dist.isend(h, dst=par.stage_rank(par.pp_rank + 1)) for h in sent[-2:]]
            elif par.tp_rank == 0 and out.shape[0]:  # rank 0 knows which micro-batches have no logits rows
                sent.append(out.contiguous())
                pending.append(dist.isend(sent[-1], dst=0))
        if dist.get_rank() == 0:
            last = par.pp_size - 1
            for mb in batches:
                part = torch.empty(mb.logits_indices.shape[0], model.vocab_size, device=self._device)
                if part.shape[0]:
                    dist.recv(part, src=last * par.tp_size)
                logits.append(part)
        for work in pending:
            if work is not None:  # None: torch completed the send already
                work.wait()
        if dist.get_rank() != 0:
            return None
        return torch.cat(logits)


class DriverModel:
    """Rank 0's model: each ``forward`` first broadcasts the step to the other ranks, then
    runs this rank's shard (the others run theirs in :func:`run_worker`). Attributes other
    than ``forward`` are the wrapped model's."""

    def __init__(self, model: Any, device: torch.device, on_error: Callable[[str], None] | None = None):
        """``on_error``: told (a message) when a collective fails, before the error propagates."""
        self._model, self._device, self._on_error = model, device, on_error
        # One caller of the collectives at a time: the engine loop's steps and the idle beats.
        self._lock = threading.Lock()
        self._stopped = False
        self.last_sent = time.monotonic()
        """When rank 0 last sent the other ranks a header (``time.monotonic()``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, ...]], logits_indices: torch.Tensor) -> torch.Tensor:
        """As the wrapped model's ``forward``; the other ranks compute the same step.

        Raises:
            RuntimeError: from torch.distributed: another rank died (its connection closed) or
                did not answer within ``parallel.timeout_s`` (hung).
        """
        try:
            with self._lock:
                self.last_sent = time.monotonic()
                return self._step(token_ids, positions, meta, kv_caches, logits_indices)
        except RuntimeError as exc:
            if self._on_error is not None:
                self._on_error(f"a collective with the other ranks failed ({exc}); a rank died or hung")
            raise

    def _step(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              kv_caches: list[tuple[torch.Tensor, ...]], logits_indices: torch.Tensor) -> torch.Tensor:
        s, width = meta.block_tables.shape
        header = torch.tensor([token_ids.shape[0], logits_indices.shape[0], s, width], dtype=torch.int64)
        lens = torch.tensor(meta.query_lens + meta.context_lens, dtype=torch.int64, device=token_ids.device)
        payload = torch.cat([token_ids, positions, meta.slot_mapping, logits_indices, meta.block_tables.reshape(-1),
                             lens])
        dist.broadcast(header.to(self._device), src=0)
        dist.broadcast(payload, src=0)
        return self._model.forward(token_ids, positions, meta, kv_caches, logits_indices)

    def stop_workers(self) -> None:
        """Tell the other ranks to leave their step loop (they exit 0)."""
        with self._lock:
            self._stopped = True
            dist.broadcast(torch.tensor([_STOP, 0, 0, 0], dtype=torch.int64, device=self._device), src=0)

    def beat_if_idle(self, idle_s: float) -> None:
        """Send the other ranks an idle header when no step went out for ``idle_s`` seconds:
        they wait for each header no longer than ``parallel.timeout_s``, and an idle engine
        runs no steps."""
        with self._lock:
            if self._stopped or time.monotonic() - self.last_sent < idle_s:
                return
            self.last_sent = time.monotonic()
            dist.broadcast(torch.tensor([_IDLE, 0, 0, 0], dtype=torch.int64, device=self._device), src=0)


def serve_steps(model: Any, kv_layers: list[Any], device: torch.device, scale: float) -> None:
    """A non-zero rank's loop: receive each step rank 0 broadcasts and run this rank's shard
    of it, until rank 0 says stop.

    Raises:
        RuntimeError: from torch.distributed, when rank 0 or another rank died or the
            process-group timeout passed.
    """
    header = torch.empty(4, dtype=torch.int64, device=device)
    while True:
        dist.broadcast(header, src=0)
        t, r, s, width = header.tolist()
        if t == _STOP:
            return
        if t == _IDLE:
            continue
        payload = torch.empty(3 * t + r + s * width + 2 * s, dtype=torch.int64, device=device)
        dist.broadcast(payload, src=0)
        lens = payload[3 * t + r + s * width:].tolist()
        meta = AttentionMetadata(slot_mapping=payload[2 * t: 3 * t],
                                 block_tables=payload[3 * t + r: 3 * t + r + s * width].view(s, width),
                                 query_lens=tuple(lens[:s]), context_lens=tuple(lens[s:]), scale=scale)
        with torch.inference_mode():
            model.forward(payload[:t], payload[t: 2 * t], meta, kv_layers, payload[3 * t: 3 * t + r])


HEARTBEAT_S = 0.5
"""Seconds between a rank's heartbeats in the process group's store (:func:`start_heartbeat`)."""


def _store() -> Any:
    # The key-value store the ranks met through (torchrun's agent store, or rank 0's TCPStore for
    # self-spawned ranks); torch exposes it only through this accessor.
    return dist.distributed_c10d._get_default_store()


def start_heartbeat(rank: int) -> threading.Event:
    """Bump key ``zllm/heartbeat/<rank>`` in the store every :data:`HEARTBEAT_S` from a daemon
    thread, so rank 0 can name a rank that died or hung (:func:`silent_ranks`); set the
    returned event to stop."""
    stop = threading.Event()
    store = _store()

    def beat() -> None:
        n = 0
        while not stop.wait(HEARTBEAT_S):
            n += 1
            try:
                store.set(f"zllm/heartbeat/{rank}", str(n))
            except Exception:  # noqa: BLE001 - the store is gone with the job; nothing left to tell
                return

    threading.Thread(target=beat, name="zllm-heartbeat", daemon=True).start()
    return stop


def silent_ranks(world_size: int) -> list[int]:
    """Ranks ``1..world_size-1`` whose heartbeat did not move over four beats (dead or hung);
    compares each rank's own counter, so clocks of other nodes do not matter. Takes
    ``4 * HEARTBEAT_S`` seconds; [] when the store cannot be read."""
    try:
        store = _store()
        keys = {r: f"zllm/heartbeat/{r}" for r in range(1, world_size)}
        first = {r: store.get(k) if store.check([k]) else None for r, k in keys.items()}
        time.sleep(4 * HEARTBEAT_S)
        return [r for r, k in keys.items() if (store.get(k) if store.check([k]) else None) == first[r]]
    except Exception:  # noqa: BLE001 - a store that is gone names nobody; the caller reports the error itself
        return []


def agree_num_blocks(num_blocks: int, device: torch.device, parallel: ParallelContext, step_timeout_s: float) -> int:
    """The fewest KV blocks any rank can hold (each sized its cache from its own memory).

    The last collective of the start (every rank has loaded its shards when it completes):
    from then on the collectives of ``parallel``'s groups wait at most ``step_timeout_s``
    (``parallel.timeout_s``) instead of the start's bound."""
    n = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    step = datetime.timedelta(seconds=step_timeout_s)
    # torch sets a group's timeout only when it is created, or through this accessor.
    dist.distributed_c10d._set_pg_timeout(step)
    if parallel.group is not None and parallel.group is not dist.group.WORLD:
        dist.distributed_c10d._set_pg_timeout(step, parallel.group)
    return int(n.item())


def spawn_workers(cfg: ZllmConfig) -> tuple[Launch, list[multiprocessing.process.BaseProcess]]:
    """Start ranks ``1..N-1`` of ``cfg.parallel`` on this node (fresh interpreters: the
    ``spawn`` start method), returning rank 0's launch and the processes to reap."""
    world = cfg.parallel.world_size
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    procs: list[multiprocessing.process.BaseProcess] = []
    for rank in range(1, world):
        launch = Launch(rank, world, rank, world, init)
        proc = ctx.Process(target=_spawned_worker, args=(config_to_dict(cfg), launch), name=f"zllm-rank-{rank}")
        proc.start()
        procs.append(proc)
    return Launch(0, world, 0, world, init), procs


class RankGroup:
    """Rank 0's hold on the other ranks: the :class:`DriverModel` that feeds them each step,
    the processes it spawned (none under torchrun), and a watchdog over those processes.

    The watchdog notices a spawned rank that exits while the engine runs; rank 0's own
    collectives fail with torch's error when a rank dies (peer closed) or hangs
    (``parallel.timeout_s``), so a dead or hung rank never hangs the engine: the step raises,
    the engine loop ends every live request with an error (the server answers 503). Either
    way :meth:`fail` logs the first failure, naming the rank and its exit code where a
    spawned one exited, and calls ``on_failure`` (``zllm serve`` then stops and exits
    non-zero).
    """

    def __init__(self, model: Any, device: torch.device, procs: list[multiprocessing.process.BaseProcess],
                 timeout_s: float = 60.0):
        """``timeout_s``: ``parallel.timeout_s``, how long the other ranks wait for each header;
        an idle rank 0 sends one every quarter of it."""
        self.driver = DriverModel(model, device, on_error=self.fail)
        self.procs = procs
        self.failure: str | None = None
        """The first failure seen (a message naming the rank where it is known), or None."""
        self.on_failure: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="zllm-rank-watchdog", daemon=True)
        if procs:
            self._watchdog.start()
        self._beat_s = timeout_s / 4
        threading.Thread(target=self._keep_alive, name="zllm-rank-keepalive", daemon=True).start()

    def _keep_alive(self) -> None:
        while not self._closing.wait(self._beat_s / 2) and self.failure is None:
            try:
                self.driver.beat_if_idle(self._beat_s)
            except RuntimeError as exc:
                self.fail(f"a collective with the other ranks failed ({exc}); a rank died or hung")
                return

    def _watch(self) -> None:
        while not self._closing.wait(0.2):
            exited = self._exited()
            if exited:
                self.fail(exited)
                return

    def _exited(self) -> str | None:
        """Which spawned rank has exited, and how, or None."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                return f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def _culprit(self, message: str) -> str:
        """``message`` naming the failed rank: a spawned one that exited, else those whose
        heartbeat stopped (torchrun's ranks; a hung one)."""
        exited = self._exited()
        if exited is not None:
            return exited
        silent = silent_ranks(dist.get_world_size()) if dist.is_initialized() else []
        if silent:
            names = ", ".join(map(str, silent))
            return f"rank {names} stopped answering (no heartbeat for {4 * HEARTBEAT_S:g} s): {message}"
        return message

    def fail(self, message: str) -> None:
        """Record and report the first failure (later ones are consequences): a spawned rank
        found exited is named even when a failed collective reported first."""
        if self.procs and self._exited() is None:
            # A dying rank's connection closes before the OS reports its exit: wait a moment,
            # so the message names the rank rather than only the broken connection.
            time.sleep(0.5)
        culprit = self._culprit(message)
        with self._lock:
            if self.failure is not None:
                return
            self.failure = culprit
        log.error("zllm: %s; the engine cannot run without it", self.failure)
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def close(self) -> None:
        """Stop the other ranks (they leave their loop and exit 0), reap spawned ones, and
        leave the process group; a rank found gone is recorded in :attr:`failure`. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.failure is None and dist.is_initialized():
            try:
                self.driver.stop_workers()
            except RuntimeError as exc:  # a rank already gone (torchrun stops every rank when one fails)
                culprit = self._culprit(f"could not stop the other ranks ({exc}); a rank died or hung")
                with self._lock:
                    self.failure = culprit
                log.error("zllm: %s", self.failure)
        # A failed job's ranks may be hung (a stopped process never exits): do not wait long.
        self.reap(self.procs, timeout_s=10.0 if self.failure is None else 1.0)
        if dist.is_initialized():
            dist.destroy_process_group()

    @staticmethod
    def reap(procs: list[multiprocessing.process.BaseProcess], timeout_s: float = 10.0) -> None:
        """Wait for spawned ranks to exit, killing those still running after ``timeout_s``."""
        for proc in procs:
            proc.join(timeout_s)
            if proc.exitcode is None:
                proc.kill()
                proc.join()


def _spawned_worker(cfg_dict: dict[str, Any], launch: Launch) -> None:
    """Entry point of a self-spawned rank (runs in a fresh interpreter)."""
    from zllm.engine.worker import run_worker  # the loader sits above this module's imports

    run_worker(config_from_dict(cfg_dict), launch)
