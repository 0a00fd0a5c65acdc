"""config.json flags and sizes read as transformers reads them: strings refused instead of read as
true, sizes that are not positive integers refused with the key named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zllm.domain.hf_config import config_flag, config_int
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


@given(st.integers(min_value=1, max_value=2**40))
def test_size_reads_a_positive_integer_or_its_integral_float(n):
    assert config_int({"k": n}, "k", "config.json") == n
    assert config_int({"k": float(n)}, "k", "config.json") == n


@pytest.mark.parametrize(("cfg", "default"), [({}, 7), ({"k": None}, 7)])
def test_size_absent_or_null_is_the_default(cfg, default):
    assert config_int(cfg, "k", "config.json", default) == default


@pytest.mark.parametrize("cfg", [{}, {"k": None}])
def test_required_size_absent_or_null_names_the_model_type_and_key(cfg):
    with pytest.raises(CheckpointError) as err:
        config_int(cfg, "k", "/m/config.json", model_type="llama")
    assert str(err.value) == "/m/config.json: llama config lacks required key 'k'"


@pytest.mark.parametrize(("cfg", "default"), [
    ({"k": 0}, None), ({"k": -3}, None), ({"k": 2.5}, None), ({"k": "64"}, None), ({"k": True}, None),
    ({"k": [64]}, None), ({}, 0),  # a computed default of 0 (hidden_size // heads) is refused too
])
def test_size_that_is_not_a_positive_integer_names_the_key_and_value(cfg, default):
    with pytest.raises(CheckpointError) as err:
        config_int(cfg, "k", "/m/config.json", default)
    value = cfg.get("k", default)
    assert str(err.value) == f"/m/config.json: k {value!r} is not a positive integer"
