"""`python -m minigen`: generate and prepare, and clean one-line errors with exit status 2.

Most cases call `main(argv)` in-process with `minigen.load` patched to return the session's
SmolLM2, so no test reloads the model; two subprocess runs prove the real entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import minigen
from minigen.__main__ import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


@pytest.fixture
def cli(smollm2, monkeypatch, capsys):
    """Run main(argv) with the shared model -> (exit status, stdout, stderr)."""
    monkeypatch.setattr(minigen, "load", lambda *args, **kwargs: smollm2)

    def run(*argv: str):
        status = main(list(argv))
        out = capsys.readouterr()
        return status, out.out, out.err
    return run


def test_generate_prints_the_continuation_and_stats(cli):
    status, out, err = cli("generate", PROMPT, "--max-new-tokens", "3")
    assert status == 0
    assert out.startswith(PROMPT + " Paris")
    assert "[3 tokens" in err and "KV cache" in err and "tok/s" in err


def test_no_cache_gives_the_same_text(cli):
    cached = cli("generate", PROMPT, "--max-new-tokens", "3")
    naive = cli("generate", PROMPT, "--max-new-tokens", "3", "--no-cache")
    assert naive[0] == 0 and naive[1] == cached[1] and "naive recompute" in naive[2]


def test_config_file_and_flag_override(cli, tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"max_new_tokens": 2}))
    assert "[2 tokens" in cli("generate", PROMPT, "--config", str(path))[2]
    assert "[3 tokens" in cli("generate", PROMPT, "--config", str(path), "--max-new-tokens", "3")[2]


@pytest.mark.parametrize("argv, fragment", [
    (["--max-new-tokens", "-1"], "max_new_tokens=-1"),
    (["--temperature", "0"], "temperature=0"),
    (["--set", "max_new_token=3"], "Did you mean 'max_new_tokens'?"),
    (["--set", "max_new_tokens"], "KEY=VALUE"),
])
def test_bad_flags_exit_2_with_one_line(cli, argv, fragment):
    status, out, err = cli("generate", PROMPT, *argv)
    assert status == 2 and err.startswith("error: ") and fragment in err and "Traceback" not in err


def test_bad_config_file_exits_2(cli, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"max_new_tokens": 3,}')
    status, _, err = cli("generate", PROMPT, "--config", str(path))
    assert status == 2 and "not valid JSON" in err


def test_empty_prompt_exits_2(cli):
    status, _, err = cli("generate", "   ")
    assert status == 2 and "prompt is empty" in err


def test_prepare_prints_the_folder(cli):
    status, out, _ = cli("prepare")
    assert status == 0 and Path(out.strip()) == minigen.loading.prepare_default()
    assert (Path(out.strip()) / "config.json").exists()


def run_module(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "minigen", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_python_dash_m_generate(smollm2):
    done = run_module("generate", PROMPT, "--max-new-tokens", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(PROMPT + " Paris")


def test_python_dash_m_error_has_no_traceback(tmp_path):
    done = run_module("generate", PROMPT, "--config", str(tmp_path / "missing.json"))
    assert done.returncode == 2
    assert done.stderr.startswith("error: cannot read config file") and "Traceback" not in done.stderr
