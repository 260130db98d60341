"""compile=True and cuda_graphs=True (minigen/graphs.py): the same tokens as eager, compiled once.

Oracle: the eager loop. On the CPU, torch.compile (inductor); the CUDA-graph tests are marked `gpu`
(skipped without CUDA) and scripts/gpu_check.py runs them too.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import minigen
from conftest import tiny_hf
from minigen import ConfigError
from minigen.steps import graphs

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    return minigen.from_hf(tiny_hf("llama"))


def prompts(B: int = 2, T: int = 6) -> torch.Tensor:
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("settings", [{}, {"window_size": 5, "sink_tokens": 2}], ids=["contiguous", "window"])
def test_compiled_generation_equals_eager_and_compiles_once(tiny, settings):
    """Greedy tokens equal eager's; the step compiles at the first call and never again: not at
    later steps, not at a second call with the same shapes."""
    eager = minigen.generate(tiny, prompts(), max_new_tokens=12, stop_token_ids=[], **settings).tokens
    first = minigen.generate(tiny, prompts(), max_new_tokens=12, stop_token_ids=[], compile=True, **settings)
    graphs = counters["stats"]["unique_graphs"]
    second = minigen.generate(tiny, prompts(), max_new_tokens=12, stop_token_ids=[], compile=True, **settings)
    assert torch.equal(first.tokens, eager) and torch.equal(second.tokens, eager)
    assert counters["stats"]["unique_graphs"] == graphs  # the second call reused the compiled step
    assert second.stats.compile_s == 0.0
    assert first.stats.compile_s > 0 or counters["stats"]["unique_graphs"] > 0


def test_many_models_compiled_in_one_process_never_hit_dynamo_s_limit():
    """Regression: dynamo keeps at most 8 graphs per code object and, with fullgraph=True, fails hard
    on a ninth. Every model's compiled step shared decode_step's code, so a script comparing 5
    weight formats with two cache dtypes (scripts/decode_speeds.py) died inside torch."""
    def step(model, x):
        return x * model.weight

    models = [torch.nn.Linear(1, 1) for _ in range(10)]  # 10 models, each seen with its own shape
    for i, m in enumerate(models):
        x = torch.ones(i + 1)
        assert torch.equal(graphs.compiled(step, m)(m, x), x * m.weight)
    assert graphs.compiled(step, models[0]) is graphs.compiled(step, models[0])  # one per model, kept


def test_compiled_sampling_equals_eager_for_a_seed(tiny):
    kw = dict(max_new_tokens=10, stop_token_ids=[], do_sample=True, temperature=0.8, top_k=20, seed=3)
    eager = minigen.generate(tiny, prompts(), **kw).tokens
    assert torch.equal(minigen.generate(tiny, prompts(), compile=True, **kw).tokens, eager)


def test_stats_give_latency_percentiles(tiny):
    s = minigen.generate(tiny, prompts(1), max_new_tokens=20, stop_token_ids=[]).stats
    decode = sorted(s.token_latencies_s[1:])
    assert 0 < s.latency_p50_s <= s.latency_p90_s <= s.latency_p99_s <= decode[-1]
    assert s.latency_p50_s == decode[len(decode) // 2]


def test_compile_refuses_what_it_cannot_take(tiny):
    with pytest.raises(ConfigError, match="cache_chunk_size=16 and compile=True do not combine"):
        minigen.generate(tiny, prompts(), compile=True, cache_chunk_size=16)
    with pytest.raises(ConfigError, match="compile=True with observers"):
        minigen.generate(tiny, prompts(), compile=True, observers=(lambda layer, probs: None,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only check")
def test_cuda_graphs_on_a_cpu_name_cuda_and_suggest_compile(tiny):
    config = minigen.GenerationConfig(cuda_graphs=True)  # a config reads no machine: it builds, and travels
    for run in (lambda: minigen.generate(tiny, prompts(), config), lambda: minigen.stream(tiny, prompts(), config),
                lambda: minigen.perplexity(tiny, prompts()[0], config)):
        with pytest.raises(ConfigError, match="cuda_graphs=True needs CUDA.*use compile=True"):
            run()  # refused where it would run, before any work


@pytest.mark.timeout(180)
def test_gpu_check_runs_on_tiny_shapes(tmp_path):
    """scripts/gpu_check.py --smoke: the acceptance script's own code, on the CPU, writes its JSON."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "smoke.json").read_text())
    modes = report["checks"]["decode"]["models"]["smoke"]["modes"]
    assert set(modes) == {"eager", "compile"} and all(m["tokens_equal_eager"] for m in modes.values())
    assert all(r["tokens_identical"] for k, r in report["checks"]["offload"].items() if k.startswith(("paged", "offload")))
    runs = report["checks"]["kernel"]["runs"]  # the Triton kernel (interpreted here) against gather + SDPA
    assert {r["format"] for r in runs.values()} == {"bf16", "int8", "int4"}
    assert all(r["max_abs_diff"] < 2e-2 for r in runs.values())  # bf16 outputs: a few units of 2^-8
    assert (tmp_path / "smoke.png").exists()


