"""``<think>…</think>`` reasoning, as Qwen3, QwQ and DeepSeek-R1 emit it, split from the answer.

The reasoning is the text between the tags (as generated); the whitespace between
``</think>`` and the answer is dropped. When the prompt already ends inside an open
``<think>`` (templates that start the reasoning for the model, e.g. DeepSeek-R1's and
Qwen3-Thinking's), the output starts in the reasoning. An answer that does not open with
``<think>`` has no reasoning. Reference: vLLM's ``qwen3_reasoning_parser.py`` and
``deepseek_r1_reasoning_parser.py``.
"""

from __future__ import annotations

from zllm.engine.tool_parsers.base import is_prefix_of_any, split_at

THINK, END_THINK = "<think>", "</think>"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an unclosed ``<think>``."""
    return prompt_text.rstrip().endswith(THINK)


class ThinkSplitter:
    """Splits generated text into ``(reasoning, answer)`` pieces as it arrives.

    Args:
        in_reasoning: the prompt ended inside ``<think>`` (:func:`prompt_opens_reasoning`).
    """

    def __init__(self, in_reasoning: bool = False):
        self._state = "reasoning" if in_reasoning else "start"
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """More text (``final``: the generation ended) → ``(reasoning, answer)`` it adds."""
        self._buf += text
        reasoning, answer = [], []
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK):
                    self._buf, self._state = stripped[len(THINK):], "reasoning"
                    continue
                if (not stripped or is_prefix_of_any(stripped, [THINK])) and not final:
                    break
                self._state = "answer"
                continue
            if self._state == "reasoning":
                before, marker, self._buf = split_at(self._buf, [END_THINK])
                reasoning.append(before)
                if marker is None:
                    if final:
                        reasoning.append(self._buf)
                        self._buf = ""
                    break
                self._state = "after"
                continue
            if self._state == "after":  # whitespace between </think> and the answer
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._state = "answer"
                continue
            answer.append(self._buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(answer)
