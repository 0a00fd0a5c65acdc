"""Real ``zllm serve`` subprocesses on free loopback ports.

Two servers for the whole session (stories260K, and a copy with a chat template), not one
per module: each start costs seconds of model loading, and every test reads metrics as
before/after differences, so sharing them is safe.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_DIR, write_config

STARTUP_TIMEOUT_S = 60
_SCRIPT = Path(sys.executable).with_name("zllm")
ZLLM = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "zllm.cli.main"]

# A ChatML-like template (the stories260K vocabulary has no chat tokens, so the markers are
# plain text). Tests only need a template that renders every role.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float = 20.0) -> bool:
    """Poll ``predicate`` every 20 ms until it holds or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


class Server:
    """A running ``zllm serve``: ``url``, ``model`` (the served name), ``config`` (its config
    file, for an in-process Engine of the same model), ``metrics()``."""

    def __init__(self, config: Path, model: str, log: Path, plugins: str = "cpu,llama"):
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            [*ZLLM, "serve", "--config", str(config), "--port", str(self.port),
             "--log-level", "warning"],
            stdout=self._log_file, stderr=subprocess.STDOUT, env={**os.environ, "ZLLM_PLUGINS": plugins},
        )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"zllm serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"zllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log.read_text()}")

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=5).json() == {"status": "ok"}

    def metrics(self) -> dict[str, float]:
        """Samples of ``/metrics`` as ``{'name{label="v",...}': value}`` (labels sorted)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def start_server(tmp_path: Path, model_dir: Path, plugins: str = "cpu,llama", **sections) -> Server:
    # Batch-invariant mode: a request's tokens never depend on its batch-mates, so the
    # concurrency tests can demand exact equality with the request run alone (max_num_seqs
    # 16 so all sixteen streams share one batch).
    sections.setdefault("runtime", {"batch_invariant": True, "max_num_seqs": 16})
    config = write_config(tmp_path, model_dir, **sections)
    name = (sections.get("server") or {}).get("served_model_name") or model_dir.name
    return Server(config, name, tmp_path / "server.log", plugins)


def chat_model_dir(dst: Path, template: str = CHAT_TEMPLATE) -> Path:
    """A copy of the stories260K HF checkpoint whose tokenizer_config has a chat template."""
    shutil.copytree(MODEL_DIR / "hf", dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst


def messages_supported() -> bool:
    """Whether the engine's Request JSON accepts ``messages`` yet (another change adds it)."""
    from zllm.spec.config import GenerationDefaults
    from zllm.spec.errors import RequestError
    from zllm.spec.request import parse_request

    try:
        parse_request({"messages": [{"role": "user", "content": "hi"}]}, GenerationDefaults())
    except RequestError:
        return False
    return True


needs_messages = pytest.mark.skipif(
    not messages_supported(),
    reason="the engine's Request JSON does not accept `messages` yet (chat-template prompts are being added "
    "in zllm.spec.request / zllm.engine); chat routes pass messages through to it",
)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """stories260K (HF) served under its folder's name, ``hf``."""
    srv = start_server(tmp_path_factory.mktemp("serve"), MODEL_DIR / "hf")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def chat_server(tmp_path_factory) -> Server:
    """stories260K with a chat template, served as ``stories-chat``."""
    tmp = tmp_path_factory.mktemp("serve-chat")
    srv = start_server(tmp, chat_model_dir(tmp / "stories-chat"), server={"served_model_name": "stories-chat"})
    yield srv
    srv.stop()


# ---------------------------------------------------------------- a tiny random ChatML checkpoint

# Qwen's ChatML template, the shape most chat checkpoints use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_SYSTEM = "You are a tiny test model."
TINY_CHAT_USER = "Tell me a story about a cat and a dog."
TINY_CHAT_MAX_TOKENS = 16
# Greedy parity needs every step's top logit to beat the runner-up by more than the rounding
# differences between two f32 implementations (~1e-5); seeds whose greedy run has a nearer
# tie, emits a special token or stops early are skipped (deterministically).
TINY_CHAT_MIN_MARGIN = 1e-3
_TINY_CHAT_CORPUS = [
    "Once upon a time there was a little cat who lived in a big house with a friendly dog.",
    "The dog liked to run in the park, and the cat liked to sleep in the sun.",
    "One day they found a red ball under the old tree. They played until the stars came out.",
    "You are a helpful assistant. Tell me a story about a cat and a dog, please!",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and marks: ; ? ' \" ( ) [ ] { } - _ + = * / \\ | @ # $ % ^ & ~ ` < >",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz",
]


