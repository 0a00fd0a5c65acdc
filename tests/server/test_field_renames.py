"""How engine field paths become a protocol's (:func:`zllm.server.generation.rename_field`):
the server's error messages name fields by these rules, so they are pinned here without a server."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from zllm.server.anthropic_messages import RENAMES as MESSAGES
from zllm.server.generation import rename_field
from zllm.server.openai_responses import RENAMES as RESPONSES


def test_a_key_renames_the_paths_below_it():
    renamed = rename_field("response_format.json_schema.schema.properties.a", RESPONSES)
    assert renamed == "text.format.schema.properties.a"
    assert rename_field("response_format.type", RESPONSES) == "text.format.type"
    assert rename_field("response_format", MESSAGES) == "output_config.format"
    assert rename_field("max_tokens", RESPONSES) == "max_output_tokens"


def test_the_longest_matching_key_wins_and_keeps_list_indices():
    assert rename_field("tools[3].function.parameters.type", MESSAGES) == "tools[3].input_schema.type"
    assert rename_field("tools[12].function.name", MESSAGES) == "tools[12].name"
    assert rename_field("tools[0].function.name", RESPONSES) == "tools[0].name"


def test_a_key_matches_only_at_a_field_boundary():
    assert rename_field("logprobsx", RESPONSES) == "logprobsx"
    assert rename_field("tools", RESPONSES) == "tools"  # no index: "tools[*]" does not match
    assert rename_field("tools[x].function", RESPONSES) == "tools[x].function"


@given(st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}|\[[0-9]{1,3}\]){0,4}", fullmatch=True))
def test_paths_no_key_matches_are_unchanged(path):
    renames = {"response_format": "text.format"}
    if not (path == "response_format" or path.startswith(("response_format.", "response_format["))):
        assert rename_field(path, renames) == path
