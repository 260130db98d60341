"""The C matrix-vector kernel of batch-1 decoding (minigen/kernels/cpu.py, build.py, csrc/), and the
benchmark that measures it against transformers."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minigen
from minigen.measure import bench, machine
from minigen.kernels import build as kernel_build, cpu as cpu_kernel
from minigen.generate import generate
from minigen.numerics.weight_quant import quantize_matrix

from conftest import tiny_hf
from test_loading import save_tiny_tokenizer

needs_cc = pytest.mark.skipif(kernel_build.compiler() is None, reason="no C compiler on this machine")


@needs_cc
def test_kernel_builds_where_a_compiler_exists():
    # CI has gcc: decoding must run on the kernel there, or every speed number silently drops.
    assert kernel_build.status().startswith("built"), kernel_build.status()


@needs_cc
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_matvec_matches_linear_for_any_shape(n, k, seed):
    # n not a multiple of 4 and k not a multiple of 8 take the kernel's tail paths.
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(1, 1, k, generator=g)
    y = cpu_kernel.matvec(x, w)
    assert y is not None and y.dtype == torch.float32 and y.shape == (n,)
    # fp32 sums of k <= 100 products of N(0, 1) values, in another order: errors ~1e-6
    torch.testing.assert_close(y, F.linear(x, w).reshape(n), atol=1e-5, rtol=1e-5)


@needs_cc
def test_matvec_gives_the_same_numbers_on_one_and_two_threads():
    w, x = torch.randn(1001, 576), torch.randn(576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernel.matvec(x, w)
        torch.set_num_threads(2)
        two = cpu_kernel.matvec(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each row is summed by one thread in one order


@needs_cc
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 100), m=st.integers(2, cpu_kernel.MAX_ROWS),
       seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2]))
@example(n=7, k=45, m=8, seed=0, threads=1)  # a 32-block, an 8-wide tail, a scalar tail: once 1e-7 apart
@example(n=65, k=576, m=9, seed=1, threads=2)  # an odd row of W left after the pairs, a leftover row of x
def test_several_rows_give_each_row_the_bits_it_gets_alone(n, k, m, seed, threads):
    # m not a multiple of 4 takes the leftover-rows path; k not a multiple of 32 or 8 the tails.
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = cpu_kernel.matmul_rows(x, w)
        alone = torch.stack([cpu_kernel.matvec(x[r], w) for r in range(m)])
    finally:
        torch.set_num_threads(before)
    assert y is not None and y.shape == (m, n)
    assert torch.equal(y, alone)  # the same four chains of sums in the same order as one row alone
    assert_near_fp64(y, x, w)


def assert_near_fp64(y, x, w, factor=1e-6):
    """y = x @ w.T in fp32, another order of sums than torch's: checked against fp64 with a bound on each
    output scaled by the size of its products (sum |x_j w_j|), not by the output, which cancellation
    can make small. A bound relative to torch's fp32 result failed for k = 576 on an Intel Xeon whose
    MKL sums in another order (2.1e-5 apart at an output of 0.86, the products' sum ~370): both were
    right. 1e-6 of the products' sum is ~17 fp32 roundings of that size; a wrong product is off by
    a whole term."""
    ref = x.double() @ w.double().T
    bound = factor * (x.double().abs() @ w.double().abs().T) + 1e-7
    assert ((y.double() - ref).abs() <= bound).all(), float(((y.double() - ref).abs() / bound).max())


def test_several_rows_stand_aside_past_max_rows_and_for_16_bit_weights():
    w = torch.randn(8, 16)
    assert cpu_kernel.matmul_rows(torch.randn(cpu_kernel.MAX_ROWS + 1, 16), w) is None
    assert cpu_kernel.matmul_rows(torch.randn(4, 16), w.bfloat16()) is None
    with kernel_build.enabled(False):
        assert cpu_kernel.matmul_rows(torch.randn(4, 16), w) is None


@needs_cc
def test_a_batch_row_gets_the_logits_of_its_prompt_alone(tiny_llama):
    # The batch's decode step reads the weights once through the several-row kernel; each row's
    # logits are then bit-identical to decoding that row alone (not merely within a tolerance).
    model = tiny_llama[1]
    prompts = torch.randint(0, model.config.vocab_size, (5, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        batch = model(prompts[:, :1], torch.tensor([0]))
        alone = torch.cat([model(prompts[r:r + 1, :1], torch.tensor([0])) for r in range(5)])
    if model.ops.paths().allowed("c_matvec"):  # the C loops run here: the same bits
        assert torch.equal(batch, alone)
    else:  # the one-row C loop measured slower here: torch's product may block 5 rows otherwise than 1
        assert torch.allclose(batch, alone, rtol=1e-5, atol=1e-5)


def test_matvec_stands_aside_where_torch_must_see_the_op():
    w, x = torch.randn(8, 16), torch.randn(16)
    with kernel_build.enabled(False):
        assert cpu_kernel.matvec(x, w) is None
    assert cpu_kernel.matvec(x, w.t().contiguous().t()) is None  # not contiguous
    assert cpu_kernel.matvec(x.bfloat16(), w.bfloat16()) is None  # bf16 and fp16: torch's path
    assert cpu_kernel.matvec(x.requires_grad_(), w) is None  # autograd
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False):
        assert cpu_kernel.matvec(x.detach(), w) is None


needs_onednn = pytest.mark.skipif(not cpu_kernel._ONEDNN, reason="this torch has no oneDNN")


@needs_onednn
@settings(max_examples=20, deadline=None, derandomize=True)
@given(rows=st.integers(1, 300), n=st.integers(1, 200), k=st.integers(1, 700), seed=st.integers(0, 2**16))
def test_prompt_products_through_onednn_match_linear(rows, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(2, rows, k, generator=g), torch.randn(n, k, generator=g)
    y, ref = cpu_kernel.linear(x, w), F.linear(x, w)
    assert y is not None and y.shape == ref.shape and y.dtype == torch.float32
    # two fp32 summation orders: within k roundings of the sum of |w x| (the same bound as matvec's)
    bound = k * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T) + 1e-30
    assert ((y - ref).abs() <= bound).all()


def test_onednn_stands_aside_where_torch_must_see_the_op():
    w, x = torch.randn(8, 16), torch.randn(40, 16)
    with kernel_build.enabled(False):
        assert cpu_kernel.linear(x, w) is None
    assert cpu_kernel.linear(x.bfloat16(), w.bfloat16()) is None
    assert cpu_kernel.linear(x.requires_grad_(), w) is None  # autograd
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False):
        assert cpu_kernel.linear(x.detach(), w) is None


@needs_onednn
def test_a_prompt_runs_its_products_on_onednn(tiny_llama):
    # Past MAX_ROWS rows, model.matmul hands fp32 products to oneDNN, not F.linear (MKL); the
    # profiler sees the op, so a path that silently fell back would fail here.
    from torch.profiler import profile
    model = tiny_llama[1]
    prompt = torch.randint(0, model.config.vocab_size, (1, cpu_kernel.MAX_ROWS + 4))
    with torch.inference_mode(), profile() as p:
        model(prompt, torch.arange(prompt.shape[1]))
    ops = {e.key: e.count for e in p.key_averages()}
    assert ops.get("mkldnn::_linear_pointwise", 0) >= 2 * model.config.n_layers, ops


def test_without_a_compiler_decoding_falls_back_with_a_notice(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_build, "compiler", lambda: None)
    monkeypatch.setattr(kernel_build, "_lib", None)
    monkeypatch.setattr(kernel_build, "_reason", "not built yet")
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert cpu_kernel.matvec(torch.randn(16), torch.randn(8, 16)) is None
    assert "no C compiler" in kernel_build.status()
    model = minigen.from_hf(tiny_hf("llama"))
    out = generate(model, torch.tensor([[3, 1, 4]]), max_new_tokens=5)  # still runs, on F.linear
    assert out.tokens.shape == (1, 8)


def fresh_kernel(monkeypatch) -> None:
    """Forget the kernel this process loaded, so the next call builds or loads one anew."""
    monkeypatch.setattr(kernel_build, "_lib", None)
    monkeypatch.setattr(kernel_build, "_reason", "not built yet")


@needs_cc
def test_a_corrupt_cached_kernel_is_rebuilt(monkeypatch, tmp_path):
    # The kernel's file name depends on the source, compiler, flags and CPU, not on the cache
    # folder: build it once in one folder to learn the name, then plant garbage under that name
    # in another. (Planting it over the file already loaded would prove nothing: the dynamic
    # loader hands back a library it already holds without reading the file again.)
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path / "first"))
    fresh_kernel(monkeypatch)
    assert kernel_build.status().startswith("built"), kernel_build.status()
    [built] = (tmp_path / "first" / "kernels").glob("*.so")
    corrupt = tmp_path / "second" / "kernels" / built.name
    corrupt.parent.mkdir(parents=True)
    corrupt.write_bytes(built.read_bytes()[:100])  # a truncated copy: a half-written build
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path / "second"))
    fresh_kernel(monkeypatch)
    assert kernel_build.status().startswith("built"), kernel_build.status()
    assert corrupt.stat().st_size > 100  # rebuilt in place, whole
    w, x = torch.randn(37, 53), torch.randn(53)
    torch.testing.assert_close(cpu_kernel.matvec(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


@needs_cc
def test_a_new_build_removes_builds_unused_for_a_month(monkeypatch, tmp_path):
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    stale, recent, other = kernels / "gemv-0000000000000000.so", kernels / "gemv-1111111111111111.so", kernels / "notes.txt"
    for f in (stale, recent, other):
        f.write_bytes(b"x")
    month = time.time() - (kernel_build.UNUSED_DAYS + 1) * 86400
    os.utime(stale, (month, month))
    os.utime(other, (month, month))
    os.utime(recent, (month + 2 * 86400, month + 2 * 86400))  # loaded 29 days ago: kept
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    fresh_kernel(monkeypatch)
    assert kernel_build.status().startswith("built"), kernel_build.status()
    assert not stale.exists() and recent.exists() and other.exists()
    [built] = set(kernels.glob("gemv-*.so")) - {recent}
    assert built.stat().st_mtime > time.time() - 60  # the build in use is fresh


@needs_cc
@pytest.mark.skipif(sys.platform != "linux", reason="the forced build without OpenMP is checked on Linux")
def test_a_build_without_openmp_is_single_threaded_with_a_notice(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIGEN_CPU_KERNEL_OPENMP", "0")
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    fresh_kernel(monkeypatch)
    with pytest.warns(RuntimeWarning, match="without OpenMP"):
        status = kernel_build.status()
    assert status.startswith("built") and "without OpenMP" in status, status
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n, k in ((1, 1), (7, 13), (64, 576), (1001, 96)):  # tails and full blocks of rows
                w, x = torch.randn(n, k), torch.randn(k)
                # fp32 sums of k <= 576 products of N(0, 1) values in another order: errors ~1e-6
                torch.testing.assert_close(cpu_kernel.matvec(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_cc
@pytest.mark.timeout(200)
def test_kernel_and_torch_decode_the_same_greedy_tokens(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    fast = generate(model, ids, max_new_tokens=24).tokens
    with kernel_build.enabled(False):
        slow = generate(model, ids, max_new_tokens=24).tokens
    assert torch.equal(fast, slow)


def test_bench_runs_both_engines_and_writes_the_promised_json(tmp_path):
    tiny_hf("llama").save_pretrained(tmp_path / "tiny")
    save_tiny_tokenizer(tmp_path / "tiny")
    # 96 tokens, median of 3: a 1-token run that a busy neighbour slows must not outlast the whole run
    result = bench.run_bench(str(tmp_path / "tiny"), prompt_len=8, new_tokens=96, repeats=3)
    for name in ("minigen", "transformers"):
        engine = result["engines"][name]
        assert engine["decode_tokens_per_s"] > 0 and engine["ttft_s"] > 0
        assert engine["peak_memory_bytes"] >= engine["weight_bytes"] > 0
    assert result["exact"] and result["greedy_token_agreement"] == 1.0
    assert result["roofline_tokens_per_s"] > 0 and result["hardware"]["threads"] >= 1
    probes = result["hardware"]["memory_read_gb_s_probes"]  # before and after the runs; the roofline takes the better
    assert len(probes) == 2 and min(probes) > 0 and result["hardware"]["memory_read_gb_s"] == max(probes)
    json.dumps(result)  # everything in it is plain JSON


def test_peak_rss_sees_a_short_lived_allocation():
    import mmap
    with machine.PeakRSS() as mem:
        # 64 MiB of fresh pages, touched, then freed before the block ends. (A torch tensor may
        # reuse pages that a test before this one left resident, which RSS does not count again.)
        block = mmap.mmap(-1, 64 * 2**20)
        block.write(b"x" * len(block))
        block.close()
    assert mem.added >= 48 * 2**20


def test_roofline_counts_a_tied_head_once_in_full(smollm2):
    model, _ = smollm2
    assert model.lm_head is None
    every_weight = sum(p.nbytes for p in model.parameters())  # embed counted once: it is the head
    assert bench.bytes_per_decode_step(model, context=0) == every_weight


@needs_cc
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 100), seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2]))
def test_bf16_weights_give_fp32_sums_of_the_widened_weights(n, k, seed, threads):
    """bf16 weights are widened exactly (a bf16 is the top half of an fp32), so the kernel equals
    fp32 arithmetic on w.float(); the sums run in another order: ~1e-6 relative."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(k, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = cpu_kernel.matvec(x, w)
    finally:
        torch.set_num_threads(before)
    assert y is not None and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w.float()), atol=1e-5, rtol=1e-5)


