"""minigen.Engine: continuous batching over one pool of paged blocks.

Oracle: every request's tokens equal generating it alone with the same settings (fp32 greedy, or
seeded sampling: each request samples from its own generator), whatever it was batched with,
preempted or served from cached prefix blocks.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import ConfigError, Engine, PromptError, RequestError
from minigen.serving.scheduler import PrefixAllocator, block_hashes, can_admit

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return minigen.from_hf(tiny_hf("llama"))


def workload(n=6, seed=0, system=9):
    """n prompts that share a system prompt of `system` tokens, then 1..12 tokens of their own."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 97, (system,), generator=g)
    return [torch.cat([shared, torch.randint(0, 97, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g)])
            for _ in range(n)]


def alone(model, prompt, **config):
    return minigen.generate(model, prompt[None], **config).tokens[0]


def check_alone(model, prompts, out, configs):
    for i, (p, config) in enumerate(zip(prompts, configs)):
        want = alone(model, p, **config)
        stop = config.get("stop_token_ids") or []
        new = want[p.numel():].tolist()
        cut = next((k + 1 for k, t in enumerate(new) if t in stop), len(new))  # alone pads after its stop
        assert out[i].tolist() == want[:p.numel() + cut].tolist(), i


@pytest.mark.parametrize("num_blocks", [None, 8])  # 8 blocks of 4: preemption is forced
def test_every_request_equals_generating_it_alone(tiny, num_blocks):
    prompts = workload()
    engine = Engine(tiny, {"cache_chunk_size": 4}, max_batch_size=3, num_blocks=num_blocks)
    for p in prompts:
        engine.add_request(p, max_new_tokens=9, stop_token_ids=[])
    out = engine.run()
    check_alone(tiny, prompts, out, [dict(max_new_tokens=9, stop_token_ids=[])] * len(prompts))
    m = engine.metrics()
    assert m["prefix_cache_hit_rate"] > 0  # the system prompt's two full blocks are shared
    assert (m["preemptions"] > 0) == (num_blocks == 8)
    assert sum(r["cached_tokens"] for r in m["requests"]) > 0


def test_sampling_stops_and_lengths_are_per_request(tiny):
    prompts = workload(5, seed=1)
    free = alone(tiny, prompts[2], max_new_tokens=8, stop_token_ids=[])
    configs = [dict(max_new_tokens=8, stop_token_ids=[]), dict(max_new_tokens=3, stop_token_ids=[]),
               dict(max_new_tokens=8, stop_token_ids=[int(free[prompts[2].numel() + 2])]),
               dict(max_new_tokens=6, do_sample=True, temperature=0.8, seed=7, stop_token_ids=[]),
               dict(max_new_tokens=6, do_sample=True, top_k=5, seed=8, stop_token_ids=[])]
    engine = Engine(tiny, {"cache_chunk_size": 4}, max_batch_size=4, num_blocks=10)
    for p, c in zip(prompts, configs):
        engine.add_request(p, **c)
    out = engine.run()
    check_alone(tiny, prompts, out, configs)
    reqs = engine.metrics()["requests"]
    assert [r["finish_reason"] for r in reqs] == ["length", "length", "stop", "length", "length"]
    assert [r["output_tokens"] for r in reqs][:3] == [8, 3, 3]


def test_a_window_runs_inside_the_engine(tiny):
    prompts, config = workload(4, seed=2), dict(cache_chunk_size=4, window_size=6, sink_tokens=2)
    engine = Engine(tiny, config, max_batch_size=2, num_blocks=12)
    for p in prompts:
        engine.add_request(p, max_new_tokens=10, stop_token_ids=[])
    check_alone(tiny, prompts, engine.run(), [dict(config, max_new_tokens=10, stop_token_ids=[])] * 4)


