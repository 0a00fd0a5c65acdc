"""Requests run at once against one engine, as concurrent clients would send them."""

from __future__ import annotations

import threading


def run_together(engine, reqs: list[dict]) -> list[list[int]]:
    """Each request's generated token ids, all requests streamed at once: one thread per
    request, all released together by a barrier, each driving ``generate_stream``; an
    exception in any thread is raised here."""
    results: list[list[int] | BaseException] = [[] for _ in reqs]
    start = threading.Barrier(len(reqs))

    def drive(i: int) -> None:
        try:
            start.wait()
            tokens: list[int] = []
            for event in engine.generate_stream(reqs[i]):
                tokens += event.get("token_ids", [])
            results[i] = tokens
        except BaseException as exc:  # surfaced below, in the test's thread
            results[i] = exc

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]
