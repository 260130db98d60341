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
from minigen.numerics import int8_act
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


def _teacher_forced(model, ids, fused: bool, int8: bool, steps: int = 24) -> torch.Tensor:
    """Logits [1 + steps, V]: a 12-token prompt, then `steps` decode steps fed the text's next tokens."""
    plan = minigen.make_plan(model, minigen.GenerationConfig(int8_activations=int8, fused_decode=fused), 1,
                             max_len=12 + steps)
    assert isinstance(plan.step, FusedStep) == fused and ("int8 activations" in str(plan)) == int8
    cache = plan.make_cache(model)
    with torch.inference_mode():
        out = [plan.step.prefill(model, ids[None, :12], torch.arange(12), cache, ops=plan.prompt_ops)]
        for t in range(12, 12 + steps):
            out.append(plan.step.decode(model, ids[None, t:t + 1], torch.tensor([t]), cache, ops=plan.decode_ops))
    return torch.cat([o.reshape(1, -1) for o in out])


@needs_c
def test_the_fused_step_runs_int8_products_as_the_eager_step_does(smollm2_int4, english_text_ids):
    """The fused C step's int4 x int8 products (decode.c's kinds 4 and 5; a 12-token prompt through its verify
    call, then decode steps) against the eager step's. Their fp32 inputs differ in the last bits, and a code
    moved by one step at a rounding boundary re-draws that block's rounding error: measured on the Xeon (family
    6 model 167), the two int8 runs differ by as much as int8 activations differ from fp32 ones. So: the same
    top-1, a difference of that order (a wrong kernel is far off), and not fp32 activations' logits."""
    model, ids = smollm2_int4, english_text_ids
    fused8, eager8 = _teacher_forced(model, ids, True, True), _teacher_forced(model, ids, False, True)
    fused32, eager32 = _teacher_forced(model, ids, True, False), _teacher_forced(model, ids, False, False)
    assert (fused8.argmax(-1) == eager8.argmax(-1)).float().mean() >= 0.95
    assert (fused8 - eager8).abs().mean() < 2 * (eager8 - eager32).abs().mean()
    assert (fused8 - fused32).abs().mean() > 0.1 * (eager8 - eager32).abs().mean()  # int8 ran in C
    torch.testing.assert_close(fused32, eager32, atol=1e-3, rtol=1e-4)  # fp32 activations: one sum order apart


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
def test_the_ops_run_the_reference_scheme_on_the_kernels():
    """KernelOps with int8_act sends a quantized weight's product to C (one row: the decode kernel; several:
    the prompt's GEMM), and its reference, configured alike, to int8_act.reference_linear: the same numbers
    from the same input (a model's forward would re-draw codes at rounding boundaries: see the fused test)."""
    model = _tiny_int4()
    fast, ref = model.ops.configured(int8_act=True), model.ops.reference.configured(int8_act=True)
    plain = model.ops.configured(int8_act=False)
    g = torch.Generator().manual_seed(3)
    for w in (model.blocks[0].attn.wqkv, model.blocks[1].mlp.w_down):
        for rows in (1, 20):
            x = torch.randn(1, rows, w.shape[1], generator=g)
            x[..., 5] *= 100  # an outlier channel: its block is quantized twice
            y = fast.linear(x, w)
            torch.testing.assert_close(y, ref.linear(x, w), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(y, int8_act.reference_linear(x, w), atol=1e-5, rtol=1e-5)
            assert (y - plain.linear(x, w)).abs().max() > 1e-4  # not fp32 activations


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
    with pytest.raises(ConfigError, match="int8_activations=True and cuda_graphs=True do not combine"):
        minigen.generate(_tiny_int4(), ids, max_new_tokens=2, int8_activations=True, cuda_graphs=True,
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
