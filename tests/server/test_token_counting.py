"""Token counting against a real ``zllm serve``: Anthropic's ``count_tokens`` (through the SDK)
and the ``/tokenize`` / ``/detokenize`` extensions, checked against transformers' tokenizer
and chat template and against what generation itself reports as the prompt's length."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from tests.conftest import MODEL_DIR
from tests.server.test_tool_calls import HISTORY, TOOLS, USER, hf_prompt_tokens

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
PROMPT = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(scope="module")
def claude(tool_chat_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tool_chat_server.url, api_key="unused", max_retries=0, timeout=60)


def _openai_error(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


# ------------------------------------------------------------------ Anthropic count_tokens


def test_count_tokens_is_the_prompt_messages_would_feed_the_model(claude, tool_chat_server, tool_chat):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    counted = claude.messages.count_tokens(model=tool_chat_server.model, messages=messages, tools=ANTHROPIC_TOOLS)
    used = claude.messages.create(model=tool_chat_server.model, messages=messages, tools=ANTHROPIC_TOOLS,
                                  max_tokens=2)
    assert counted.input_tokens == used.usage.input_tokens == hf_prompt_tokens(tool_chat, USER, TOOLS)


def test_count_tokens_renders_system_and_tools_as_the_template_does(claude, tool_chat_server, tool_chat):
    messages = [{"role": "user", "content": "Hi"}]
    system = "You are a weather bot."
    for kw, hf_messages, hf_tools in [({}, messages, None),
                                      ({"system": system}, [{"role": "system", "content": system}, *messages], None),
                                      ({"tools": ANTHROPIC_TOOLS}, messages, TOOLS),
                                      ({"system": system, "tools": ANTHROPIC_TOOLS},
                                       [{"role": "system", "content": system}, *messages], TOOLS)]:
        counted = claude.messages.count_tokens(model=tool_chat_server.model, messages=messages, **kw)
        assert counted.input_tokens == hf_prompt_tokens(tool_chat, hf_messages, hf_tools), kw


@pytest.mark.parametrize(("body", "status"), [
    ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, 400),  # not a count_tokens field
    ({"messages": []}, 400),
    ({"messages": [{"role": "user", "content": "Hi"}], "tools": [{"name": "get weather", "input_schema": {}}]}, 400),
    ({"messages": [{"role": "user", "content": "Hi"}], "model": "claude-9"}, 404),
])
def test_count_tokens_bad_input_is_anthropic_shaped(tool_chat_server, body, status):
    r = httpx.post(tool_chat_server.url + "/v1/messages/count_tokens",
                   json={"model": tool_chat_server.model, **body}, timeout=10)
    assert r.status_code == status
    assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    assert tool_chat_server.healthy()


# ------------------------------------------------------------------ /tokenize and /detokenize


def test_tokenize_a_prompt_matches_transformers_and_the_completion_usage(server):
    out = httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": PROMPT}, timeout=10).json()
    hf = PreTrainedTokenizerFast.from_pretrained(MODEL_DIR / "hf")
    assert out["tokens"] == hf(PROMPT)["input_ids"] and out["count"] == len(out["tokens"])
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert out["max_model_len"] == models["data"][0]["max_model_len"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1).usage.prompt_tokens == \
        out["count"]
    plain = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False},
                       timeout=10).json()
    assert plain["tokens"] == hf(PROMPT, add_special_tokens=False)["input_ids"]


def test_detokenize_inverts_tokenize(server):
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False,
                                                        "return_token_strs": True}, timeout=10).json()
    hf = PreTrainedTokenizerFast.from_pretrained(MODEL_DIR / "hf")
    assert tokens["token_strs"] == [hf.decode([t]) for t in tokens["tokens"]]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=10).json()
    assert text == {"prompt": PROMPT}


def test_tokenize_messages_renders_the_chat_template_with_tools(tool_chat_server, tool_chat):
    url = tool_chat_server.url + "/tokenize"
    out = httpx.post(url, json={"messages": HISTORY, "tools": TOOLS}, timeout=10).json()
    assert out["count"] == len(out["tokens"]) == hf_prompt_tokens(tool_chat, HISTORY, TOOLS)
    hf = PreTrainedTokenizerFast.from_pretrained(tool_chat.path)
    no_prompt = httpx.post(url, json={"messages": USER, "tools": TOOLS, "add_generation_prompt": False},
                           timeout=10).json()
    assert no_prompt["tokens"] == hf.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=False,
                                                         tokenize=True, return_dict=True)["input_ids"]
    with_prompt = httpx.post(url, json={"messages": USER, "tools": TOOLS}, timeout=10).json()
    assert with_prompt["tokens"][: no_prompt["count"]] == no_prompt["tokens"]
    assert with_prompt["count"] > no_prompt["count"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, "tools"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}]}, "messages"),  # no chat template
    ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
])
def test_bad_token_counting_input_is_400_naming_the_field(server, path, body, param):
    err = _openai_error(httpx.post(server.url + path, json=body, timeout=10), param)
    assert param.split("[")[0] in err["message"]
    assert server.healthy()


def test_token_counting_checks_the_model_name(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(server.url + path, json={**body, "model": "gpt-9"}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
