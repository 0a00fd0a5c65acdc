"""``parallel.data: 2``: two real ``zllm serve`` replicas behind one front end, driven by the
official openai and anthropic SDKs over loopback.

One front end serves the whole module (starting two replicas costs seconds of model loading);
the test that kills a replica runs last, in file order.
"""

from __future__ import annotations

import os
import signal
import threading

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import Server, chat_model_dir, start_server, wait_until

pytestmark = pytest.mark.slow  # two replicas start: seconds of model loading each

REPLICA = "x-zllm-replica"
PROMPTS = [f"Once upon a time, {name} went to the {place}" for name in ("Lily", "Tom", "Sue", "Ben")
           for place in ("park", "sea", "shop", "woods")]
MAX_TOKENS = 24
LONG_TOKENS = 128


def start_dp(tmp_path_factory, name: str) -> Server:
    tmp = tmp_path_factory.mktemp(name)
    # One OpenMP thread per replica: two replicas share this machine's two cores.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return start_server(tmp, chat_model_dir(tmp / "stories-chat"), parallel={"data": 2},
                            server={"served_model_name": "stories-chat"})
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def replicas(dp: Server) -> list[dict]:
    return httpx.get(f"{dp.url}/health", timeout=5).json()["replicas"]


def stop(dp: Server) -> None:
    pids = [r["pid"] for r in replicas(dp)] if dp.proc.poll() is None else []
    dp.stop()
    for pid in pids:  # the front end stops its replicas; make sure, whatever a test did to them
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    srv = start_dp(tmp_path_factory, "serve-dp")
    yield srv
    stop(srv)


def client(dp: Server) -> openai.OpenAI:
    # No retries: a 503 must reach the test, not be retried on the surviving replica.
    return openai.OpenAI(base_url=f"{dp.url}/v1", api_key="unused", max_retries=0)


def stream_text(dp: Server, prompt: str, max_tokens: int = MAX_TOKENS, **extra) -> tuple[str, int]:
    """One completions stream through the SDK: its text and the replica that served it."""
    with client(dp).completions.with_streaming_response.create(
            model=dp.model, prompt=prompt, max_tokens=max_tokens, stream=True, extra_body=extra) as raw:
        text = "".join(chunk.choices[0].text for chunk in raw.parse() if chunk.choices)
        return text, int(raw.headers[REPLICA])


def test_sixteen_concurrent_streams_equal_their_solo_runs_and_spread_over_both_replicas(dp):
    solo = {p: stream_text(dp, p)[0] for p in PROMPTS}
    barrier = threading.Barrier(len(PROMPTS))
    results: dict[str, tuple[str, int]] = {}

    def run(prompt: str) -> None:
        barrier.wait()
        results[prompt] = stream_text(dp, prompt)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {p: text for p, (text, _) in results.items()} == solo
    served = [replica for _, replica in results.values()]
    assert min(served.count(0), served.count(1)) >= len(PROMPTS) // 4, served
    assert all(r["requests_in_flight"] == 0 and r["load_tokens"] == 0 for r in replicas(dp))


def test_follow_up_turns_land_on_the_replica_holding_the_conversation(dp):
    oai = client(dp)
    # Three conversations: taking turns, the replicas would serve a conversation's second turn on
    # the other replica than its first; only prefix affinity keeps all three in place.
    conversations = [[{"role": "system", "content": f"You are storyteller number {i}, and you tell short "
                       "stories about animals who live in a small village by the sea."},
                      {"role": "user", "content": f"Tell me story {i}."}] for i in range(3)]
    served: list[list[int]] = [[] for _ in conversations]
    cached: list[int] = []
    for turn in range(3):
        for i, messages in enumerate(conversations):
            raw = oai.chat.completions.with_raw_response.create(model=dp.model, messages=messages,
                                                                 max_completion_tokens=12)
            reply = raw.parse()
            served[i].append(int(raw.headers[REPLICA]))
            if turn:
                cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "And then?"}]
    assert all(len(set(s)) == 1 for s in served), served
    assert {s[0] for s in served} == {0, 1}, served
    assert all(c > 0 for c in cached), cached  # the replica's prefix cache held the earlier turns
    routed = dp.metrics()
    assert sum(v for k, v in routed.items() if k.startswith("zllm_dp_routed_total") and 'reason="prefix"' in k) >= 6