def test_stream_cancel_and_ids(tiny):
    prompts = workload(3, seed=3)
    engine = Engine(tiny, {"cache_chunk_size": 4}, max_batch_size=3, num_blocks=16)
    ids = [engine.add_request(p, max_new_tokens=8, stop_token_ids=[]) for p in prompts]
    assert ids == [0, 1, 2]
    streamed: dict[int, list[int]] = {i: [] for i in ids}
    for _ in range(3):
        for rid, tokens in engine.step().items():
            streamed[rid] += tokens
    engine.cancel(1)
    with pytest.raises(RequestError, match="already cancelled"):
        engine.cancel(1)
    with pytest.raises(RequestError, match="unknown request id 7"):
        engine.cancel(7)
    for rid, token in engine.stream():
        assert rid != 1
        streamed[rid].append(token)
    out = engine.run()
    assert len(streamed[1]) == 3 and out[1].tolist() == prompts[1].tolist() + streamed[1]
    check_alone(tiny, [prompts[0], prompts[2]], [out[0], out[2]], [dict(max_new_tokens=8, stop_token_ids=[])] * 2)
    assert all(out[i].tolist() == prompts[i].tolist() + streamed[i] for i in (0, 2))
    assert engine.metrics()["requests"][1]["finish_reason"] == "cancelled"
    assert engine.alloc.n_used == 0  # every block went back (cached ones stay findable, but free)