class TinyChat:
    """A random-weight LlamaForCausalLM with a ChatML tokenizer, both written by transformers
    (``save_pretrained``), and transformers' own greedy answer to one conversation.

    Attributes:
        path: the checkpoint directory.
        system, user: the conversation (a system message and one user message).
        prompt_ids: ``apply_chat_template(..., add_generation_prompt=True)`` ids.
        output_ids: ``generate(do_sample=False, max_new_tokens=TINY_CHAT_MAX_TOKENS)`` new ids.
        text: ``output_ids`` decoded (``skip_special_tokens=True``).
        seed: the ``torch.manual_seed`` the weights were drawn with.
    """

    def __init__(self, path: Path, prompt_ids: list[int], output_ids: list[int], text: str, seed: int):
        self.path, self.prompt_ids, self.output_ids, self.text, self.seed = path, prompt_ids, output_ids, text, seed
        self.system, self.user = TINY_CHAT_SYSTEM, TINY_CHAT_USER


def build_chatml_tokenizer(dst: Path):
    """A byte-level BPE (``tokenizers``, trained on a few lines of ASCII) with ChatML special
    tokens, wrapped in ``PreTrainedTokenizerFast`` with the template set, saved to ``dst``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # The base alphabet is the 128 ASCII bytes (in byte-level form): any ASCII text encodes,
    # and every token decodes to whole characters, so generated text is plain UTF-8.
    ascii_alphabet = [bpe.pre_tokenizer.pre_tokenize_str(chr(b))[0][0] for b in range(128)]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=CHATML_SPECIALS, initial_alphabet=ascii_alphabet,
                                  show_progress=False)
    bpe.train_from_iterator(_TINY_CHAT_CORPUS * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(dst)
    return tok


def build_tiny_chat(dst: Path, max_seeds: int = 20) -> TinyChat:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    tok = build_chatml_tokenizer(dst)
    messages = [{"role": "system", "content": TINY_CHAT_SYSTEM}, {"role": "user", "content": TINY_CHAT_USER}]
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt_ids = list(prompt_ids["input_ids"])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    specials = set(tok.all_special_ids)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
                      bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    for seed in range(max_seeds):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(torch.float32).eval()
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]),
                                 attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=TINY_CHAT_MAX_TOKENS, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
        new = out.sequences[0, len(prompt_ids):].tolist()
        top2 = torch.stack(out.logits).float().topk(2, dim=-1).values  # (steps, 1, 2)
        margin = float((top2[..., 0] - top2[..., 1]).min())
        if len(new) == TINY_CHAT_MAX_TOKENS and not specials & set(new) and margin > TINY_CHAT_MIN_MARGIN:
            model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
            model.save_pretrained(dst, safe_serialization=True)
            return TinyChat(dst, prompt_ids, new, tok.decode(new, skip_special_tokens=True), seed)
    raise RuntimeError(f"no seed below {max_seeds} gives a greedy run of {TINY_CHAT_MAX_TOKENS} plain tokens "
                       f"with top-1 margins > {TINY_CHAT_MIN_MARGIN}")


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory) -> TinyChat:
    """The tiny ChatML checkpoint and transformers' greedy answer (see :class:`TinyChat`)."""
    return build_tiny_chat(tmp_path_factory.mktemp("tiny-chat") / "tiny-chatml")


@pytest.fixture(scope="session")
def tiny_chat_server(tmp_path_factory, tiny_chat) -> Server:
    """``tiny_chat`` served as ``tiny-chatml``."""
    srv = start_server(tmp_path_factory.mktemp("serve-tiny-chat"), tiny_chat.path,
                       server={"served_model_name": "tiny-chatml"})
    yield srv
    srv.stop()


# ---------------------------------------------------------------- a tiny Qwen2 checkpoint that calls tools

