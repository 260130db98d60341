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


def test_explain_prints_the_plan_before_the_tokens(cli):
    status, out, err = cli("generate", PROMPT, "--max-new-tokens", "3", "--explain")
    assert status == 0 and out.startswith(PROMPT + " Paris")
    plan = err[:err.index("[3 tokens")]
    assert [line.split(":")[0] for line in plan.strip().splitlines()] == ["decode", "prompt", "attention", "KV", "kernels"]
    assert "46,080 bytes a token" in plan  # SmolLM2's fp32 keys and values: 2 x 30 layers x 3 heads x 64 x 4
    naive = cli("generate", PROMPT, "--max-new-tokens", "3", "--no-cache", "--explain")[2]
    assert "the naive loop" in naive and "the naive loop" not in plan


def test_no_cache_gives_the_same_text(cli):
    cached = cli("generate", PROMPT, "--max-new-tokens", "3")
    naive = cli("generate", PROMPT, "--max-new-tokens", "3", "--no-cache")
    assert naive[0] == 0 and naive[1] == cached[1] and "naive step" in naive[2] and "naive step" not in cached[2]


def test_stop_strings_and_structured_output_run_on_the_command_line(cli):
    """The command passes its tokenizer to the plan: a stop string cuts the printed text before it
    (also when it spans tokens), and response_format holds the reply to JSON."""
    whole = cli("generate", PROMPT, "--max-new-tokens", "16")[1]
    assert "2018-01" in whole  # SmolLM2 goes on "Paris.\n\nThe answer is: 2018-01..."
    status, out, _ = cli("generate", PROMPT, "--max-new-tokens", "16", "--set", 'stop=["-01"]')
    assert status == 0 and out.rstrip("\n") == whole[:whole.index("-01")].rstrip("\n")
    status, out, _ = cli("generate", "A person as JSON:", "--max-new-tokens", "40", "--set",
                         'response_format={"type": "json_object"}')
    assert status == 0 and json.loads(out[len("A person as JSON:"):])


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


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny Llama folder with a 97-word tokenizer that has no chat template: runs in milliseconds."""
    from conftest import tiny_hf
    from test_loading import save_tiny_tokenizer
    folder = tmp_path_factory.mktemp("tiny")
    tiny_hf("llama").save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


def run_main(capsys, *argv: str):
    status = main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_chat_without_a_chat_template_exits_2(tiny_folder, capsys):
    status, _, err = run_main(capsys, "generate", "w1 w2", "--model", str(tiny_folder), "--chat")
    assert status == 2 and err.startswith("error: --chat") and "drop --chat" in err and "Traceback" not in err
    status, out, _ = run_main(capsys, "generate", "w1 w2", "--model", str(tiny_folder), "--max-new-tokens", "2")
    assert status == 0 and out.startswith("w1 w2")  # without --chat the same model runs


@pytest.mark.parametrize("argv, fragment", [
    (["--new-tokens", "4"], "--new-tokens >= 8"),  # regression: reported 3,000,000,000 tok/s
    (["--new-tokens", "0"], "--new-tokens >= 8"),  # regression: reported -1e9 tok/s
    (["--repeats", "0"], "--repeats >= 1"),  # regression: a raw statistics error after the run
    (["--prompt-len", "0"], "--prompt-len >= 1"),
    (["--prompt-len", "200"], "exceeds the model's context of 128"),
    (["--set", "do_sample=true"], "greedy decoding"),
])
def test_bad_bench_sizes_exit_2_before_the_run(tiny_folder, capsys, argv, fragment):
    status, _, err = run_main(capsys, "bench", "--model", str(tiny_folder), *argv)
    assert status == 2 and err.startswith("error: ") and fragment in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["missing/bench.json", ".", "ro/bench.json"])
def test_bench_json_that_cannot_be_written_exits_2_before_the_run(tiny_folder, tmp_path, capsys, monkeypatch,
                                                                   where):
    """Regression: the error came after the whole run, whose results were then lost."""
    (tmp_path / "ro").mkdir()
    real = os.access  # a read-only folder, as os.access reports it (root ignores a chmod)
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != tmp_path / "ro" and real(p, mode, **kw))
    monkeypatch.setattr(minigen.measure.bench, "run_bench", lambda *a, **k: pytest.fail("the bench ran first"))
    status, _, err = run_main(capsys, "bench", "--model", str(tiny_folder), "--json", str(tmp_path / where))
    assert status == 2 and err.startswith("error: --json") and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ro"]  # nothing written


def test_bench_json_is_written_whole(tiny_folder, tmp_path, capsys):
    status, out, _ = run_main(capsys, "bench", "--model", str(tiny_folder), "--prompt-len", "8", "--new-tokens",
                              "32", "--repeats", "1", "--no-baseline", "--explain", "--json", str(tmp_path / "bench.json"))
    assert status == 0 and "wrote" in out and "minigen's plan:\n  decode:" in out  # --explain: what ran, in words
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["new_tokens"] == 32 and result["engines"]["minigen"]["decode_tokens_per_s"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no temporary file left beside it


@pytest.mark.slow
def test_bench_response_format_times_the_mask_beside_the_plain_step(smollm2, tmp_path, capsys):
    """bench --response-format: minigen under the schema's mask and minigen without it, side by side in
    one run; the masked reply is the schema's JSON (the mask then allows only the stop token)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "year": {"type": "integer"}},
              "required": ["city", "year"], "additionalProperties": False}
    (tmp_path / "city.json").write_text(json.dumps(schema))
    status, out, _ = run_main(capsys, "bench", "--response-format", str(tmp_path / "city.json"), "--prompt-len", "16",
                              "--new-tokens", "24", "--repeats", "1", "--no-baseline", "--json", str(tmp_path / "b.json"))
    assert status == 0 and "minigen / minigen unmasked decode" in out and "from llguidance" in out
    result = json.loads((tmp_path / "b.json").read_text())
    assert set(result["engines"]) == {"minigen unmasked", "minigen"} and not result["exact"]
    assert 0 < result["structured"]["reply_tokens"] <= 24 and result["structured"]["speedup_vs_unmasked"] > 0
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    status, _, err = run_main(capsys, "bench", "--response-format", str(bad))
    assert status == 2 and "is not a JSON file" in err and "Traceback" not in err


def test_prepare_into_an_unwritable_cache_exits_2(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path / "file"))
    status, _, err = run_main(capsys, "prepare")
    assert status == 2 and "MINIGEN_CACHE" in err and "is a file" in err and "Traceback" not in err


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


@pytest.mark.parametrize("command", [["generate", PROMPT], ["bench"], ["profile"]])
def test_an_unknown_set_key_gets_the_configs_did_you_mean_before_the_model_loads(command, monkeypatch, capsys):
    """Issue 13's bad input, for every command that takes --set: the config's suggestion, exit 2, and no
    model loaded (a typo costs no time)."""
    monkeypatch.setattr(minigen, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    status, _, err = run_main(capsys, *command, "--set", "windw_size=64")
    assert status == 2 and "Did you mean 'window_size'?" in err and "Traceback" not in err, err