def test_a_kernel_without_memory_for_its_work_buffer_raises_memory_error(monkeypatch):
    """gemv_bf16 and gemv_q4 return -1 when they cannot allocate x reordered (and int4's sums of x):
    y is then unwritten, so the call raises instead of returning torch.empty's garbage."""
    class NoMemory:  # the library's interface, every allocation failing
        def gemv_bf16(self, *args):
            return -1

        def gemv_q4(self, *args):
            return -1

    monkeypatch.setattr(kernel_build, "loaded", lambda: NoMemory())
    with pytest.raises(MemoryError, match="2,304 bytes"):  # 576 fp32 numbers
        cpu_kernel._gemv(torch.randn(576), torch.randn(8, 576).bfloat16())
    q = quantize_matrix(torch.randn(8, 576), 4, 32)
    with pytest.raises(MemoryError, match="2,376 bytes"):  # 18 group sums and 576 numbers
        cpu_kernel._gemv_q(torch.randn(576), q.codes, q.scales, q.mins, q.group_size)


@needs_cc
def test_compiled_graphs_call_the_kernel_as_an_operator(monkeypatch):
    """Under torch.compile the kernel is the `minigen::matvec` operator: the graph keeps it (no
    graph break, fullgraph=True holds) and calls the C code when it runs."""
    calls = []
    real = cpu_kernel._gemv
    monkeypatch.setattr(cpu_kernel, "_gemv", lambda x, w: calls.append(w.shape) or real(x, w))
    torch._dynamo.reset()
    w, x = torch.randn(40, 24), torch.randn(1, 24)

    def step(x, w):
        return torch.relu(cpu_kernel.matvec(x, w)) + 1

    compiled = torch.compile(step, fullgraph=True)
    cpu_kernel.matvec(x, w)  # built before the trace, as the eager prefill does
    calls.clear()
    with torch.inference_mode():
        got = compiled(x, w)
    assert calls == [(40, 24)]
    torch.testing.assert_close(got, torch.relu(F.linear(x, w).reshape(40)) + 1, atol=1e-5, rtol=1e-5)
