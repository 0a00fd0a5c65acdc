"""``zllm serve``: the HTTP server (OpenAI and Anthropic APIs) under uvicorn; exits 0 after a
graceful stop (SIGTERM or SIGINT, see :mod:`zllm.server.uvicorn_server`)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

import attrs

from zllm.spec.config import ZllmConfig, load_config
from zllm.spec.errors import ConfigError

EXIT_RANK_FAILED = 3
"""``zllm serve``'s exit status when a rank of a parallel engine died or hung (2 is a user error)."""


def _check_can_listen(host: str, port: int) -> None:
    """Fail before loading the model (which can take minutes) if the address is taken."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise ConfigError("server.port", f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def cmd_serve(args: argparse.Namespace) -> int:
    # Check the config (and the overrides) before importing torch and the server.
    cfg = load_config(args.config)
    server = cfg.server
    if args.host is not None or args.port is not None:
        server = attrs.evolve(server, host=args.host or server.host,
                              port=args.port if args.port is not None else server.port)
        cfg = attrs.evolve(cfg, server=server)
    if cfg.parallel.data > 1:
        return _serve_data_parallel(cfg, args)
    from zllm.cli.ranks import is_rank_zero, start_engine

    if is_rank_zero():
        _check_can_listen(server.host, server.port)
    from zllm.server import create_app, served_model_name
    from zllm.server.uvicorn_server import serve

    engine = start_engine(cfg)
    if engine is None:  # a torchrun rank other than 0: it served its shard until rank 0 stopped
        return 0
    if engine.ranks is not None:
        # A rank that died or hung: the requests in flight were answered 503; stop serving
        # (gracefully, as on SIGTERM) and exit non-zero below, naming the rank.
        engine.ranks.on_failure = lambda _message: os.kill(os.getpid(), signal.SIGTERM)
    app = create_app(engine)
    print(f"zllm: serving {served_model_name(engine)!r} on http://{server.host}:{server.port}", file=sys.stderr,
          flush=True)
    serve(app, server.host, server.port, log_level=args.log_level, access_log=args.access_log)
    engine.close()  # stops the other ranks, or finds one gone
    if engine.ranks is not None and engine.ranks.failure is not None:
        print(f"error: {engine.ranks.failure}; zllm serve stopped", file=sys.stderr, flush=True)
        return EXIT_RANK_FAILED
    return 0


def _serve_data_parallel(cfg: ZllmConfig, args: argparse.Namespace) -> int:
    """``parallel.data`` > 1: start the replicas, then serve the front end
    (:mod:`zllm.server.data_parallel`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # the environment is read here, at the edge
        raise ConfigError("parallel.data", f"parallel.data: {cfg.parallel.data} starts its replicas itself (each "
                          "starting its own tensor x pipeline ranks); run zllm serve without torchrun")
    _check_can_listen(cfg.server.host, cfg.server.port)
    from zllm.server.data_parallel.replicas import ReplicaSet

    replica_set = ReplicaSet(cfg, args.log_level)
    try:
        # Imported once the replicas are starting: this import takes seconds, and overlaps theirs.
        from zllm.server.data_parallel.serve import serve_data_parallel
    except BaseException:
        replica_set.stop()
        raise
    serve_data_parallel(cfg, replica_set, log_level=args.log_level, access_log=args.access_log)
    return 0
