"""int8 activations for int4 / int8 weights (numerics/int8_act.py, int8_activations): the loss bound on
SmolLM2, the plan's choice (measured: a lossy path runs on "auto" only where it measured faster), what
it refuses, and the fused step and the eager one running the same products."""

from __future__ import annotations

import warnings

import pytest
import torch

import minigen
from minigen import ConfigError
from minigen.evaluate import score
from minigen.kernels import build, fastpaths
from minigen.kernels.probes import LOSSY_GAIN, Measurement
from minigen.numerics.weight_quant import quantize_weights
from minigen.steps import choose
from minigen.steps.fused import FusedStep

from conftest import tiny_hf

needs_c = pytest.mark.skipif(not build.available(), reason="minigen's C kernels are not built here")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smollm2_int4(smollm2):
    """SmolLM2's int4 model from the bundled GGUF: its Q4_1 codes as they are (load's weight_bits=4)."""
    model, _ = minigen.load("smollm2-135m", weight_bits=4)
    return model


@needs_c
def test_int8_activations_cost_smollm2_under_one_percent_of_perplexity(smollm2_int4, english_text_ids):
    """Teacher forcing over two slices of English, int4 weights: fp32 activations against int8 ones (a
    scale per 32). A whole slice in one forward runs the prompt's GEMM; one token a forward runs the
    decode step's one-row kernel. The issue's bounds: perplexity within +1%, top-1 agreement >= 97%."""
    model = smollm2_int4
    for ids, chunk in ((english_text_ids[:512], None), (english_text_ids[1024:1536], None),
                       (english_text_ids[:256], 1)):
        a = score(model, ids, chunk_size=chunk, int8_activations=False)
        b = score(model, ids, chunk_size=chunk, int8_activations=True)
        assert not torch.equal(a.nll, b.nll)  # int8 activations ran
        assert b.perplexity / a.perplexity - 1 <= 0.01, (chunk, a.perplexity, b.perplexity)
        assert (a.top1 == b.top1).float().mean() >= 0.97, chunk


@needs_c
def test_the_fused_step_and_the_eager_one_run_the_same_int8_products(smollm2_int4, english_text_ids):
    """The fused C step's int4 x int8 rows are the eager step's kernel: the same greedy tokens, a prompt
    of 16 tokens or fewer (the fused step's verify call) and a longer one (torch's prompt, then C steps)."""
    model = smollm2_int4
    for prompt in (english_text_ids[None, :12], english_text_ids[None, :40]):
        fused = minigen.generate(model, prompt, max_new_tokens=16, stop_token_ids=[], int8_activations=True,
                                 fused_decode=True)
        eager = minigen.generate(model, prompt, max_new_tokens=16, stop_token_ids=[], int8_activations=True,
                                 fused_decode=False)
        assert torch.equal(fused.tokens, eager.tokens)
        assert "int8 activations" in fused.stats.plan


def _tiny_int4():
    return quantize_weights(minigen.from_hf(tiny_hf("llama", hidden_size=64)), bits=4)


@needs_c
def test_the_plan_runs_int8_activations_only_where_they_measured_faster(monkeypatch):
    """"auto" reads the measurements: below LOSSY_GAIN the path stands aside with a notice, and the
    plan says fp32 activations; at or above it, int8; True runs them whatever they measured, warning."""
    model = _tiny_int4()
    paths = choose.measurements(model)
    for name in ("c_matvec_q4_s8", "gemm_q4_s8"):
        monkeypatch.setitem(paths.measured, name, Measurement(name, f"planted {name}", "its reference", 0.001,
                                                              0.001 * 1.05, least=LOSSY_GAIN))
    fastpaths._noticed.discard("c_matvec_q4_s8")
    with pytest.warns(fastpaths.FastPathNotice, match=r"planted c_matvec_q4_s8 measured 1\.05x.*lossy path runs from 1\.10x"):
        plan = minigen.make_plan(model, minigen.GenerationConfig(), 1)
    assert not plan.decode_ops.int8_act and not plan.prompt_ops.int8_act
    assert "fp32 activations" in str(plan).splitlines()[0]
    for name in ("c_matvec_q4_s8", "gemm_q4_s8"):
        monkeypatch.setitem(paths.measured, name, Measurement(name, f"planted {name}", "its reference", 0.001,
                                                              0.002, least=LOSSY_GAIN))
    plan = minigen.make_plan(model, minigen.GenerationConfig(), 1)
    assert plan.decode_ops.int8_act and plan.prompt_ops.int8_act
    assert "int8 activations (a scale per 32; integer dot products; measured 2.00x fp32 activations here)" in str(plan)
    if isinstance(plan.step, FusedStep):
        assert plan.step.int8_act  # the fused step's C products take them too
    # a prompt in another format (prefill_precision) keeps it; its decode steps still take int8 activations
    run = choose.run_of(model, minigen.GenerationConfig(), 1)
    assert choose.int8_activations(model, minigen.GenerationConfig(prefill_precision="bfloat16"), run) == (True, False)
    for name in ("c_matvec_q4_s8", "gemm_q4_s8"):
        monkeypatch.setitem(paths.measured, name, Measurement(name, f"planted {name}", "its reference", 0.002,
                                                              0.001, least=LOSSY_GAIN))
    with pytest.warns(fastpaths.FastPathNotice, match=r"int8_activations=True runs planted c_matvec_q4_s8, which measured 0\.50x"):
        plan = minigen.make_plan(model, minigen.GenerationConfig(int8_activations=True), 1)
    assert plan.decode_ops.int8_act and plan.prompt_ops.int8_act


@needs_c
def test_the_kernels_compute_the_reference_scheme_in_a_forward():
    """A tiny int4 model's logits through the kernels with int8 activations are the plain-torch
    reference's (numerics/int8_act.reference_linear), one forward of a prompt and one of a single
    token; and not fp32 activations' logits."""
    model = _tiny_int4()
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(3))
    for tokens in (ids, ids[:, :1]):
        pos = torch.arange(tokens.shape[1])
        fast = model(tokens, pos, ops=model.ops.configured(int8_act=True))
        ref = model(tokens, pos, ops=model.ops.reference.configured(int8_act=True))
        plain = model(tokens, pos, ops=model.ops.configured(int8_act=False))
        torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)
        assert (fast - plain).abs().max() > 1e-3


@pytest.mark.parametrize("setup, fragment", [
    (lambda: minigen.from_hf(tiny_hf("llama")), "this model's weights are not quantized: load it with weight_bits=4 or 8"),
    (_tiny_int4, None),
])
def test_int8_activations_true_is_refused_where_it_cannot_run(setup, fragment):
    model = setup()
    ids = torch.tensor([[1, 2, 3]])
    if fragment is not None:
        with pytest.raises(ConfigError, match=fragment):
            minigen.generate(model, ids, max_new_tokens=2, int8_activations=True)
    with pytest.raises(ConfigError, match="a compiled or captured step does not call"):
        minigen.generate(_tiny_int4(), ids, max_new_tokens=2, int8_activations=True, compile=True,
                         fused_decode=False)
    with build.enabled(False):
        with pytest.raises(ConfigError, match="int8_activations=True needs minigen's C kernel"):
            minigen.generate(_tiny_int4(), ids, max_new_tokens=2, int8_activations=True)


def test_int8_activations_takes_auto_true_or_false():
    with pytest.raises(ConfigError, match="int8_activations='yes' is invalid: use \"auto\""):
        minigen.GenerationConfig(int8_activations="yes")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        minigen.GenerationConfig(int8_activations=False)