def test_health_and_metrics_describe_the_whole(dp):
    assert [r["up"] for r in replicas(dp)] == [True, True]
    for prompt in ("The cat", "The dog"):  # idle replicas take turns: each serves one of these
        stream_text(dp, prompt)
    metrics = dp.metrics()
    assert metrics['zllm_dp_replica_up{replica="0"}'] == metrics['zllm_dp_replica_up{replica="1"}'] == 1
    per_replica = [metrics[f'zllm_generation_tokens_total{{replica="{i}"}}'] for i in (0, 1)]
    assert all(n > 0 for n in per_replica)  # both replicas' own metrics, labelled
    assert metrics['zllm_dp_requests_total{route="/v1/completions",status="200"}'] >= 1


def test_a_stored_response_is_found_and_continued_on_the_replica_that_holds_it(dp):
    oai = client(dp)
    served = []
    for i in range(3):  # idle replicas take turns: without state routing, turns would alternate
        raw = oai.responses.with_raw_response.create(model=dp.model, input=f"Tell me story {i}.",
                                                      max_output_tokens=8)
        first = raw.parse()
        holder = int(raw.headers[REPLICA])
        assert oai.responses.retrieve(first.id).id == first.id  # found whichever replica holds it
        raw = oai.responses.with_raw_response.create(model=dp.model, input="And then?", max_output_tokens=8,
                                                      previous_response_id=first.id)
        assert raw.parse().output_text  # the replica found the stored conversation (else: 404)
        served.append((holder, int(raw.headers[REPLICA])))
    assert all(a == b for a, b in served) and {a for a, _ in served} == {0, 1}, served


def test_a_replica_refusing_connections_is_taken_out_and_the_request_goes_to_another(dp):
    import asyncio

    from zllm.server.data_parallel.frontend import FrontEnd, create_frontend_app
    from zllm.server.data_parallel.replicas import free_port

    # An in-process front end over a port nothing listens on (replica 0, first in turn) and
    # one of the running replicas: the refused request was never seen, so replica 1 takes it.
    frontend = FrontEnd([f"http://127.0.0.1:{free_port()}", replicas(dp)[0]["url"]], default_max_tokens=16)

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_frontend_app(frontend))
        async with httpx.AsyncClient(transport=transport, base_url="http://dp") as http:
            reply = await http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
        await frontend.aclose()
        return reply

    reply = asyncio.run(ask())
    assert reply.status_code == 200 and reply.headers[REPLICA] == "1" and reply.json()["choices"][0]["text"]
    assert frontend.router.alive == [False, True] and frontend.router.in_flight == [0, 0]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_aborts_its_request_on_the_replica(dp, stream):
    idle = dp.metrics()
    # Tokens generated so far, finished or not (a request's first token has no gap before it).
    generated = 'zllm_inter_token_latency_seconds_count{replica="%d"}'
    body = {"model": dp.model, "prompt": [310 + stream, 42, 43], "max_tokens": 480, "ignore_eos": True,
            "stream": stream}
    with httpx.Client(timeout=30) as http:
        if stream:
            with http.stream("POST", f"{dp.url}/v1/completions", json=body) as r:
                replica = int(r.headers[REPLICA])
                lines = r.iter_lines()
                for _ in range(10):
                    next(lines)
                during = dp.metrics()
                assert during[f'zllm_num_requests_running{{replica="{replica}"}}'] == 1
        else:
            # The client leaves after 0.25 s, about half the time the 480 tokens take: an abort
            # that reaches the replica stops it well short of them, also on a loaded machine.
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{dp.url}/v1/completions", json=body, timeout=0.25)
            assert wait_until(lambda: any(dp.metrics()[generated % i] > idle[generated % i] for i in (0, 1)))
            now = dp.metrics()
            replica = next(i for i in (0, 1) if now[generated % i] > idle[generated % i])
    running = f'zllm_num_requests_running{{replica="{replica}"}}'
    assert wait_until(lambda: dp.metrics()[running] == 0)
    after = dp.metrics()
    assert after[f'zllm_kv_blocks_running{{replica="{replica}"}}'] == 0
    # Far fewer tokens than the 480 asked for: the replica stopped the sequence early.
    assert after[generated % replica] - idle[generated % replica] < 400
    assert all(r["requests_in_flight"] == 0 for r in replicas(dp))
    if not stream:  # counted as the client leaving, not as a front-end failure
        gone = 'zllm_dp_requests_total{route="/v1/completions",status="499"}'
        assert after[gone] == idle.get(gone, 0) + 1


