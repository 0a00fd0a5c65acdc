"""Pace an engine's loop thread from a test, so what the test observes between steps is
deterministic: each runtime step waits for a permit the test grants."""

from __future__ import annotations

import threading


class StepGate:
    """While open (``with StepGate(engine) as gate:``), every ``engine.llm.step`` waits for a
    permit from :meth:`steps`. Meanwhile the loop keeps handling its commands (submits,
    aborts, calls, close), so a test may submit or close streams between two steps."""

    def __init__(self, engine):
        self._engine = engine
        self._real_step = engine.llm.step
        self._permits = threading.Semaphore(0)
        self._done = threading.Semaphore(0)

    def __enter__(self) -> StepGate:
        self._engine.llm.step = self._gated_step
        return self

    def __exit__(self, *exc_info) -> None:
        del self._engine.llm.step  # the real method again; let a step already waiting run
        self._permits.release(1)

    def _gated_step(self):
        loop = self._engine.loop
        while not self._permits.acquire(timeout=0.002):
            if not loop._take_commands(block=False):
                return []  # closed while waiting: nothing runs any more
        try:
            return self._real_step()
        finally:
            self._done.release()

    def steps(self, n: int = 1) -> None:
        """Let ``n`` steps run and return once they have."""
        self._permits.release(n)
        for _ in range(n):
            assert self._done.acquire(timeout=120), "the engine loop did not step"