def test_metrics_schema_and_sanity(tiny):
    engine = Engine(tiny, {"cache_chunk_size": 4}, max_batch_size=2, num_blocks=8)
    prompts = workload(4, seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(p, max_new_tokens=5, stop_token_ids=[], arrival_s=0.05 * i)
    engine.run()
    m = engine.metrics()
    assert set(m) == {"ttft_s", "tpot_s", "e2e_latency_s", "queue_time_s", "output_tokens_per_s", "preemptions",
                      "prefix_cache_hit_rate", "steps", "kv_usage", "batch_size", "tokens_per_step", "requests",
                      "num_blocks", "block_size", "max_batch_size", "max_num_batched_tokens", "sliding_blocks"}
    for key in ("ttft_s", "tpot_s", "e2e_latency_s", "queue_time_s"):
        assert set(m[key]) == {"p50", "p90", "p99", "mean", "n"} and m[key]["n"] == 4
        assert 0 <= m[key]["p50"] <= m[key]["p90"] <= m[key]["p99"]
    assert (m["num_blocks"], m["block_size"], m["max_batch_size"], m["sliding_blocks"]) == (8, 4, 2, 0)
    assert len(m["steps"]) == len(m["kv_usage"]) == len(m["batch_size"]) == len(m["tokens_per_step"]) > 0
    assert m["max_num_batched_tokens"] is None
    assert all(0 <= u <= 1 for u in m["kv_usage"]) and max(m["batch_size"]) <= 2
    steps = m["steps"]
    assert set(steps[0]) == {"t_s", "step_s", "batch_size", "kv_usage", "prefill_tokens", "decode_tokens"}
    assert sum(s["decode_tokens"] for s in steps) + 4 == 4 * 5  # each request's first token comes from its prefill
    assert 0 < m["prefix_cache_hit_rate"] <= 1 and m["output_tokens_per_s"] > 0
    for r, p in zip(m["requests"], prompts):
        assert r["prompt_tokens"] == p.numel() and r["output_tokens"] == 5 and r["finish_reason"] == "length"
        assert r["arrival_s"] <= r["first_scheduled_s"] <= r["first_token_s"] <= r["finish_s"]
        assert r["phases"][0][0] == "queued" and r["phases"][-1][0] == "decode"
        assert all(a <= b for _, a, b in r["phases"]) and {ph for ph, _, _ in r["phases"]} <= {
            "queued", "prefill", "decode", "preempted"}
        assert r["first_scheduled_s"] >= r["arrival_s"]  # not admitted before it arrived
    assert min(m["batch_size"]) >= 1  # every recorded step ran something


def test_a_step_with_nothing_to_run_records_nothing(tiny):
    # Stepping while the only request has not arrived yet runs no forward and adds no step to the
    # metrics (a batch of 0 would pull the batch-size and KV-usage curves down).
    engine = Engine(tiny, {"cache_chunk_size": 4}, max_batch_size=2, num_blocks=8)
    engine.add_request(workload(1, seed=5)[0], max_new_tokens=3, stop_token_ids=[], arrival_s=engine.now() + 3600)
    assert engine.step() == {} and engine.steps == [] and engine.unfinished()


def test_bad_inputs(tiny):
    with pytest.raises(ConfigError, match="max_batch_size=0"):
        Engine(tiny, max_batch_size=0)
    with pytest.raises(ConfigError, match="num_blocks=0"):
        Engine(tiny, num_blocks=0)
    with pytest.raises(ConfigError, match="quant_bits=4 does not combine with the serving engine.*Fix"):
        Engine(tiny, {"quant_bits": 4, "quant_group_size": 8})
    with pytest.raises(ConfigError, match="kv_budget=8 does not combine"):
        Engine(tiny, {"kv_budget": 8})
    engine = Engine(tiny, {"cache_chunk_size": 4}, num_blocks=4)
    with pytest.raises(PromptError, match="empty"):
        engine.add_request([])
    with pytest.raises(PromptError, match="needs 5 blocks of 4 tokens, and the pool holds 4: raise num_blocks to at least 5"):
        engine.add_request(list(range(10)), max_new_tokens=10)
    with pytest.raises(ConfigError, match="Did you mean 'max_new_tokens'"):
        engine.add_request([1, 2], max_new_token=3)
    with pytest.raises(ConfigError, match="window_size cannot change per request"):
        engine.add_request([1, 2], window_size=4)
    with pytest.raises(RequestError, match="unknown request id 0"):
        engine.cancel(0)
    assert engine.requests == {}  # nothing refused was queued


def test_can_admit_and_the_prefix_allocator():
    assert can_admit(2, 5, 3, 1, 4) and not can_admit(3, 5, 3, 1, 4) and not can_admit(0, 5, 0, 4, 4)
    alloc = PrefixAllocator(4, 2)
    keys = block_hashes([1, 2, 3, 4, 5], 2)
    assert len(keys) == 2 and keys != block_hashes([9, 2, 3, 4], 2)  # a key names its prefix too
    a = alloc.add_sequence()
    alloc.write(a, 0, 4)
    for j, key in enumerate(keys):
        alloc.register(alloc.tables[a][j], key)
    alloc.free_sequence(a)
    assert alloc.n_used == 0 and alloc.lookup(keys) == [0, 1]  # free, yet still findable
    b = alloc.add_sequence()
    alloc.write(b, 0, 4)  # two blocks with no key go first: the cached ones survive
    assert alloc.lookup(keys) == [0, 1]
    c = alloc.add_sequence()
    alloc.write(c, 0, 2)  # now one cached block is evicted: the least recently released, the prefix's tail
    assert alloc.lookup(keys) == [0]


def test_smollm2_requests_equal_alone(smollm2):
    model, tok = smollm2
    system = "You are a helpful assistant. Answer every question briefly, in one short sentence, and politely. "
    prompts = [tok(system + q, return_tensors="pt").input_ids[0] for q in ("What is 2+2?", "Name a color.", "Hi")]
    engine = Engine(model, max_batch_size=2, num_blocks=16)
    for p in prompts:
        engine.add_request(p, max_new_tokens=5, stop_token_ids=[])
    check_alone(model, prompts, engine.run(), [dict(max_new_tokens=5, stop_token_ids=[])] * 3)
    assert engine.metrics()["prefix_cache_hit_rate"] > 0


# ---------------------------------------------------------------- chunked prefill (chapter 3)
@pytest.mark.parametrize("budget,num_blocks,sample", [(3, None, False), (5, None, True), (8, 10, False),
                                                      (16, 8, True), (64, None, False)])
def test_chunked_prefill_keeps_every_request_equal_to_generating_it_alone(tiny, budget, num_blocks, sample):
    """max_num_batched_tokens: a step runs the decodes, then prompt chunks in the space left. Requests
    arrive while others decode; with 8 or 10 blocks of 4, prompts are preempted half prefilled; the
    shared system prompt's blocks are prefix hits. No step runs more tokens than the budget, and a
    prompt longer than the budget takes several steps."""
    prompts = workload(7, seed=5, system=13)
    settings = dict(max_new_tokens=7, stop_token_ids=[]) | (dict(do_sample=True, temperature=0.9) if sample else {})
    engine = Engine(tiny, {"cache_chunk_size": 4}, max_batch_size=3, num_blocks=num_blocks,
                    max_num_batched_tokens=budget)
    configs = []
    for i, p in enumerate(prompts):
        config = settings | ({"seed": 100 + i} if sample else {})
        configs.append(config)
        engine.add_request(p, arrival_s=0.0 if i < 2 else 1e-9 * i, **config)
    out = engine.run()
    check_alone(tiny, prompts, out, configs)
    m = engine.metrics()
    assert m["max_num_batched_tokens"] == budget and max(m["tokens_per_step"]) <= budget
    assert all(s["decode_tokens"] <= 3 for s in m["steps"])
    if budget < 14:  # every prompt is at least 14 tokens: each spreads over several steps
        assert all(r["first_token_s"] > r["first_scheduled_s"] for r in m["requests"])
        assert sum(s["prefill_tokens"] > 0 for s in m["steps"]) > len(prompts)
    if num_blocks is not None:
        assert m["preemptions"] > 0
    assert m["prefix_cache_hit_rate"] > 0


def test_no_forward_pads_its_prompt_chunks_past_the_budget(tiny, monkeypatch):
    """A forward left-pads its chunks to the longest: a 7-token chunk beside a 1-token one would be
    14 rows under a budget of 8. The engine runs them apart, so the budget bounds the activations."""
    engine = Engine(tiny, {"cache_chunk_size": 4}, max_batch_size=3, max_num_batched_tokens=8)
    shapes = []
    prefill = engine.forward_step.prefill

    def recorded(model, ids, *args, **kw):
        shapes.append(tuple(ids.shape))
        return prefill(model, ids, *args, **kw)

    monkeypatch.setattr(engine.forward_step, "prefill", recorded)
    prompts = [torch.arange(1, 12), torch.arange(20, 27), torch.arange(30, 33)]
    for p in prompts:
        engine.add_request(p, max_new_tokens=3, stop_token_ids=[], arrival_s=0.0)
    out = engine.run()
    check_alone(tiny, prompts, [out[i] for i in range(3)], [dict(max_new_tokens=3, stop_token_ids=[])] * 3)
    assert shapes and all(B * T <= 8 for B, T in shapes), shapes
    assert any(B > 1 for B, T in shapes), shapes  # chunks that fit together still share a forward


def test_a_decode_step_of_many_rows_keeps_fp32_under_a_prompt_format(tiny, monkeypatch):
    """prefill_precision is the prompts' format: the engine's decode forward of more than 16 rows
    (SHORT_PROMPT_ROWS) stays in fp32, as generate's decode steps do."""
    from minigen.kernels import cpu
    from minigen.numerics.precision import SHORT_PROMPT_ROWS
    if not cpu.bf16_dot_products():
        pytest.skip("prefill_precision='bfloat16' is refused on a CPU without bf16 dot products")
    engine = Engine(tiny, {"cache_chunk_size": 4, "prefill_precision": "bfloat16"}, max_batch_size=20)
    formats = []

    def recording(run):
        def recorded(model, ids, *args, ops=None, **kw):
            formats.append((ids.shape[1], (ops or model.ops).prompt.dtype(SHORT_PROMPT_ROWS + 1)))
            return run(model, ids, *args, ops=ops, **kw)
        return recorded

    for name in ("prefill", "decode"):  # the engine's prompts and its decode step
        monkeypatch.setattr(engine.forward_step, name, recording(getattr(engine.forward_step, name)))
    for i in range(20):
        engine.add_request(torch.arange(1 + i, 21 + i), max_new_tokens=2, stop_token_ids=[])
    engine.run()
    assert (20, torch.bfloat16) in formats and (1, torch.float32) in formats, formats
    assert all(f == torch.float32 for T, f in formats if T == 1), formats


def test_a_request_cancelled_half_prefilled_gives_its_blocks_back(tiny):
    engine = Engine(tiny, {"cache_chunk_size": 4}, max_batch_size=2, num_blocks=16, max_num_batched_tokens=4)
    long, short = torch.arange(1, 30), torch.arange(40, 46)
    a = engine.add_request(long, max_new_tokens=3, stop_token_ids=[])
    b = engine.add_request(short, max_new_tokens=3, stop_token_ids=[])
    engine.step()
    engine.step()  # 8 of its 29 tokens computed, no token sampled
    assert engine.requests[a].computed == 8 and not engine.requests[a].output
    engine.cancel(a)
    out = engine.run()
    assert out[a].tolist() == long.tolist() and engine.metrics()["requests"][a]["finish_reason"] == "cancelled"
    check_alone(tiny, [short], [out[b]], [dict(max_new_tokens=3, stop_token_ids=[])])
    assert engine.alloc.n_used == 0


@pytest.mark.parametrize("bad", [0, -1, 2, 4.0, True, "256"])
def test_a_step_budget_below_the_batch_is_refused(tiny, bad):
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens=.* is invalid: .* >= max_batch_size=3"):
        Engine(tiny, {"cache_chunk_size": 4}, max_batch_size=3, max_num_batched_tokens=bad)
