"""config.json flags read as transformers reads them, strings refused instead of read as true."""

from __future__ import annotations

import pytest

from zllm.domain.hf_config import config_flag
from zllm.spec.errors import CheckpointError


@pytest.mark.parametrize(("cfg", "default", "expected"), [
    ({}, True, True), ({}, False, False),  # absent: the default
    ({"k": None}, True, False),  # null: false, as a transformers model tests it
    ({"k": True}, False, True), ({"k": False}, True, False),
])
def test_flag_is_the_value_the_default_when_absent_and_false_when_null(cfg, default, expected):
    assert config_flag(cfg, "k", default, "config.json") is expected


@pytest.mark.parametrize("value", ["false", "yes", 0, 1, 1.0, [True]])
def test_flag_that_is_not_a_bool_names_the_file_the_key_and_the_value(value):
    with pytest.raises(CheckpointError) as err:
        config_flag({"k": value}, "k", False, "/m/config.json")
    assert str(err.value) == f"/m/config.json: k {value!r} is not true or false"
