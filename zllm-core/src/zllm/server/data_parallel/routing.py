"""Which replica serves a request: the one holding the conversation's prefix when the load
allows, else the least loaded one.

The policy is SGLang's cache-aware router (sgl-router, ``cache_aware`` policy) reduced to what
a front end that does not tokenize can know:

* **Load** of a replica is the tokens its in-flight requests may still occupy, queued or
  running: for each request the front end has sent it and not yet seen finish, an estimate
  of its prompt tokens plus the most tokens it may generate (:func:`request_cost`).
* **Prefix affinity.** Every routed request's text is cut into chunks (every
  :data:`CHUNK_CHARS` characters and at every message end) and the digest of each prefix up to
  a cut is remembered with the replica it went to, most recent first, in a bounded LRU
  (vLLM hashes KV blocks of a prefix the same way, chained, so a prefix's digest does not
  depend on what follows it). A conversation's follow-up turn repeats the earlier turns, so
  its longest remembered prefix names the replica whose prefix cache holds them.
* **Balance first.** The prefix replica is taken only when at least
  :data:`MIN_MATCH_RATIO` of the request's text is matched and that replica is not
  overloaded: its load exceeds the least loaded replica's by at most
  :data:`BALANCE_ABS_TOKENS` or by a factor of at most :data:`BALANCE_REL`. Otherwise the
  least loaded replica serves it (ties: round robin), so a shared system prompt cannot
  pile every conversation onto one replica.

Everything here runs on the front end's event loop thread; nothing is locked.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import attrs

CHUNK_CHARS = 64
"""Characters per prefix chunk (a message end also cuts one)."""

MIN_MATCH_RATIO = 0.25
"""Matched fraction of a request's text above which its prefix replica is preferred. A second
chat turn repeats the first (its system and user messages) and adds the answer and a new
message, so a quarter is met by any conversation whose earlier turns are not tiny."""

BALANCE_ABS_TOKENS = 1024
BALANCE_REL = 1.5
"""A prefix replica is overloaded when its load exceeds the least loaded replica's by more than
:data:`BALANCE_ABS_TOKENS` tokens *and* more than :data:`BALANCE_REL` times (SGLang's router
has the same two thresholds, counted in requests)."""

PREFIX_CAPACITY = 1 << 16
"""Prefix digests remembered (about 40 bytes each); the least recently used go first."""

BYTES_PER_TOKEN = 4
"""UTF-8 bytes per prompt token assumed by the load estimate (the usual average of a BPE
vocabulary on English text; the front end loads no tokenizer)."""


class NoReplicaError(Exception):
    """Every replica has exited: nothing can serve the request."""


@attrs.frozen
class Route:
    """Where one request went.

    Attributes:
        replica: the replica's index.
        reason: ``"prefix"`` (it holds the longest remembered prefix of the request),
            ``"load"`` (the least loaded replica) or ``"state"`` (:meth:`Router.pin`).
        cost_tokens: the load the request adds until :meth:`Router.release`.
        matched_chars: characters of the request's text found in the prefix index.
    """

    replica: int
    reason: str
    cost_tokens: int
    matched_chars: int = 0


def request_cost(text_bytes: int, max_new_tokens: int, choices: int = 1) -> int:
    """Tokens a request may occupy on its replica: ``choices`` sequences, each of a prompt of
    ``text_bytes`` UTF-8 bytes (:data:`BYTES_PER_TOKEN` per token, at least one) and at most
    ``max_new_tokens`` generated."""
    return max(choices, 1) * (max(1, -(-text_bytes // BYTES_PER_TOKEN)) + max(max_new_tokens, 0))


def prefix_digests(segments: Sequence[str]) -> Iterator[tuple[int, bytes]]:
    """``(end, digest)`` of each prefix of ``"".join(segments)`` that ends at a cut: every
    :data:`CHUNK_CHARS` characters from the start and at every segment's end, shortest first.

    A cut depends only on the text before it, so a text that extends another (a follow-up
    turn) yields the other's digests at the same ends.
    """
    h = hashlib.blake2b(digest_size=16)
    end = 0
    for segment in segments:
        start = 0
        while start < len(segment):
            step = min(CHUNK_CHARS - end % CHUNK_CHARS, len(segment) - start)
            h.update(segment[start:start + step].encode("utf-8", "surrogatepass"))
            start += step
            end += step
            if end % CHUNK_CHARS == 0 or start == len(segment):
                yield end, h.copy().digest()
        h.update(b"\x00")  # a segment boundary is part of the text: "ab"+"c" is not "a"+"bc"


class PrefixIndex:
    """Prefix digests of routed requests → the replica each went to (an LRU of at most
    ``capacity`` digests)."""

    def __init__(self, capacity: int = PREFIX_CAPACITY):
        self._replica_of: OrderedDict[bytes, int] = OrderedDict()
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._replica_of)

    def longest(self, digests: Sequence[tuple[int, bytes]], alive: Sequence[bool]) -> tuple[int | None, int]:
        """The live replica holding the longest of ``digests`` and that prefix's length in
        characters; ``(None, 0)`` when none is remembered."""
        for end, digest in reversed(digests):
            replica = self._replica_of.get(digest)
            if replica is not None and alive[replica]:
                return replica, end
        return None, 0

    def remember(self, digests: Sequence[tuple[int, bytes]], replica: int) -> None:
        """Record that ``replica`` now holds every prefix in ``digests``."""
        for _, digest in digests:
            self._replica_of[digest] = replica
            self._replica_of.move_to_end(digest)
        while len(self._replica_of) > self._capacity:
            self._replica_of.popitem(last=False)


class Router:
    """Load and prefix bookkeeping for ``replicas`` replicas (see the module docstring).

    Attributes:
        alive: per replica, whether it is in rotation.
        load_tokens: per replica, the summed ``cost_tokens`` of its requests in flight.
        in_flight: per replica, how many requests it is serving for the front end.
    """

    def __init__(self, replicas: int, prefix_capacity: int = PREFIX_CAPACITY):
        if replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {replicas}")
        self.alive = [True] * replicas
        self.load_tokens = [0] * replicas
        self.in_flight = [0] * replicas
        self.prefixes = PrefixIndex(prefix_capacity)
        self._turn = 0

    def least_loaded(self) -> int:
        """The live replica with the least load (ties: fewest requests, then the next in turn
        after the last chosen, so idle replicas share sequential traffic).

        Raises:
            NoReplicaError: no replica is alive.
        """
        live = [i for i, up in enumerate(self.alive) if up]
        if not live:
            raise NoReplicaError(f"all {len(self.alive)} replicas have exited")
        n = len(self.alive)
        return min(live, key=lambda i: (self.load_tokens[i], self.in_flight[i], (i - self._turn) % n))

    def choose(self, segments: Sequence[str], cost_tokens: int) -> Route:
        """Pick the replica for a request whose text is ``segments`` (messages in order, see
        :mod:`zllm.server.data_parallel.request_text`) and count it in flight there.

        Raises:
            NoReplicaError: no replica is alive.
        """
        least = self.least_loaded()
        digests = list(prefix_digests(segments))
        total = digests[-1][0] if digests else 0
        replica, matched = self.prefixes.longest(digests, self.alive)
        if replica is not None and matched >= MIN_MATCH_RATIO * total and not self._overloaded(replica, least):
            route = Route(replica, "prefix", cost_tokens, matched)
        else:
            route = Route(least, "load", cost_tokens)
        if digests:
            self.prefixes.remember(digests, route.replica)
        return self._count(route)

    def pin(self, replica: int, cost_tokens: int) -> Route:
        """Count a request in flight on ``replica``, which it must go to (it holds state the
        request refers to, e.g. a stored response)."""
        return self._count(Route(replica, "state", cost_tokens))

    def release(self, route: Route) -> None:
        """The request routed by ``route`` has finished (or failed)."""
        self.load_tokens[route.replica] -= route.cost_tokens
        self.in_flight[route.replica] -= 1

    def take_out(self, replica: int) -> None:
        """Stop routing to ``replica`` (its process has exited)."""
        self.alive[replica] = False

    def _count(self, route: Route) -> Route:
        self.load_tokens[route.replica] += route.cost_tokens
        self.in_flight[route.replica] += 1
        self._turn = (route.replica + 1) % len(self.alive)
        return route

    def _overloaded(self, replica: int, least: int) -> bool:
        load, low = self.load_tokens[replica], self.load_tokens[least]
        return load - low > BALANCE_ABS_TOKENS and load > BALANCE_REL * low
