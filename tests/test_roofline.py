"""The roofline's counts: parameters against the model itself, intensities against a hand count,
and the rules of thumb the chapter states (decode at batch 1 is ~1 FLOP/byte with 2-byte weights)."""

from __future__ import annotations

import math

import pytest
import torch

from minigen.measure import roofline as rl
from minigen.model import Model


@pytest.mark.parametrize("name", sorted(rl.SHAPES))
def test_n_params_counts_the_model_built_on_the_meta_device(name):
    with torch.device("meta"):
        model = Model(rl.SHAPES[name])
    assert rl.n_params(rl.SHAPES[name]) == sum(p.numel() for p in model.parameters())


def test_smollm2_decode_point_against_a_hand_count():
    # SmolLM2-135M: D 576, 30 layers, 9 heads and 3 KV heads of 64, MLP 1,536, vocabulary 49,152, tied head.
    # Per layer and token: q/k/v 2·576·(9+6)·64 = 1,105,920; output 2·576·576 = 663,552;
    # gate/up/down 3·2·576·1,536 = 5,308,416; attention over 1,024 keys 2·2·1,024·9·64 = 2,359,296.
    per_layer = 1_105_920 + 663_552 + 5_308_416 + 2_359_296
    flops = 30 * per_layer + 2 * 576 * 49_152  # + the head over the vocabulary
    # Bytes, bf16: every parameter (the tied head reads the whole embedding) + the KV of 1,024 tokens,
    # 2 (K, V) x 30 layers x 3 heads x 64 x 2 bytes = 23,040 bytes per token.
    nbytes = 134_515_008 * 2 + 1024 * 23_040
    p = rl.decode_point(rl.SMOLLM2_135M, batch=1, context=1024)
    assert (p.flops, p.bytes) == (flops, nbytes) == (339_738_624, 292_622_976)
    assert p.intensity == pytest.approx(1.161, abs=1e-3)
    p8 = rl.decode_point(rl.SMOLLM2_135M, batch=8, context=1024)  # 8x the FLOPs, the weights read once
    assert (p8.flops, p8.bytes) == (8 * flops, 134_515_008 * 2 + 8 * 1024 * 23_040)


@pytest.mark.parametrize("name", ["Llama-2-7B", "Llama-2-70B", "GPT-3 175B"])
def test_decode_intensity_is_about_batch_times_two_over_bytes_per_weight(name):
    cfg = rl.SHAPES[name]
    # batch 1, a short context: 2 FLOPs per weight read -> 1 FLOP/byte at 2 bytes a weight, 4 at half a byte
    assert rl.decode_point(cfg, 1, 16).intensity == pytest.approx(1.0, rel=0.05)
    assert rl.decode_point(cfg, 1, 16, weight_bytes=0.5, kv_bytes=0.5).intensity == pytest.approx(4.0, rel=0.05)
    for batch in (8, 64):  # each weight read once serves the whole batch
        assert rl.decode_point(cfg, batch, 1).intensity == pytest.approx(batch, rel=0.05)
    # a long context adds KV bytes that no batch shares: intensity falls below the batch size
    assert rl.decode_point(cfg, 64, 4096).intensity < 0.8 * 64


def test_decode_sits_left_of_every_gpus_ridge_and_prefill_right():
    for cfg in (rl.SMOLLM2_135M, rl.LLAMA2_7B, rl.LLAMA2_70B):
        for gpu in rl.GPUS:
            assert rl.decode_point(cfg, 64, 1024).intensity < gpu.ridge < rl.prefill_point(cfg, 1, 2048).intensity


def test_gpu_ceilings_are_dense_bf16_spec_numbers():
    assert rl.A100_80GB.peak_flops == 312e12 and rl.A100_80GB.bandwidth == 2.039e12  # not 624 (sparse)
    assert rl.H100_SXM.peak_flops == rl.H200_SXM.peak_flops == 989e12  # half of 1,979 (sparse)
    assert (rl.H100_SXM.bandwidth, rl.H200_SXM.bandwidth) == (3.35e12, 4.8e12)
    assert all(g.precision == "bf16" and "http" in g.source for g in rl.GPUS)
    assert rl.A100_80GB.ridge == pytest.approx(153, abs=1)


def test_tokens_per_s_is_bandwidth_over_bytes_when_memory_bound():
    p = rl.decode_point(rl.LLAMA2_7B, 1, 1024)
    assert rl.tokens_per_s(rl.A100_80GB, p) == pytest.approx(2.039e12 / p.bytes)
    big = rl.prefill_point(rl.LLAMA2_7B, 1, 2048)  # compute-bound: FLOPs over the peak
    assert rl.tokens_per_s(rl.A100_80GB, big) == pytest.approx(2048 / (big.flops / 312e12))
    assert rl.A100_80GB.attainable(1.0) == 2.039e12 and rl.A100_80GB.attainable(1e4) == 312e12


def test_cpu_ceiling_is_measured():
    flops = rl.matmul_flops(n=256, threads=1, repeats=2)
    assert math.isfinite(flops) and flops > 1e8  # any CPU of the last 20 years does 0.1 GFLOP/s
    assert torch.get_num_threads() >= 1


def test_format_peaks_measures_each_format_this_torch_multiplies():
    peaks = rl.format_peaks(threads=1, n=128, repeats=2)
    assert "float32" in peaks and set(peaks) <= {"float32", "bfloat16", "int8"}
    assert all(math.isfinite(r) and r > 0.01 for r in peaks.values()), peaks  # multiply-adds per ns
    assert torch.get_num_threads() >= 1


def test_roofline_points_cover_prefill_and_decode_at_each_batch():
    points = rl.roofline_points()
    assert len(points) == 3 * 3 * 2
    labels = {(name, p.label) for name, p in points}
    assert ("Llama-2-70B", "decode B=64") in labels and ("SmolLM2-135M", "prefill B=1") in labels


def test_chapter_12_plots_draw_what_they_are_given():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minigen.measure import article_bench
    from minigen.course import plots
    from minigen.measure.profiling import CATEGORY_NAMES, Profile
    fake_cpu = rl.Ceiling("cpu", 1e11, 2e10, 0.0, "fp32", "measured")
    ax = plots.plot_roofline([fake_cpu, *rl.GPUS], rl.roofline_points(), rl.A100_80GB)
    assert len(ax.lines) == 4 + 18 + 3  # a roof per ceiling, a marker per point, a legend entry per model
    assert "100.0 GFLOP/s" in ax.get_legend().get_texts()[0].get_text()
    split = article_bench.c7_table(batches=(1, 8), contexts=(2048,))
    ax = plots.plot_c7(split)
    assert len(ax.patches) == 3 * len(split)
    profile = Profile(step_s=0.1, profiled_step_s=0.1, categories={n: 0.01 for n in CATEGORY_NAMES},
                      events_per_step=1, steps=1, context=1)
    assert len(plots.plot_categories(profile).patches) == len(CATEGORY_NAMES)
    report = {"hardware": {"gpu": "H200"}, "checks": {"decode": {"models": {"m": {"modes": {
        "eager": {"decode_tokens_per_s": 100.0}, "compile": {"decode_tokens_per_s": 200.0}}}}}}}
    assert len(plots.plot_gpu_profiles({"H200.json": report}).patches) == 2
    plt.close("all")
