"""Data parallelism: ``parallel.data`` replicas of one engine behind one HTTP endpoint.

:mod:`.replicas` starts the replica processes, :mod:`.routing` and :mod:`.request_text`
choose a replica for each request, :mod:`.frontend` relays requests and answers,
:mod:`.metrics` serves ``/metrics`` for the whole, and :mod:`.serve` ties them together for
``zllm serve``. docs/server.md says how to use it and docs/data-parallel.md why it is built
this way.
"""
