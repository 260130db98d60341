"""`profiling.profile`: a decode step's time split by category, which adds up to the step."""

from __future__ import annotations

import json

import pytest
import torch

from minigen import GenerationConfig
from minigen.measure import profiling
from minigen.__main__ import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_categories_add_up_to_the_measured_step(smollm2, english_text_ids):
    """The profiled categories (rest included) sum to the step timed without the profiler, within
    15%: the profiler's own cost and a busy neighbour are the only gap. Timing on a shared two-core
    machine is noisy: next to a busy loop, 1 try in 8 landed 20% off (measured), and a make test run
    with a busy neighbour failed two tries in a row at +26%. So four tries are allowed; a real gap (an
    op counted twice, a category lost) shows on every try."""
    model, _ = smollm2
    ids = english_text_ids[None, :48]
    for attempt in range(4):
        p = profiling.profile(model, ids, steps=6)
        total = sum(p.categories.values())
        if abs(total - p.step_s) <= 0.15 * p.step_s:
            break
    assert abs(total - p.step_s) <= 0.15 * p.step_s, (total, p.step_s, p.categories)
    assert list(p.categories) == list(profiling.CATEGORY_NAMES)
    # batch 1 on the CPU: the C matvec (no op of its own in eager mode) is counted as matrix products,
    # and they are most of a step: 135M weights read per token
    c = p.categories
    assert c["matrix products"] > 0.4 * total and c["matrix products"] > c["rest"], c
    raw = p.profiled_categories  # before the profiler's cost per event is taken off
    assert all(raw[k] > 0 for k in ("attention", "norms", "RoPE", "cache update", "sampling")), raw
    assert abs(sum(raw.values()) - p.profiled_step_s) < 1e-9


def test_each_cache_strategy_is_profiled_and_its_update_counted(tiny_llama, tmp_path):
    _, model = tiny_llama
    ids = torch.arange(1, 20)[None]
    for config in (GenerationConfig(cache_chunk_size=4), GenerationConfig(quant_bits=4, quant_group_size=8),
                   GenerationConfig(window_size=8, sink_tokens=2)):
        p = profiling.profile(model, ids, config, steps=3, trace=tmp_path / "trace.json")
        raw = p.profiled_categories  # a tiny model's ops are mostly the profiler's cost: look before it is taken off
        assert raw["cache update"] > 0 and raw["matrix products"] > 0 and raw["norms"] > 0, (config, raw)
        assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
        # the memory timeline: one row per new token, the cache's bytes as generate reports them
        assert [r["token"] for r in p.memory_timeline] == [0, 1, 2]
        assert all(r["kv_cache_bytes"] > 0 for r in p.memory_timeline)


def test_a_compiled_step_is_profiled(tiny_llama):
    """compile=True: the fused kernels have no Python stack; they are counted as fused, not lost."""
    _, model = tiny_llama
    p = profiling.profile(model, torch.arange(1, 9)[None], GenerationConfig(compile=True), steps=3)
    assert set(profiling.CATEGORY_NAMES) <= set(p.categories) and p.config["compile"]
    assert abs(sum(p.profiled_categories.values()) - p.profiled_step_s) < 1e-9
    assert p.profiled_categories[profiling.FUSED] > 0, p.profiled_categories


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
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["step_s"] > 0 and set(profiling.CATEGORY_NAMES) <= set(data["categories"])
    assert (tmp_path / "minigen-trace.json").exists()
