"""The front end's ``/metrics``: its own routing metrics and every live replica's metrics.

=========================================  =========  ======================================
metric                                     type       meaning
=========================================  =========  ======================================
zllm_dp_requests_total{route,status}       counter    HTTP requests the front end answered
zllm_dp_routed_total{replica,reason}       counter    requests sent to a replica, ``reason``
                                                      ``prefix``, ``load`` or ``state``
zllm_dp_replica_up{replica}                gauge      1 while the replica is in rotation
zllm_dp_replica_requests_in_flight         gauge      requests the replica is serving for
  {replica}                                           the front end
zllm_dp_replica_load_tokens{replica}       gauge      their estimated tokens (the load the
                                                      router balances)
every ``zllm_*`` metric of a replica       as there   with a ``replica`` label added
=========================================  =========  ======================================

Summing a replica metric over ``replica`` gives the whole server's (``sum without (replica)
(zllm_generation_tokens_total)``). A replica that does not answer within
:data:`SCRAPE_TIMEOUT_S` is left out of that scrape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

if TYPE_CHECKING:
    from zllm.server.data_parallel.frontend import FrontEnd

SCRAPE_TIMEOUT_S = 5.0

ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                    "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize"})
"""The paths the front end labels as themselves (:func:`zllm.server.request_count.route_label`)."""


class FrontEndMetrics:
    """The front end's registry (see the module docstring)."""

    def __init__(self, frontend: FrontEnd) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("zllm_dp_requests", "HTTP requests the data-parallel front end answered",
                                ["route", "status"], registry=self.registry)
        self.routed = Counter("zllm_dp_routed", "Requests sent to a replica, by the routing reason",
                              ["replica", "reason"], registry=self.registry)
        self.registry.register(_Replicas(frontend))


class _Replicas(Collector):
    """The replicas' state in the router, then each live replica's own metrics."""

    def __init__(self, frontend: FrontEnd) -> None:
        self._fe = frontend

    def collect(self):
        router = self._fe.router
        up = GaugeMetricFamily("zllm_dp_replica_up", "1 while the replica is in rotation", labels=["replica"])
        flight = GaugeMetricFamily("zllm_dp_replica_requests_in_flight", "Requests the replica is serving",
                                   labels=["replica"])
        load = GaugeMetricFamily("zllm_dp_replica_load_tokens", "Estimated tokens of the replica's requests",
                                 labels=["replica"])
        for i in range(len(self._fe.urls)):
            up.add_metric([str(i)], 1.0 if router.alive[i] else 0.0)
            flight.add_metric([str(i)], router.in_flight[i])
            load.add_metric([str(i)], router.load_tokens[i])
        yield from (up, flight, load)
        yield from _merged(self._scrape())

    def _scrape(self) -> list[tuple[str, str]]:
        texts = []
        with httpx.Client(timeout=SCRAPE_TIMEOUT_S) as client:
            for i, url in enumerate(self._fe.urls):
                if not self._fe.router.alive[i]:
                    continue
                try:
                    reply = client.get(f"{url}/metrics")
                except httpx.TransportError:
                    continue
                if reply.status_code == 200:
                    texts.append((str(i), reply.text))
        return texts


def _merged(texts: list[tuple[str, str]]) -> list[Metric]:
    """One family per metric name holding every replica's samples, each labelled ``replica``."""
    families: dict[str, Metric] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            merged.samples.extend(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp,
                                         s.exemplar) for s in family.samples)
    return list(families.values())
