"""The data-parallel router on its own: prefix digests, affinity, load and balance."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from zllm.server.data_parallel.request_text import read_request
from zllm.server.data_parallel.routing import (
    BALANCE_ABS_TOKENS,
    CHUNK_CHARS,
    NoReplicaError,
    Router,
    prefix_digests,
    request_cost,
)

texts = st.lists(st.text(max_size=150), min_size=1, max_size=5)


@given(texts, texts)
def test_a_text_that_extends_another_repeats_its_prefix_digests(base, more):
    # The last segment of a turn may grow (a longer user message is a different message, so
    # only whole earlier segments must match) -- here the extension adds whole segments.
    first = dict(prefix_digests(base))
    extended = dict(prefix_digests(base + more))
    assert all(extended[end] == digest for end, digest in first.items())


@given(texts)
def test_prefix_cuts_fall_on_chunk_multiples_and_segment_ends(segments):
    ends = [end for end, _ in prefix_digests(segments)]
    seg_ends, total = set(), 0
    for s in segments:
        total += len(s)
        if s:
            seg_ends.add(total)
    assert ends == sorted(set(ends))
    assert set(ends) == {e for e in range(CHUNK_CHARS, total + 1, CHUNK_CHARS)} | seg_ends


def test_different_segmentation_of_the_same_characters_differs():
    assert dict(prefix_digests(["ab", "c"]))[3] != dict(prefix_digests(["a", "bc"]))[3]


def test_idle_replicas_take_turns():
    router = Router(3)
    routes = [router.choose([f"prompt {i}"], 10) for i in range(3)]
    assert [r.replica for r in routes] == [0, 1, 2]
    for r in routes:
        router.release(r)
    assert router.load_tokens == [0, 0, 0] and router.in_flight == [0, 0, 0]


def test_the_least_loaded_replica_gets_a_new_conversation():
    router = Router(2)
    router.choose(["a long one"], 500)
    assert router.choose(["another"], 10).replica == 1
    assert router.choose(["a third"], 10).replica == 1  # 20 tokens there vs 500


def test_a_follow_up_turn_goes_where_its_conversation_went():
    router = Router(2)
    turn1 = ["system\nYou tell stories.", "user\nTell me about a cat."]
    first = router.choose(turn1, 40)
    router.release(first)
    router.choose(["user\nsomething else entirely"], 40)  # the other replica is now idle, this one busy
    follow_up = router.choose(turn1 + ["assistant\nOnce there was a cat.", "user\nAnd then?"], 60)
    assert (follow_up.replica, follow_up.reason) == (first.replica, "prefix")
    assert follow_up.matched_chars == sum(map(len, turn1))


def test_an_overloaded_prefix_replica_loses_the_follow_up_to_the_least_loaded():
    router = Router(2)
    turn1 = ["user\nTell me about a cat."]
    first = router.choose(turn1, 40)
    router.choose(["user\nbusy work"], 0)  # the other replica, so the pin below is the first's
    router.pin(first.replica, 10 * BALANCE_ABS_TOKENS)
    follow_up = router.choose(turn1 + ["assistant\nOnce.", "user\nMore."], 40)
    assert follow_up.replica != first.replica and follow_up.reason == "load"


def test_a_dead_replica_is_never_chosen_and_none_left_raises():
    router = Router(2)
    turn1 = ["user\nTell me about a cat."]
    first = router.choose(turn1, 40)
    router.take_out(first.replica)
    assert router.choose(turn1 + ["user\nagain"], 40).replica != first.replica
    router.take_out(1 - first.replica)
    try:
        router.choose(["x"], 1)
    except NoReplicaError as exc:
        assert "2 replicas" in str(exc)
    else:
        raise AssertionError("expected NoReplicaError")


def test_request_text_follows_each_protocol():
    chat = read_request("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}],
         "max_completion_tokens": 7, "n": 2}).encode(), 100)
    assert chat.segments[0] == "system\nS" and chat.segments[1].startswith("user\n[")
    assert chat.cost_tokens == request_cost(sum(len(s) for s in chat.segments), 7, 2)
    messages = read_request("/v1/messages", json.dumps(
        {"system": "S", "messages": [{"role": "user", "content": "U"}], "max_tokens": 5}).encode(), 100)
    assert messages.segments == ("system\nS", "user\nU")
    completion = read_request("/v1/completions", b'{"prompt": "Once"}', 100)
    assert completion.segments == ("Once",) and completion.cost_tokens == request_cost(4, 100)
    responses = read_request("/v1/responses", b'{"input": "hi", "previous_response_id": "resp_1"}', 9)
    assert responses.previous_response_id == "resp_1" and responses.segments == ("user\nhi",)


def test_unreadable_bodies_are_routed_by_load_alone():
    for body in (b"{not json", b"[1, 2]", b'"text"'):
        view = read_request("/v1/completions", body, 100)
        assert view.segments == () and view.cost_tokens >= 1


def test_each_replica_config_serves_alone_on_its_own_devices_and_port(tmp_path):
    from tests.conftest import MODEL_DIR, write_config
    from zllm.server.data_parallel.replicas import cores, replica_config
    from zllm.spec.config import config_from_dict, load_config

    cfg = load_config(write_config(tmp_path, MODEL_DIR / "hf", parallel={"data": 2, "tensor": 1},
                                   backend={"device": 1}))
    second = config_from_dict(replica_config(cfg, 1, 12345))
    assert second.parallel.data == 1 and second.server.port == 12345 and second.server.host == "127.0.0.1"
    assert second.backend.device == 2  # replica 0 has device 1
    assert second.backend.threads == max(1, cores() // 2)
    assert second.model == cfg.model and second.runtime == cfg.runtime and second.generation == cfg.generation


@given(st.lists(st.tuples(st.sampled_from(["choose", "release", "take_out"]), st.integers(0, 3),
                          st.lists(st.sampled_from(["user\nhi", "user\na cat", "assistant\nyes"]), max_size=3),
                          st.integers(0, 2000)), max_size=40))
def test_routes_go_to_live_replicas_and_loads_return_to_zero(ops):
    router = Router(4)
    open_routes = []
    for op, index, segments, cost in ops:
        if op == "choose" and any(router.alive):
            route = router.choose(segments, cost)
            assert router.alive[route.replica]
            open_routes.append(route)
        elif op == "release" and open_routes:
            router.release(open_routes.pop(index % len(open_routes)))
        elif op == "take_out" and sum(router.alive) > 1:
            router.take_out(index)
    for route in open_routes:
        router.release(route)
    assert router.load_tokens == [0] * 4 and router.in_flight == [0] * 4


def test_a_cut_stream_ends_with_an_error_event_in_its_protocols_shape():
    from zllm.server.data_parallel.frontend import _replica_failed, _stream_error

    err = _replica_failed(1, ConnectionResetError("gone"))
    anthropic_event = _stream_error("/v1/messages", err, 0).decode()
    assert anthropic_event.startswith("event: error\ndata: ") and anthropic_event.endswith("\n\n")
    body = json.loads(anthropic_event.split("data: ", 1)[1])
    assert body == {"type": "error", "error": {"type": "overloaded_error", "message": err.message}}
    openai_event = _stream_error("/v1/chat/completions", err, 0).decode()
    body = json.loads(openai_event.removeprefix("data: "))
    assert body["error"]["code"] == "replica_failed" and body["error"]["type"] == "server_error"
    responses_event = _stream_error("/v1/responses", err, 7).decode()
    body = json.loads(responses_event.split("data: ", 1)[1])
    assert body["type"] == "error" and body["sequence_number"] == 7 and body["code"] == "replica_failed"


def test_a_replica_that_exits_before_it_is_ready_stops_the_others(tmp_path, monkeypatch):
    import socket

    from tests.conftest import MODEL_DIR, write_config
    from zllm.server.data_parallel import replicas
    from zllm.spec.config import load_config

    cfg = load_config(write_config(tmp_path, MODEL_DIR / "hf", parallel={"data": 2}))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        # Replica 1 is given a port already in use, so its `zllm serve` exits 2 at once.
        ports = iter([replicas.free_port(), taken.getsockname()[1]])
        monkeypatch.setattr(replicas, "free_port", lambda: next(ports))
        replica_set = replicas.ReplicaSet(cfg)
        try:
            replica_set.wait_ready()
        except replicas.ReplicaStartError as exc:
            assert exc.index == 1 and exc.returncode == 2 and "replica 1" in str(exc)
        else:
            raise AssertionError("expected ReplicaStartError")
        finally:
            replica_set.stop()
    assert all(r.process.poll() is not None for r in replica_set.replicas)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)
fields = st.sampled_from(["prompt", "messages", "input", "system", "tools", "instructions", "max_tokens",
                          "max_completion_tokens", "max_output_tokens", "n", "previous_response_id"])


@given(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/tokenize"]),
       st.dictionaries(fields, json_values, max_size=6))
def test_any_json_body_gets_a_routing_view(path, body):
    # The front end never validates: whatever the body, it routes it and the replica answers.
    view = read_request(path, json.dumps(body).encode(), 64)
    assert view.cost_tokens >= 1 and all(isinstance(s, str) for s in view.segments)
    Router(2).choose(view.segments, view.cost_tokens)
