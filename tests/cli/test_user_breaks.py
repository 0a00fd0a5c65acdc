"""Command lines a user tried that once gave a traceback, a crash or a misleading message.

Every case runs the real ``zllm`` console script in a subprocess and holds it to the bar
(one ``error:`` line on stderr naming the bad thing, exit status 2), or, for a value that is
only too large, to a ``warning:`` line and a normal run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.cli.conftest import ZLLM, one_line_error, zllm
from tests.conftest import CONFIGS, MODEL_DIR, write_config

HF_CONFIG = CONFIGS / "stories260k-hf.yaml"


def test_prompt_of_bytes_that_are_not_utf8_is_a_one_line_error():
    # argv bytes that are not UTF-8 reach Python as lone surrogates; the tokenizer raised TypeError.
    proc = subprocess.run([*ZLLM, "run", "--config", str(HF_CONFIG), "--prompt", b"a\xff\xfe"],
                          capture_output=True, text=True, timeout=120)
    line = one_line_error(proc)
    assert "generation.prompt" in line and "not valid Unicode text" in line


def test_empty_backend_override_is_rejected_not_ignored():
    line = one_line_error(zllm("run", "--config", HF_CONFIG, "--backend", ""))
    assert "backend.name" in line and "non-empty" in line


def test_more_threads_than_cores_warns_and_runs(tmp_path):
    # torch.set_num_threads(100000) segfaulted (exit 139); 20000 aborted in libgomp.
    cfg = write_config(tmp_path, MODEL_DIR / "hf", backend={"threads": 100000})
    proc = zllm("run", "--config", cfg, "--max-new-tokens", "2")
    assert proc.returncode == 0, proc.stderr
    assert "warning: backend.threads 100000 exceeds the" in proc.stderr
    assert proc.stdout.startswith("Once upon")


def test_family_filtered_out_by_zllm_plugins_says_so():
    # It said "no model family plugin installed" while zllm-model-llama was installed.
    line = one_line_error(zllm("run", "--config", HF_CONFIG, env={"ZLLM_PLUGINS": "cpu"}))
    assert "unknown architecture 'llama'" in line
    assert "llama (zllm-model-llama): filtered: not in ZLLM_PLUGINS" in line


def test_chat_stdin_that_is_not_utf8_under_a_strict_encoding_is_a_one_line_error(tmp_path):
    ckpt = tmp_path / "chat"
    shutil.copytree(MODEL_DIR / "hf", ckpt)
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    cfg = write_config(tmp_path, ckpt, generation={"max_new_tokens": 2})
    proc = subprocess.run([*ZLLM, "run", "--config", str(cfg), "--chat"], input=b"\xff\xfe\n",
                          capture_output=True, timeout=120, env={**_env(), "PYTHONIOENCODING": "utf-8"})
    line = one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(),
                                                      proc.stderr.decode()))
    assert "stdin" in line and "utf-8" in line


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "ZLLM_PLUGINS"}


def test_card_of_a_device_file_does_not_call_it_a_directory():
    line = one_line_error(zllm("card", "/dev/null"))
    assert "/dev/null" in line and "not a regular file" in line


# ----------------------------------------------------------------------- config migrate


def test_config_migrate_of_a_file_that_is_not_utf8_names_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe")
    line = one_line_error(zllm("config", "migrate", bad))  # was UnicodeDecodeError
    assert str(bad) in line and "not UTF-8" in line


def test_config_migrate_to_an_unwritable_output_names_it(tmp_path):
    out = tmp_path / "missing-dir" / "out.yaml"
    line = one_line_error(zllm("config", "migrate", HF_CONFIG, "-o", out))  # was FileNotFoundError
    assert str(out) in line and "cannot write" in line


def test_config_migrate_with_in_place_and_output_is_rejected(tmp_path):
    cfg = tmp_path / "c.yaml"
    shutil.copy(HF_CONFIG, cfg)
    line = one_line_error(zllm("config", "migrate", cfg, "--in-place", "-o", tmp_path / "o.yaml"))
    assert "--in-place" in line and "--output" in line
    assert not (tmp_path / "o.yaml").exists()


# ----------------------------------------------------------------------- compat --verified


def test_compat_verified_file_that_is_not_utf8_or_has_a_non_table_cell(tmp_path):
    binary = tmp_path / "v.toml"
    binary.write_bytes(b"\xff\xfe")
    assert str(binary) in one_line_error(zllm("compat", "--verified", binary))  # was UnicodeDecodeError
    scalar = tmp_path / "w.toml"
    scalar.write_text("cell = [1]\n")
    line = one_line_error(zllm("compat", "--verified", scalar))  # was TypeError
    assert "cell[0]" in line and "[[cell]] table" in line


def test_paths_with_spaces_unicode_and_symlinks_work(tmp_path):
    folder = tmp_path / "my models" / "ünï 模型"
    folder.mkdir(parents=True)
    (folder / "link").symlink_to(MODEL_DIR / "hf")
    cfg = tmp_path / "my models" / "c fg.yaml"
    cfg.write_text('model: {path: "ünï 模型/link"}\n', encoding="utf-8")
    proc = zllm("run", "--config", cfg, "--max-new-tokens", "2", cwd=Path(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon")


def test_usage_mistakes_are_one_error_line_naming_the_flag():
    # argparse printed a multi-line usage block and "zllm run: error: ..." instead.
    line = one_line_error(zllm("run", "--config", HF_CONFIG, "--max-new-tokens", "abc"))
    assert "--max-new-tokens" in line and "'abc'" in line and "zllm run --help" in line
    line = one_line_error(zllm("config"))
    assert "{validate,migrate}" in line
