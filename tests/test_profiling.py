"""`profiling.profile`: a decode step's time split by category, which adds up to the step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from minigen import GenerationConfig
from minigen.measure import profiling
from minigen.__main__ import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _check_the_sum(p: profiling.Profile) -> None:
    """The categories, as the profiler timed them, add up to the wall time of the same profiled steps."""
    total = sum(p.categories.values())
    assert list(p.categories) == list(profiling.CATEGORY_NAMES)
    # rest is not clamped: an op counted in two categories (or twice in one) makes it negative
    assert all(s >= 0 for s in p.categories.values()), p.categories
    # the same steps on two clocks (the profiler's step ranges, perf_counter around the loop): within
    # 0.6% in each of 10 single runs quiet and 10 next to a busy loop, on the 2-core machine shared by six
    # (load ~10). The margin is for a preemption between two steps, outside every range.
    assert abs(total - p.profiled_step_s) <= 0.10 * p.profiled_step_s, (total, p.profiled_step_s, p.categories)
    # batch 1 on the CPU: the C matvec (no op of its own in eager mode) is counted as matrix products,
    # and they are most of a step: 135M weights read per token
    c = p.categories
    assert c["matrix products"] > 0.4 * total and c["matrix products"] > c["rest"], c
    assert all(c[k] > 0 for k in ("attention", "norms", "RoPE", "cache update", "sampling")), c
    assert p.step_s > 0 and p.events_per_step > 1000, (p.step_s, p.events_per_step)


def test_every_layer_is_attributed_once_per_step(smollm2, english_text_ids):
    """Issue 26 read attention at 0.05 ms for 30 layers in an older figure: a category whose function was
    not wrapped (or wrapped twice) shows in its count of ranges, which a clock cannot hide. SmolLM2's step:
    one attention, one RoPE call and two norms a layer, the final norm, one sampling."""
    model, _ = smollm2
    p = profiling.profile(model, english_text_ids[None, :48], steps=2)
    L = model.config.n_layers
    # attention: each layer's, and the step's mask built once (model.causal_mask, also attention's)
    assert L <= p.calls["attention"] <= L + 1 and p.calls["RoPE"] == L, p.calls
    assert p.calls["norms"] == 2 * L + 1 and p.calls["sampling"] == 1, p.calls
    assert p.calls["cache update"] >= L and p.calls["matrix products"] >= 4 * L, p.calls
    # and attention's time is a layer's worth, not a rounding error: over 1% of the step at 48+ positions
    assert p.categories["attention"] > 0.01 * p.profiled_step_s, p.categories


def test_the_categories_add_up_to_the_profiled_step(smollm2, english_text_ids):
    """One run, no retries: the categories are compared with the very steps they came from, not with
    steps timed at another moment (which missed by +2% to +26% in single runs, issue 25)."""
    model, _ = smollm2
    _check_the_sum(profiling.profile(model, english_text_ids[None, :48], steps=6))


def test_the_sum_holds_next_to_a_busy_loop(smollm2, english_text_ids):
    """A second process spinning on a core: the profiled steps slow down, and the categories with them
    (the old comparison with the unprofiled step missed by 44% next to other work)."""
    model, _ = smollm2
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _check_the_sum(profiling.profile(model, english_text_ids[None, :48], steps=6))
    finally:
        spinner.kill()
        spinner.wait()


def test_each_cache_strategy_is_profiled_and_its_update_counted(tiny_llama, tmp_path):
    _, model = tiny_llama
    ids = torch.arange(1, 20)[None]
    for config in (GenerationConfig(cache_chunk_size=4), GenerationConfig(quant_bits=4, quant_group_size=8),
                   GenerationConfig(window_size=8, sink_tokens=2)):
        p = profiling.profile(model, ids, config, steps=3, trace=tmp_path / "trace.json")
        c = p.categories
        assert c["cache update"] > 0 and c["matrix products"] > 0 and c["norms"] > 0, (config, c)
        assert all(s >= 0 for s in c.values()), (config, c)
        assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
        # the memory timeline: one row per new token, the cache's bytes as generate reports them
        assert [r["token"] for r in p.memory_timeline] == [0, 1, 2]
        assert all(r["kv_cache_bytes"] > 0 for r in p.memory_timeline)


def test_a_compiled_step_is_profiled(tiny_llama):
    """compile=True: the fused kernels have no Python stack; they are counted as fused, not lost."""
    _, model = tiny_llama
    p = profiling.profile(model, torch.arange(1, 9)[None], GenerationConfig(compile=True), steps=3)
    assert set(profiling.CATEGORY_NAMES) <= set(p.categories) and p.config["compile"]
    assert all(s >= 0 for s in p.categories.values()), p.categories
    assert p.categories[profiling.FUSED] > 0, p.categories


def test_the_command_writes_json_and_a_trace(tmp_path, capsys, monkeypatch):
    """`python -m minigen profile` on a tiny folder: the JSON has step_s and every category."""
    from conftest import tiny_hf
    from test_loading import save_tiny_tokenizer
    folder = tmp_path / "tiny"
    tiny_hf("llama").save_pretrained(folder)
    save_tiny_tokenizer(folder)
    monkeypatch.chdir(tmp_path)
    rc = main(["profile", "--model", str(folder), "--steps", "2", "--prompt-len", "8", "--json", "p.json",
               "--set", "cache_chunk_size=4"])
    out = capsys.readouterr().out
    assert rc == 0 and "matrix products" in out
    assert "under the profiler" in out and "without it" in out  # both figures, as in the JSON
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["step_s"] > 0 and data["profiled_step_s"] > 0
    assert set(profiling.CATEGORY_NAMES) <= set(data["categories"])
    assert (tmp_path / "minigen-trace.json").exists()
