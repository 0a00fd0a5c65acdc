"""The config contract: every bad key is reported at its exact dotted path, good configs round-trip."""

from __future__ import annotations

import copy
import io
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from zllm.spec.config import (
    SCHEMA_VERSION,
    GenerationDefaults,
    ZllmConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)
from zllm.spec.errors import ConfigError


def _with(base: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``base`` with ``dotted`` (e.g. ``runtime.kv_cache.block_size``) set."""
    data = copy.deepcopy(base)
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return data


@pytest.fixture
def base(ckpt_dir: Path) -> dict[str, Any]:
    return {"schema_version": 1, "model": {"path": str(ckpt_dir)}}


def _write_yaml(path: Path, data: Any) -> Path:
    buf = io.StringIO()
    YAML().dump(data, buf)
    path.write_text(buf.getvalue())
    return path


# --- good configs ------------------------------------------------------------------------


def test_minimal_config_takes_every_default(base: dict[str, Any], ckpt_dir: Path) -> None:
    cfg = config_from_dict(base)
    assert cfg.schema_version == SCHEMA_VERSION
    assert cfg.model.path == str(ckpt_dir)
    assert (cfg.model.format, cfg.model.dtype) == ("hf", "auto")
    assert (cfg.backend.name, cfg.backend.threads, cfg.backend.force_reference) == ("auto", None, ())
    kv_cache = cfg.runtime.kv_cache
    assert (kv_cache.block_size, kv_cache.num_blocks, kv_cache.dtype) == (16, None, "f32")
    assert (cfg.runtime.max_num_seqs, cfg.runtime.max_prefill_tokens) == (8, 512)
    assert (cfg.runtime.context_length, cfg.runtime.prefix_cache_seqs) == (None, 4)
    assert cfg.generation == GenerationDefaults()
    assert cfg.generation.max_new_tokens == 256 and cfg.generation.temperature == 0.0
    assert (cfg.server.host, cfg.server.port, cfg.server.served_model_name) == ("127.0.0.1", 8000, None)
    assert (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.data, cfg.backend.device) == (1, 1, 1, None)


def test_load_config_resolves_relative_path_against_the_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "models" / "ckpt"
    ckpt.mkdir(parents=True)
    (tmp_path / "conf").mkdir()
    cfg_file = tmp_path / "conf" / "x.yaml"
    cfg_file.write_text(
        "schema_version: 1\n"
        "model:\n  path: ../models/ckpt\n  dtype: bf16\n"
        "backend:\n  name: cpu\n  threads: 2\n  force_reference: [linear, attention]\n"
        "runtime:\n  kv_cache:\n    block_size: 32\n"
        "generation:\n  temperature: 1\n  stop: [\"\\n\\n\"]\n  stop_token_ids: [2]\n"
    )
    cfg = load_config(cfg_file)
    assert cfg.model.path == str(ckpt)
    assert cfg.model.dtype == "bf16"
    assert cfg.backend.force_reference == ("linear", "attention")
    assert cfg.runtime.kv_cache.block_size == 32
    # An int is accepted where a number is expected and stored as a float.
    assert cfg.generation.temperature == 1.0 and isinstance(cfg.generation.temperature, float)
    assert cfg.generation.stop == ("\n\n",) and cfg.generation.stop_token_ids == (2,)
    # Plain Python types, not ruamel's formatting-carrying str/float subclasses.
    assert type(cfg.generation.stop[0]) is str and type(cfg.model.dtype) is str


def test_format_auto_detects_directory_and_file(ckpt_dir: Path, gguf_file: Path) -> None:
    assert config_from_dict({"model": {"path": str(ckpt_dir)}}).model.format == "hf"
    assert config_from_dict({"model": {"path": str(gguf_file)}}).model.format == "gguf"
    assert config_from_dict({"model": {"path": gguf_file, "format": "gguf"}}).model.path == str(gguf_file)


def test_empty_section_means_all_defaults(base: dict[str, Any]) -> None:
    # `runtime:` with every child commented out parses as null.
    assert config_from_dict({**base, "runtime": None, "server": None}) == config_from_dict(base)


def test_config_from_dict_leaves_its_input_alone(base: dict[str, Any]) -> None:
    data = {"model": {"checkpoint": base["model"]["path"]}, "sampling": {"max_tokens": 3}}
    before = copy.deepcopy(data)
    assert config_from_dict(data).generation.max_new_tokens == 3
    assert data == before


def test_round_trip_through_dict_and_yaml(tmp_path: Path, base: dict[str, Any]) -> None:
    cfg = config_from_dict(
        _with(_with(base, "generation.stop", ["</s>"]), "backend.force_reference", ["linear"])
    )
    as_dict = config_to_dict(cfg)
    assert as_dict["generation"]["stop"] == ["</s>"]  # lists, not tuples: YAML/JSON ready
    assert config_from_dict(as_dict) == cfg
    assert load_config(_write_yaml(tmp_path / "rt.yaml", as_dict)) == cfg


def test_evolve_runs_the_same_validators(base: dict[str, Any]) -> None:
    cfg = config_from_dict(base)
    assert attrs.evolve(cfg.runtime, max_num_seqs=2).max_num_seqs == 2
    with pytest.raises(ConfigError) as exc:
        attrs.evolve(cfg.runtime, max_num_seqs=0)
    assert exc.value.path == "runtime.max_num_seqs"
    with pytest.raises(ConfigError) as exc:
        attrs.evolve(cfg, generation=attrs.evolve(cfg.generation, top_p=0))
    assert exc.value.path == "generation.top_p"


# --- bad configs: each names its exact key path -------------------------------------------

BAD_VALUES = [
    # (dotted key, value, message after "<path>: ")
    ("runtime.kv_cache.block_size", "big", "expected a positive int, got 'big'"),
    ("runtime.kv_cache.block_size", True, "expected a positive int, got True"),
    ("runtime.kv_cache.block_size", 0, "expected a positive int, got 0"),
    ("runtime.kv_cache.block_size", 16.0, "expected a positive int, got 16.0"),
    ("runtime.kv_cache.num_blocks", -3, "expected a positive int or null, got -3"),
    ("runtime.kv_cache.dtype", "fp8", "expected one of 'f32', 'f16', 'bf16', got 'fp8'"),
    ("runtime.max_num_seqs", "8", "expected a positive int, got '8'"),
    ("runtime.max_prefill_tokens", 0, "expected a positive int, got 0"),
    ("runtime.context_length", 0, "expected a positive int or null, got 0"),
    ("runtime.prefix_cache_seqs", -1, "expected an int >= 0, got -1"),
    ("runtime.max_batch_tokens", 0, "expected a positive int or null, got 0"),
    ("runtime.max_batch_tokens", 4, "expected an int >= runtime.max_num_seqs (8) or null, got 4"),
    ("runtime.batch_invariant", "yes", "expected true or false, got 'yes'"),
    ("runtime.batch_invariant", None, "expected true or false, got None"),
    ("model.format", "safetensors", "expected one of 'auto', 'hf', 'gguf', got 'safetensors'"),
    ("model.dtype", "fp16", "expected one of 'auto', 'f32', 'f16', 'bf16', got 'fp16'"),
    ("model.path", "", "expected a non-empty string, got ''"),
    ("model.path", 7, "expected a non-empty string, got 7"),
    ("backend.name", None, "expected a non-empty string, got None"),
    ("backend.threads", 0, "expected a positive int or null, got 0"),
    ("backend.threads", False, "expected a positive int or null, got False"),
    ("backend.force_reference", "linear", "expected a list of non-empty op names, got 'linear'"),
    ("backend.force_reference", [""], "expected a list of non-empty op names, got ['']"),
    ("generation.prompt", 3, "expected a string, got 3"),
    ("generation.max_new_tokens", 0, "expected a positive int, got 0"),
    ("generation.temperature", -0.1, "expected a number >= 0 (0 = greedy), got -0.1"),
    ("generation.temperature", "hot", "expected a number >= 0 (0 = greedy), got 'hot'"),
    ("generation.temperature", True, "expected a number >= 0 (0 = greedy), got True"),
    ("generation.temperature", math.nan, "expected a number >= 0 (0 = greedy), got nan"),
    ("generation.temperature", math.inf, "expected a number >= 0 (0 = greedy), got inf"),
    ("generation.top_p", 0, "expected a number in (0, 1], got 0.0"),
    ("generation.top_p", 1.5, "expected a number in (0, 1], got 1.5"),
    ("generation.top_k", -2, "expected an int >= -1 (0 or -1 disables), got -2"),
    ("generation.top_k", 4.0, "expected an int >= -1 (0 or -1 disables), got 4.0"),
    ("generation.min_p", 1.5, "expected a number in [0, 1], got 1.5"),
    ("generation.repetition_penalty", 0, "expected a number > 0, got 0.0"),
    ("generation.presence_penalty", 2.5, "expected a number in [-2, 2], got 2.5"),
    ("generation.frequency_penalty", -3, "expected a number in [-2, 2], got -3.0"),
    ("generation.seed", -1, "expected an int in [0, 2**64) or null, got -1"),
    ("generation.seed", 2**64, f"expected an int in [0, 2**64) or null, got {2**64}"),
    ("generation.stop", "\n", "expected a list of at most 16 non-empty strings, got '\\n'"),
    ("generation.stop", [""], "expected a list of at most 16 non-empty strings, got ['']"),
    (
        "generation.stop",
        ["x"] * 17,
        "expected a list of at most 16 non-empty strings, got ['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', ...]",
    ),
    ("generation.stop_token_ids", [-1], "expected a list of token ids (ints >= 0), got [-1]"),
    ("generation.stop_token_ids", [True], "expected a list of token ids (ints >= 0), got [True]"),
    ("generation.add_bos", "yes", "expected true, false or null, got 'yes'"),
    ("server.host", "", "expected a non-empty string, got ''"),
    ("server.port", 0, "expected an int in 1..65535, got 0"),
    ("server.port", 65536, "expected an int in 1..65535, got 65536"),
    ("server.port", "8000", "expected an int in 1..65535, got '8000'"),
    ("server.served_model_name", "", "expected a non-empty string or null, got ''"),
    ("backend.device", -1, "expected an int >= 0 or null, got -1"),
    ("backend.device", "cuda:1", "expected an int >= 0 or null, got 'cuda:1'"),
    ("parallel.tensor", 0, "expected a positive int, got 0"),
    ("parallel.pipeline", "2", "expected a positive int, got '2'"),
    ("parallel.data", True, "expected a positive int, got True"),
    ("parallel.timeout_s", 0, "expected a number > 0, got 0.0"),
    ("parallel.startup_timeout_s", -1, "expected a number > 0, got -1.0"),
]


@pytest.mark.parametrize(("dotted", "value", "message"), BAD_VALUES, ids=[f"{d}={v!r}"[:60] for d, v, _ in BAD_VALUES])
def test_bad_value_names_its_key_path(base: dict[str, Any], dotted: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict(_with(base, dotted, value))
    assert exc.value.path == dotted
    assert str(exc.value) == f"{dotted}: {message}"


@pytest.mark.parametrize(
    ("dotted", "suggestion"),
    [
        ("runtime.kv_cache.blok_size", "block_size"),
        ("generation.temprature", "temperature"),
        ("runtime.max_num_seq", "max_num_seqs"),
        ("serverr", "server"),
        ("backend.force_refrence", "force_reference"),
    ],
)
def test_unknown_key_suggests_the_close_one(base: dict[str, Any], dotted: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict(_with(base, dotted, 1))
    assert exc.value.path == dotted
    assert f"did you mean {suggestion!r}?" in str(exc.value)


def test_unknown_key_lists_valid_keys(base: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict(_with(base, "runtime.kv_cache.zzz", 1))
    assert str(exc.value) == "runtime.kv_cache.zzz: unknown key 'zzz'; valid keys: block_size, dtype, num_blocks"


@pytest.mark.parametrize(
    ("data_patch", "path", "fragment"),
    [
        ({"model": None}, "model.path", "required key is missing"),
        ({"model": {"format": "hf"}}, "model.path", "required key is missing"),
        ({"model": "x"}, "model", "expected a mapping of keys, got 'x'"),
        ({"runtime": 5}, "runtime", "expected a mapping of keys, got 5"),
        ({"runtime": {"kv_cache": [16]}}, "runtime.kv_cache", "expected a mapping of keys"),
        ({"schema_version": "1"}, "schema_version", "expected an int >= 0, got '1'"),
        ({"schema_version": True}, "schema_version", "expected an int >= 0, got True"),
    ],
)
def test_bad_shapes_name_their_path(base: dict[str, Any], data_patch: dict, path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict({**base, **data_patch})
    assert exc.value.path == path
    assert fragment in str(exc.value)


def test_missing_model_section() -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"schema_version": 1})
    assert exc.value.path == "model"


def test_missing_model_path_names_the_resolved_path(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("schema_version: 1\nmodel:\n  path: nowhere/ckpt\n")
    with pytest.raises(ConfigError) as exc:
        load_config(cfg_file)
    assert exc.value.path == "model.path"
    assert str(tmp_path / "nowhere" / "ckpt") in str(exc.value)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_format_that_contradicts_the_path(ckpt_dir: Path, gguf_file: Path, fmt: str) -> None:
    wrong = gguf_file if fmt == "hf" else ckpt_dir
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"model": {"path": str(wrong), "format": fmt}})
    assert exc.value.path == "model.format"
    assert str(wrong) in str(exc.value)


def test_newer_schema_version_names_both_numbers(base: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict({**base, "schema_version": SCHEMA_VERSION + 1})
    assert exc.value.path == "schema_version"
    assert f"schema_version {SCHEMA_VERSION + 1}" in str(exc.value)
    assert f"schema_version {SCHEMA_VERSION} and older" in str(exc.value)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("model:\n  path: x\n bad: [\n", "line 3"),
        ("model:\n  path: x\nmodel:\n  path: y\n", "line 3"),  # duplicate key
    ],
)
def test_yaml_errors_name_file_and_line(tmp_path: Path, text: str, where: str) -> None:
    cfg_file = tmp_path / "broken.yaml"
    cfg_file.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(cfg_file)
    assert str(cfg_file) in str(exc.value) and where in str(exc.value)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just text\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(text)
    with pytest.raises(ConfigError, match="expected a mapping of config sections"):
        load_config(cfg_file)


def test_unreadable_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file .*absent.yaml"):
        load_config(tmp_path / "absent.yaml")


def test_no_cattrs_exception_group_escapes(base: dict[str, Any]) -> None:
    # Two bad keys: the user still gets one ConfigError, not a cattrs ExceptionGroup.
    data = _with(_with(base, "runtime.max_num_seqs", "x"), "server.port", "y")
    with pytest.raises(ConfigError) as exc:
        config_from_dict(data)
    assert type(exc.value) is ConfigError
    assert exc.value.path in ("runtime.max_num_seqs", "server.port")


def test_spec_imports_neither_torch_nor_upper_layers() -> None:
    code = (
        "import sys\n"
        "import zllm.spec.config, zllm.spec.migrations, zllm.spec.request\n"
        "bad = [m for m in sys.modules if m == 'torch' or (m.startswith('zllm.') and not m.startswith('zllm.spec'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- property: any valid dict structures and round-trips -----------------------------------

_ints_or_null = st.none() | st.integers(1, 10**6)
_number = st.floats(allow_nan=False, allow_infinity=False)
_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)


def _optional_keys(**fields: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    """A dict holding any subset of ``fields`` (an omitted key takes the default)."""
    return st.fixed_dictionaries({}, optional=fields)


_generation = _optional_keys(
    prompt=st.text(max_size=20),
    max_new_tokens=st.integers(1, 10**6),
    temperature=st.integers(0, 5) | _number.filter(lambda x: x >= 0),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(-1, 1000),
    min_p=st.floats(0, 1),
    repetition_penalty=st.floats(min_value=0, exclude_min=True, allow_infinity=False),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.integers(-2, 2) | st.floats(-2, 2),
    seed=st.none() | st.integers(0, 2**64 - 1),
    stop=st.lists(_names, max_size=16),
    stop_token_ids=st.lists(st.integers(0, 2**31)),
    add_bos=st.none() | st.booleans(),
)


@st.composite
def valid_configs(draw: st.DrawFn, ckpt_dir: Path, gguf_file: Path) -> dict[str, Any]:
    path, fmt = draw(
        st.sampled_from([(ckpt_dir, "auto"), (ckpt_dir, "hf"), (gguf_file, "auto"), (gguf_file, "gguf")])
    )
    data: dict[str, Any] = {"schema_version": draw(st.sampled_from([0, 1])), "model": {"path": str(path)}}
    data["model"].update(
        draw(_optional_keys(format=st.just(fmt), dtype=st.sampled_from(["auto", "f32", "f16", "bf16"])))
    )
    sections = _optional_keys(
        backend=_optional_keys(
            name=_names, threads=_ints_or_null, force_reference=st.lists(_names, max_size=4)
        ),
        runtime=_optional_keys(
            kv_cache=_optional_keys(block_size=st.integers(1, 1024), num_blocks=_ints_or_null),
            max_num_seqs=st.integers(1, 512),
            max_prefill_tokens=st.integers(1, 10**5),
            context_length=_ints_or_null,
            prefix_cache_seqs=st.integers(0, 64),
        ),
        generation=_generation,
        server=_optional_keys(
            host=_names, port=st.integers(1, 65535), served_model_name=st.none() | _names
        ),
    )
    data.update(draw(sections))
    return data


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_valid_dict_structures_and_round_trips(data: st.DataObject, ckpt_dir: Path, gguf_file: Path) -> None:
    raw = data.draw(valid_configs(ckpt_dir, gguf_file))
    cfg = config_from_dict(raw)
    assert isinstance(cfg, ZllmConfig)
    as_dict = config_to_dict(cfg)
    assert config_from_dict(as_dict) == cfg
    # Every value the user gave survives (ints given for float keys come back as floats).
    for section in ("backend", "runtime", "generation", "server"):
        for key, value in raw.get(section, {}).items():
            if key == "kv_cache":
                assert as_dict["runtime"]["kv_cache"] == {**as_dict["runtime"]["kv_cache"], **value}
            else:
                assert as_dict[section][key] == value


# --- speculative.draft.model: a model section at its own key path --------------------------


def test_draft_model_path_is_resolved_against_the_file_and_round_trips(tmp_path: Path) -> None:
    for name in ("target", "draft"):
        (tmp_path / "models" / name).mkdir(parents=True)
    (tmp_path / "conf").mkdir()
    cfg_file = tmp_path / "conf" / "x.yaml"
    cfg_file.write_text(
        "schema_version: 1\nmodel: {path: ../models/target}\n"
        "speculative:\n  method: draft\n  num_tokens: 3\n  draft:\n    model: {path: ../models/draft, dtype: f16}\n"
    )
    cfg = load_config(cfg_file)
    draft = cfg.speculative.draft.model
    assert draft is not None and (draft.path, draft.format, draft.dtype) == (str(tmp_path / "models" / "draft"),
                                                                            "hf", "f16")
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_a_draft_model_is_optional_for_other_methods(base: dict[str, Any]) -> None:
    assert config_from_dict({**base, "speculative": {"method": "ngram"}}).speculative.draft.model is None


BAD_DRAFT = [
    # (the speculative section, the key path named, a fragment of the message)
    ({"method": "draft"}, "speculative.draft.model", "required key is missing (speculative.method is draft)"),
    ({"method": "draft", "draft": {"model": None}}, "speculative.draft.model", "required key is missing"),
    ({"method": "draft", "draft": {"model": {"pth": "x"}}}, "speculative.draft.model.pth",
     "unknown key 'pth'; did you mean 'path'?"),
    ({"method": "draft", "draft": {"model": {"dtype": "f16"}}}, "speculative.draft.model.path",
     "required key is missing"),
    ({"method": "draft", "draft": {"model": {"path": "CKPT", "dtype": "f64"}}}, "speculative.draft.model.dtype",
     "expected one of 'auto', 'f32', 'f16', 'bf16', got 'f64'"),
    ({"method": "draft", "draft": {"model": {"path": "CKPT", "format": "gguf"}}}, "speculative.draft.model.format",
     "needs a .gguf file"),
    ({"method": "draft", "draft": {"model": {"path": "/nonexistent/draft"}}}, "speculative.draft.model.path",
     "/nonexistent/draft does not exist"),
    ({"method": "draft", "draft": {"model": 5}}, "speculative.draft.model", "expected a mapping of keys, got 5"),
    ({"method": "draft", "draft": {"modle": {}}}, "speculative.draft.modle", "did you mean 'model'?"),
]


@pytest.mark.parametrize(("section", "path", "fragment"), BAD_DRAFT, ids=[p for _, p, _ in BAD_DRAFT])
def test_bad_draft_model_names_its_key_path(base: dict[str, Any], ckpt_dir: Path, section: dict, path: str,
                                            fragment: str) -> None:
    model = section.get("draft", {}).get("model")
    if isinstance(model, dict) and model.get("path") == "CKPT":
        model["path"] = str(ckpt_dir)
    with pytest.raises(ConfigError) as exc:
        config_from_dict({**base, "speculative": section})
    assert exc.value.path == path
    assert fragment in str(exc.value)


def test_the_target_model_section_keeps_its_key_path_beside_a_draft(ckpt_dir: Path) -> None:
    speculative = {"method": "draft", "draft": {"model": {"path": str(ckpt_dir)}}}
    for model, path in (({"path": str(ckpt_dir), "dtype": "f64"}, "model.dtype"), ({"pth": "x"}, "model.pth"),
                        ({"path": "/nonexistent/target"}, "model.path")):
        with pytest.raises(ConfigError) as exc:
            config_from_dict({"model": model, "speculative": speculative})
        assert exc.value.path == path


def test_parallel_ranks_refuse_speculative_decoding_naming_both_keys(base: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict({**base, "parallel": {"tensor": 2}, "speculative": {"method": "ngram"}})
    assert exc.value.path == "parallel.tensor"
    assert "speculative.method: ngram" in str(exc.value)
    assert config_from_dict({**base, "parallel": {"data": 2}, "speculative": {"method": "ngram"}}).parallel.data == 2
