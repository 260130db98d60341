"""Generation over tensor-parallel ranks from one call (parallel/launch.py), `minigen generate --tp N`,
what the ranks exchange (counted against the prediction), and what refuses a sharded model.

A tiny Llama folder (12 query heads, 6 key/value heads, MLP 96, 2 layers: every size divides by 2 and
3) is split over 2 ranks, each a spawned process on 127.0.0.1 that loads its shard with
minigen.load(..., tp_size=2), as the command does."""

from __future__ import annotations

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import GenerationConfig
from minigen.__main__ import main
from minigen.errors import ConfigError
from minigen.parallel import launch, shard_model
from test_loading import save_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
SPLITTABLE = dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=6, intermediate_size=96)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tp")
    tiny_hf("llama", **SPLITTABLE).save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


def test_ranks_agree_with_one_process_and_exchange_what_was_predicted(folder):
    """Two ranks write one process's greedy tokens; each decode step runs 2 all-reduces a layer of
    [B, 1, D] fp32, the prompt's forward 2 a layer of [B, T, D]; a rank holds half the heads' cache."""
    model, _ = minigen.load(str(folder))
    ids = torch.tensor([[5, 17, 42, 8, 63, 21, 9]])
    config = GenerationConfig(max_new_tokens=6, stop_token_ids=[])
    alone = minigen.generate(model, ids, config)
    out = launch.generate_over_ranks(str(folder), ids, config, 2, timeout=120)
    assert torch.equal(out.tokens, alone.tokens)
    L, D, T = model.config.n_layers, model.config.dim, ids.shape[1]
    for r in out.ranks:
        assert r["all_reduces"] == {"count": 2 * L * 5, "bytes": 2 * L * 5 * D * 4, "seconds": r["all_reduces"]["seconds"]}
        assert r["prompt_all_reduces"]["count"] == 2 * L and r["prompt_all_reduces"]["bytes"] == 2 * L * T * D * 4
        assert r["decode_steps"] == 5 and r["new_tokens"] == 6
        assert (r["n_heads"], r["n_kv_heads"], r["hidden_dim"]) == (6, 3, 48)
        assert r["kv_cache_bytes"] * 2 == alone.stats.kv_cache_bytes
        assert "one of 2 ranks (gloo" in r["plan"] and "6 of 12 query heads" in r["plan"]
    assert "12 all-reduces a token" not in launch.ranks_line(out) and "4 all-reduces a token" in launch.ranks_line(out)


def test_the_command_prints_the_same_text_over_ranks(folder, capsys):
    argv = ["generate", "w5 w17 w42 w8", "--model", str(folder), "--max-new-tokens", "5", "--set", "stop_token_ids=[]"]
    assert main(argv) == 0
    one = capsys.readouterr().out
    assert main(argv + ["--tp", "2", "--explain"]) == 0
    out = capsys.readouterr()
    assert out.out == one and "tensor parallel over 2 ranks" in out.err and "all-reduces a token" in out.err


def test_a_size_that_does_not_split_the_model_is_refused_before_any_rank_starts(folder, monkeypatch, capsys):
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("ranks started before the check"))
    assert main(["generate", "w5 w17", "--model", str(folder), "--tp", "5"]) == 2
    assert "tp_size=5 does not divide" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="tp_size=0 is invalid"):
        launch.generate_over_ranks(str(folder), torch.tensor([[1, 2]]), GenerationConfig(), 0)


def test_the_engine_refuses_a_sharded_model_with_the_reason(folder):
    model, _ = minigen.load(str(folder))
    shard_model(model, 0, 2)  # no forward runs, so no process group is needed
    with pytest.raises(ConfigError, match=r"the serving engine does not run a tensor-parallel model \(tp_size=2\)"):
        minigen.Engine(model)