def test_a_killed_replica_fails_its_requests_with_503_and_the_other_keeps_serving(dp):
    pids = [r["pid"] for r in replicas(dp)]
    long = {"ignore_eos": True}
    prompts = ["Once upon a time", "The little dog"]
    solo = [stream_text(dp, p, LONG_TOKENS, **long)[0] for p in prompts]
    oai = client(dp)
    # Each stream's replica is frozen (SIGSTOP) as soon as its first token has come through the
    # front end, so nothing finishes before the kill however fast the machine is -- and the
    # victim's stream, cut later, shows that token was relayed before the answer was complete.
    streams, served = [], []
    for p in prompts:
        cm = oai.completions.with_streaming_response.create(model=dp.model, prompt=p, max_tokens=LONG_TOKENS,
                                                            stream=True, extra_body=long)
        raw = cm.__enter__()
        events = iter(raw.parse())
        first = next(events).choices[0].text
        replica = int(raw.headers[REPLICA])
        os.kill(pids[replica], signal.SIGSTOP)
        streams.append((cm, first, events))
        served.append(replica)
    assert sorted(served) == [0, 1]  # the second stream went to the less loaded replica
    outcome: dict[str, object] = {}

    def blocking_request() -> None:
        try:
            oai.completions.create(model=dp.model, prompt="Tom and", max_tokens=8)
        except openai.APIStatusError as exc:
            outcome["error"] = exc

    waiting = threading.Thread(target=blocking_request)
    waiting.start()
    assert wait_until(lambda: sum(r["requests_in_flight"] for r in replicas(dp)) == 3)
    victim = next(r["replica"] for r in replicas(dp) if r["requests_in_flight"] == 2)
    survivor = 1 - victim
    os.kill(pids[victim], signal.SIGKILL)
    os.kill(pids[survivor], signal.SIGCONT)
    waiting.join(timeout=60)
    err = outcome["error"]
    assert isinstance(err, openai.APIStatusError) and err.status_code == 503
    assert err.body["code"] == "replica_failed" and f"replica {victim}" in err.body["message"]

    texts: list[str | Exception] = []
    for cm, first, events in streams:
        try:
            texts.append(first + "".join(c.choices[0].text for c in events if c.choices))
        except openai.APIError as exc:
            texts.append(exc)
        finally:
            cm.__exit__(None, None, None)
    failed = texts[served.index(victim)]
    assert isinstance(failed, openai.APIError) and f"replica {victim}" in failed.message
    assert texts[served.index(survivor)] == solo[served.index(survivor)]

    assert [r["up"] for r in replicas(dp)] == [i == survivor for i in (0, 1)]
    for p in prompts:  # new requests all go to the survivor and succeed
        assert stream_text(dp, p, LONG_TOKENS, **long) == (solo[prompts.index(p)], survivor)
    reply = anthropic.Anthropic(base_url=dp.url, api_key="unused", max_retries=0).messages.with_raw_response.create(
        model=dp.model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert int(reply.headers[REPLICA]) == survivor and reply.parse().content
    assert dp.metrics()[f'zllm_dp_replica_up{{replica="{victim}"}}'] == 0