# Qwen2.5-Instruct's chat template (Apache-2.0, Qwen/Qwen2.5-0.5B-Instruct tokenizer_config.json):
# tools in the system turn, <tool_call> blocks for assistant calls, tool results in a user turn.
QWEN25_TOOL_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

# What the checkpoint answers to any conversation: two Hermes tool calls, the second with no
# arguments. Each piece is one added token, so the greedy chain below can spell it.
TOOL_ANSWER_PIECES = [
    '<tool_call>\n{"name": "get_weather", "arguments": ',
    '{"city": ',
    '"Paris", "days": 3}',
    "}\n</tool_call>",
    '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
]
TOOL_ANSWER_TEXT = "".join(TOOL_ANSWER_PIECES)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The current time.",
                                              "parameters": {"type": "object", "properties": {}}}}


class ToolChat:
    """A Qwen2ForCausalLM whose weights make greedy decoding follow a fixed token chain.

    Every layer's output projections (``o_proj``, ``down_proj``) are zero, so the last hidden
    state is the current token's embedding; the embeddings of the chain's tokens are basis
    vectors and ``lm_head`` maps each to its successor: the last token of the generation
    prompt (``"\\n"`` after ``assistant``) → the :data:`TOOL_ANSWER_PIECES` tokens → ``<|im_end|>``.
    So whatever the conversation, the model answers :data:`TOOL_ANSWER_TEXT` — real weights,
    run by the real layer code (transformers' ``generate`` is checked to say the same).

    Attributes:
        path: the checkpoint directory (``save_pretrained`` of model and tokenizer).
    """

    def __init__(self, path: Path):
        self.path = path


def build_tool_chat(dst: Path) -> ToolChat:
    import torch
    from transformers import AddedToken, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    tok = build_chatml_tokenizer(dst)
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in TOOL_ANSWER_PIECES])
    tok.chat_template = QWEN25_TOOL_TEMPLATE
    tok.save_pretrained(dst)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    chain = [prompt[-1], *tok.convert_tokens_to_ids(TOOL_ANSWER_PIECES), eos]
    hidden = 64
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (cur, nxt) in enumerate(itertools.pairwise(chain)):
            basis = torch.zeros(hidden)
            basis[k] = 1.0
            model.model.embed_tokens.weight[cur] = basis
            model.lm_head.weight[nxt] = basis
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=16, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    assert tok.decode(out[0, len(prompt):], skip_special_tokens=True) == TOOL_ANSWER_TEXT
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    model.save_pretrained(dst, safe_serialization=True)
    return ToolChat(dst)


@pytest.fixture(scope="session")
def tool_chat(tmp_path_factory) -> ToolChat:
    """The tool-calling Qwen2 checkpoint (see :class:`ToolChat`)."""
    return build_tool_chat(tmp_path_factory.mktemp("tool-chat") / "tiny-qwen2-tools")


@pytest.fixture(scope="session")
def tool_chat_server(tmp_path_factory, tool_chat) -> Server:
    """``tool_chat`` served as ``qwen2-tools``."""
    srv = start_server(tmp_path_factory.mktemp("serve-tool-chat"), tool_chat.path,
                       server={"served_model_name": "qwen2-tools"})
    yield srv
    srv.stop()


# ---------------------------------------------------------------- a random Qwen2 checkpoint with a tool template


def build_random_tool_chat(dst: Path) -> Path:
    """A random-weight Qwen2ForCausalLM with the ChatML tokenizer and Qwen2.5's tool template
    (so zllm reads its tool calls in the Hermes format), written by transformers. Its answers
    are noise: whatever a grammar forces out of it is the grammar's doing."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    tok = build_chatml_tokenizer(dst)
    tok.chat_template = QWEN25_TOOL_TEMPLATE
    tok.save_pretrained(dst)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                      initializer_range=0.2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


@pytest.fixture(scope="session")
def random_tool_chat_server(tmp_path_factory) -> Server:
    """:func:`build_random_tool_chat` served as ``qwen2-random-tools``."""
    tmp = tmp_path_factory.mktemp("serve-random-tools")
    srv = start_server(tmp, build_random_tool_chat(tmp / "tiny-qwen2-random-tools"),
                       server={"served_model_name": "qwen2-random-tools"})
    yield srv
    srv.stop()