# ---------------------------------------------------------------- CUDA only (pytest -m gpu)
@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.9, "top_p": 0.9, "seed": 5}],
                         ids=["greedy", "seeded sampling"])
@pytest.mark.parametrize("settings", [{}, {"window_size": 5, "sink_tokens": 2}], ids=["contiguous", "window"])
def test_replayed_tokens_equal_eager(settings, sampling):
    model = minigen.from_hf(tiny_hf("llama")).to("cuda")
    ids = prompts().cuda()
    kw = dict(max_new_tokens=16, stop_token_ids=[], **settings, **sampling)
    eager = minigen.generate(model, ids, **kw).tokens
    graphed = minigen.generate(model, ids, cuda_graphs=True, **kw)
    assert torch.equal(graphed.tokens, eager)
    assert graphed.stats.compile_s > 0  # captured once, at the first decode step


@pytest.mark.gpu
def test_graphed_sampled_rows_equal_alone():
    """Issue 25: each row samples inside the graph from its own registered generator (seed + r)."""
    model = minigen.from_hf(tiny_hf("llama")).to("cuda")
    ids = prompts().cuda()
    kw = dict(max_new_tokens=16, stop_token_ids=[], do_sample=True, temperature=1.0, seed=5, cuda_graphs=True)
    out = minigen.generate(model, ids, **kw).tokens
    for r in range(ids.shape[0]):
        assert torch.equal(out[r], minigen.generate(model, ids[r:r + 1], **(kw | {"seed": 5 + r})).tokens[0]), r


@pytest.mark.gpu
def test_no_step_recaptures(monkeypatch):
    from minigen.steps import graphs
    captures = []
    real = graphs.CudaGraphDecoder.__init__
    monkeypatch.setattr(graphs.CudaGraphDecoder, "__init__", lambda self, *a, **k: captures.append(1) or real(self, *a, **k))
    model = minigen.from_hf(tiny_hf("llama")).to("cuda")
    minigen.generate(model, prompts().cuda(), max_new_tokens=20, stop_token_ids=[], cuda_graphs=True)
    assert captures == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.9, "top_k": 30, "seed": 5}],
                         ids=["greedy", "seeded sampling"])
def test_graphed_stops_equal_eager(sampling):
    """The device loop (steps/graphs.py) with stops: one row ends mid-chunk, the other in a later
    chunk, and the output is eager's, cut where every row has stopped (tests/test_host_work.py runs
    the same loop on the CPU with the CUDA calls stood in)."""
    model = minigen.from_hf(tiny_hf("llama")).to("cuda")
    ids, n = prompts().cuda(), 3 * graphs.STOP_CHECK_EVERY
    free = minigen.generate(model, ids, max_new_tokens=n, stop_token_ids=[], **sampling).tokens
    T = ids.shape[1]
    stops = sorted({int(free[0, T + 5]), int(free[1, T + graphs.STOP_CHECK_EVERY + 3])})
    eager = minigen.generate(model, ids, max_new_tokens=n, stop_token_ids=stops, **sampling)
    graphed = minigen.generate(model, ids, max_new_tokens=n, stop_token_ids=stops, cuda_graphs=True, **sampling)
    assert torch.equal(graphed.tokens, eager.tokens) and graphed.stats.new_tokens == eager.stats.new_tokens
