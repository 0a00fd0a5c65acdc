"""Prometheus metrics for ``GET /metrics`` (prometheus-client, one registry per app).

=====================================  =========  ==========================================
metric                                 type       meaning
=====================================  =========  ==========================================
zllm_requests_total{route,status}      counter    HTTP requests answered, by route template
                                                  and status code
zllm_prompt_tokens_total               counter    prompt tokens of finished generations
zllm_generation_tokens_total           counter    tokens generated
zllm_time_to_first_token_seconds       histogram  request received -> first generated token
zllm_inter_token_latency_seconds       histogram  gap between consecutive generated tokens
zllm_num_requests_running              gauge      sequences in the running batch
zllm_num_requests_waiting              gauge      sequences queued for admission
zllm_kv_blocks_used / _free            gauge      KV cache blocks in use (running sequences
                                                  and the prefix cache) / free
zllm_kv_blocks_running                 gauge      blocks held by running sequences (the rest
                                                  of the used blocks is the prefix cache)
zllm_requests_expired_total{phase}     counter    requests the scheduler dropped at their
                                                  deadline, ``phase`` ``waiting`` (never
                                                  prefilled) or ``running`` (KV freed)
zllm_spec_proposed_tokens_total        counter    speculative proposals verified, by draft
  {position}                                      position (0 = the first proposed token);
                                                  only with ``speculative.method`` set
zllm_spec_accepted_tokens_total        counter    those the model accepted
  {position}
zllm_spec_acceptance_rate              gauge      accepted / proposed over all positions
=====================================  =========  ==========================================

Gauges, the expiry counter and the speculation metrics are read from the engine at scrape
time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """The server's metrics, bound to one engine's scheduler."""

    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("zllm_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("zllm_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.generation_tokens = Counter("zllm_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("zllm_time_to_first_token_seconds", "Request received to first generated token",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("zllm_inter_token_latency_seconds", "Gap between consecutive generated tokens",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        scheduler = engine.llm.scheduler
        kv = scheduler.kv
        Gauge("zllm_num_requests_running", "Sequences in the running batch",
              registry=r).set_function(lambda: len(scheduler.running))
        Gauge("zllm_num_requests_waiting", "Sequences waiting for admission",
              registry=r).set_function(lambda: len(scheduler.waiting))
        Gauge("zllm_kv_blocks_free", "Free KV cache blocks", registry=r).set_function(lambda: kv.num_free_blocks)
        Gauge("zllm_kv_blocks_used", "KV cache blocks in use (running sequences and prefix cache)",
              registry=r).set_function(lambda: kv.num_blocks - kv.num_free_blocks)
        Gauge("zllm_kv_blocks_running", "KV cache blocks held by running sequences",
              registry=r).set_function(lambda: sum(len(s.kv.blocks) for s in list(scheduler.running)))
        r.register(_ExpiredRequests(scheduler))
        if engine.llm.proposer is not None:
            r.register(_Speculation(engine.llm.spec_stats))


class _ExpiredRequests(Collector):
    """``zllm_requests_expired_total{phase}`` from the scheduler's own counters."""

    def __init__(self, scheduler) -> None:
        self._stats = scheduler.stats

    def collect(self):
        family = CounterMetricFamily("zllm_requests_expired", "Requests dropped at their deadline",
                                     labels=["phase"])
        family.add_metric(["waiting"], self._stats.expired_waiting)
        family.add_metric(["running"], self._stats.expired_running)
        yield family


class _Speculation(Collector):
    """Speculative decoding's counters per draft position and its acceptance rate."""

    def __init__(self, stats) -> None:
        self._stats = stats

    def collect(self):
        proposed = CounterMetricFamily("zllm_spec_proposed_tokens", "Speculative proposals verified",
                                       labels=["position"])
        accepted = CounterMetricFamily("zllm_spec_accepted_tokens", "Speculative proposals accepted",
                                       labels=["position"])
        # The engine loop may be adding a position while this reads: the shorter copy wins.
        for j, (p, a) in enumerate(zip(list(self._stats.proposed), list(self._stats.accepted), strict=False)):
            proposed.add_metric([str(j)], p)
            accepted.add_metric([str(j)], a)
        rate = self._stats.acceptance_rate
        yield proposed
        yield accepted
        yield GaugeMetricFamily("zllm_spec_acceptance_rate", "Accepted / proposed speculative tokens",
                                value=0.0 if rate is None else rate)
