"""fused_decode over a paged cache (steps/fused.py: _run_paged; csrc/decode.c: decode_paged): the serving
engine's decode step in one C call, each sequence at its own position, its blocks read and written in
place through the block tables.

Oracle: the eager step over the same paged cache (which gathers the blocks: PagedKVCache.update), on
twin caches: logits to ~1e-5 of their largest, the same keys and values in the pool, the same greedy
tokens; the engine's requests against the eager engine's (tokens and log-probabilities) and against
generating each alone. int8 / int4 rows run the batch GEMMs, whose rows never mix: a row's logits are
the same bits whichever rows share its step.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from conftest import skip_where_aside, tiny_hf
from minigen import Engine, GenerationConfig
from minigen.caches.paged import PagedKVCache
from minigen.errors import PositionError
from minigen.steps import fused
from minigen.steps.eager import EagerStep

pytestmark = pytest.mark.usefixtures("one_thread")


def twin_caches(model, prompts, block_size=4, dtype=torch.float32, shuffle=3):
    """Two paged caches, each with one sequence per prompt prefilled eagerly (left padding), their blocks
    taken in a scrambled order (`shuffle` blocks held by a throwaway sequence then freed: a row's table is
    not 0, 1, 2...) -> (caches, the next position of each row [B, 1])."""
    c, B, T = model.config, len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.full((B, T), -1)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], pos[b, T - len(p):] = p, torch.arange(len(p))
    caches = []
    for _ in range(2):
        cache = PagedKVCache(c.n_layers, 0, c.n_kv_heads, c.head_dim, block_size, 64, dtype)
        junk = cache.add_sequence()
        cache.select_rows([junk])
        cache.reserve(torch.arange(shuffle * block_size)[None])
        cache.select_rows([cache.add_sequence() for _ in prompts])
        cache.free_sequence(junk)
        with torch.inference_mode():
            EagerStep().prefill(model, ids, pos, cache)
        caches.append(cache)
    return caches, torch.tensor([[len(p)] for p in prompts])


def decode_both(model, prompts, steps, int8_act=False, dtype=torch.float32):
    """`steps` greedy tokens of each prompt, eager and fused on twin caches (the eager step's tokens fed to
    both) -> (worst |logit difference| / max |logit|, steps whose argmax agreed in every row, caches)."""
    (eager_cache, fused_cache), pos = twin_caches(model, prompts, dtype=dtype)
    step, ops = fused.FusedStep(int8_act=int8_act), model.ops.configured(int8_act=int8_act)
    token = torch.tensor([[int(p[-1])] for p in prompts])
    worst, same = 0.0, 0
    with torch.inference_mode():
        for _ in range(steps):
            a = EagerStep().decode(model, token, pos, eager_cache, ops=ops)
            b = step.decode(model, token, pos, fused_cache)
            worst = max(worst, ((a - b).abs().max() / a.abs().max()).item())
            same += int(torch.equal(a.argmax(-1), b.argmax(-1)))
            token, pos = a.argmax(-1, keepdim=True), pos + 1
    return worst, same, eager_cache, fused_cache


def prompts_of(lengths, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),  # grouped-query, untied head
    ("qwen2", {}),  # q/k/v biases
    ("llama", dict(hidden_size=40, intermediate_size=72, num_attention_heads=4, num_key_value_heads=1)),  # tails
])
def test_rows_at_their_own_positions_match_the_eager_step_and_its_pool(kind, overrides):
    model = minigen.from_hf(tiny_hf(kind, **overrides))
    worst, same, eager, mine = decode_both(model, prompts_of([3, 9, 6]), 14)
    assert worst < 1e-5 and same == 14, (worst, same)
    torch.testing.assert_close(mine.k, eager.k, atol=1e-5, rtol=1e-5)  # every block, through the tables
    torch.testing.assert_close(mine.v, eager.v, atol=1e-5, rtol=1e-5)


def test_a_bf16_pool_is_written_rounded_as_the_eager_step_rounds():
    model = minigen.from_hf(tiny_hf("llama"))
    worst, same, eager, mine = decode_both(model, prompts_of([5, 2]), 8, dtype=torch.bfloat16)
    assert worst < 1e-2 and mine.k.dtype == torch.bfloat16, worst
    assert (mine.k.float() - eager.k.float()).abs().max() < 2e-2


def test_forked_rows_copy_their_shared_block_before_the_step_writes():
    """parallel sampling's rows share a prompt's half-full block; the first decode step writes each row's
    own copy of it (copy-on-write), in every layer, before C writes the new slot."""
    model = minigen.from_hf(tiny_hf("llama"))
    c, prompt = model.config, prompts_of([6])[0]
    caches = []
    for _ in range(2):
        cache = PagedKVCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 4, 16)
        with torch.inference_mode():
            EagerStep().prefill(model, prompt[None], torch.arange(6), cache)
        cache.fork(3)
        caches.append(cache)
    token, pos = torch.tensor([[1], [2], [3]]), torch.tensor([6])
    with torch.inference_mode():
        a = EagerStep().decode(model, token, pos, caches[0])
        b = fused.FusedStep().decode(model, token, pos, caches[1])
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    tables = [caches[1].allocator.tables[r] for r in caches[1].rows]
    assert len({t[1] for t in tables}) == 3 and len({t[0] for t in tables}) == 1  # own second block, shared first
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-5, rtol=1e-5)
    assert not torch.equal(caches[1].k[:, tables[0][1]], caches[1].k[:, tables[1][1]])  # each row's own token


def test_int4_rows_take_the_batch_gemm_and_never_influence_each_other(smollm2, english_text_ids):
    """int4 codes and int8 activations: the eager batch's GEMM (gemm_q_s8.c) in both steps, so the logits
    agree closely; a row's logits are the same bits whether it shares its step with one row or two."""
    model = minigen.quantize_weights(minigen.loading.build_model(
        minigen.loading.read_config(minigen.loading.resolve_folder("smollm2-135m")),
        minigen.loading.read_safetensors(minigen.loading.resolve_folder("smollm2-135m"))), 4)
    prompts = [english_text_ids[s:s + n] for s, n in ((0, 20), (40, 33), (90, 7))]
    worst, same, _, _ = decode_both(model, prompts, 6, int8_act=True)
    # an activation that C's norm or SiLU puts on the other side of its int8 code's rounding boundary than
    # torch's moves a logit: the contiguous fused step at batch 1 differs from the eager one by ~1.4e-2 of
    # the largest logit too (int8 activations are lossy: tests/test_int8_activations.py bounds the text)
    assert worst < 5e-2 and same >= 5, (worst, same)
    (cache, _), pos = twin_caches(model, prompts)
    step, token = fused.FusedStep(int8_act=True), torch.tensor([[5], [6], [7]])
    with torch.inference_mode():
        three = step.decode(model, token, pos, cache)
        cache.select_rows(cache.rows[:2])
        two = step.decode(model, token[:2], pos[:2], cache)
    assert torch.equal(three[:2], two)


def test_an_unreserved_block_is_refused_before_c_reads_it():
    model = minigen.from_hf(tiny_hf("llama"))
    (cache, _), pos = twin_caches(model, prompts_of([5, 3]))
    with torch.inference_mode(), pytest.raises(PositionError, match="holds no block for some position up to 9.*"
                                                                    "reserve"):
        step = fused.FusedStep()
        step.reserves = False  # the engine's: it reserved nothing for position 9
        step.decode(model, torch.tensor([[1], [2]]), torch.tensor([[9], [3]]), cache)


@pytest.mark.parametrize("num_blocks", [None, 8])  # 8 blocks of 4: preemption is forced
def test_the_engine_runs_it_and_every_request_matches_the_eager_engine(num_blocks):
    """Rows join and leave, share a system prompt's blocks and are preempted: the same tokens as the eager
    engine, and log-probabilities within 1e-4."""
    model = minigen.from_hf(tiny_hf("llama"))
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 97, (9,), generator=g)
    prompts = [torch.cat([shared, torch.randint(0, 97, (n,), generator=g)]) for n in (1, 5, 12, 3, 8, 2)]
    out = {}
    for mode in (True, False):
        engine = Engine(model, {"cache_chunk_size": 4, "fused_decode": mode}, max_batch_size=3, num_blocks=num_blocks)
        assert engine.forward_step.name == ("fused" if mode else "eager")
        ids = [engine.add_request(p, max_new_tokens=9, stop_token_ids=[], logprobs=2) for p in prompts]
        tokens = engine.run()
        out[mode] = [(tokens[i], engine.requests[i].logprobs) for i in ids]
        assert (engine.metrics()["preemptions"] > 0) == (num_blocks == 8)
    for (a, lp_a), (b, lp_b) in zip(out[True], out[False]):
        assert torch.equal(a, b)
        assert max(abs(x[0] - y[0]) for x, y in zip(lp_a, lp_b)) < 1e-4


def test_the_engine_runs_it_on_auto_where_it_measured_faster(smollm2):
    model, _ = smollm2
    skip_where_aside("fused_paged", model)
    engine = Engine(model, GenerationConfig(), max_batch_size=4, num_blocks=32)
    assert engine.forward_step.name == "fused"
    assert "over the paged pool" in engine.plan.parts["decode"] and "measured" in engine.plan.parts["decode"]


def ragged_prompts(lengths, seed=0):
    """Left-padded ids [B, T] and positions [B, T] (-1: padding) of prompts of `lengths`."""
    g, T = torch.Generator().manual_seed(seed), max(lengths)
    ids, pos = torch.zeros(len(lengths), T, dtype=torch.long), torch.full((len(lengths), T), -1)
    for r, n in enumerate(lengths):
        ids[r, T - n:], pos[r, T - n:] = torch.randint(0, 97, (n,), generator=g), torch.arange(n)
    return ids, pos


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_prompt_chunks_in_one_c_call_match_the_eager_prefill(bits):
    """The engine's ragged prompts (left padding) as C's rows, no padding: the last tokens' logits and every
    key and value written, against the eager prefill on a twin cache."""
    model = minigen.from_hf(tiny_hf("llama", hidden_size=64, intermediate_size=128))
    model = minigen.quantize_weights(model, bits) if bits else model
    (eager, mine), _ = twin_caches(model, [torch.tensor([0])] * 3)  # three sequences, blocks scrambled
    for cache in (eager, mine):
        cache.reset()
    ids, pos = ragged_prompts([5, 11, 2])
    step = fused.FusedStep(prompts_in_c=True)
    with torch.inference_mode():
        a = EagerStep().prefill(model, ids, pos, eager)
        b = step.prefill(model, ids, pos, mine)
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5
    torch.testing.assert_close(mine.k, eager.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine.v, eager.v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [None, 12])  # 12: chunked prefill, a prompt over several steps
def test_the_engine_runs_decodes_in_its_prompts_forward_with_their_own_bits(budget):
    """int8 blocks: each step's prompt chunks and decodes in one C call (the weights stream once). Every
    request's tokens equal the eager engine's, and a decode row's log-probabilities are its decode step's."""
    model = minigen.quantize_weights(minigen.from_hf(tiny_hf("llama", hidden_size=64, intermediate_size=128)), 8)
    skip_where_aside("fused_paged_prompt", model)
    prompts = prompts_of([4, 13, 7, 2, 9, 5], seed=2)
    out, mixed_steps = {}, 0
    for mode in (True, False):
        engine = Engine(model, {"cache_chunk_size": 4, "fused_decode": mode, "int8_activations": False},
                        max_batch_size=3, max_num_batched_tokens=budget)
        assert engine.forward_step.takes_decodes_with_prompts(engine.plan.prompt_ops) == mode
        ids = [engine.add_request(p, max_new_tokens=4 + 2 * i, stop_token_ids=[], logprobs=1)
               for i, p in enumerate(prompts)]  # rows finish apart: a prompt joins rows that decode
        tokens = engine.run()
        out[mode] = [(tokens[i], engine.requests[i].logprobs) for i in ids]
        mixed_steps += mode * sum(s["prefill_tokens"] > 0 and s["decode_tokens"] > 0 for s in engine.steps)
    assert mixed_steps > 0  # steps that ran decodes beside prompts
    for (a, lp_a), (b, lp_b) in zip(out[True], out[False]):
        assert torch.equal(a, b)
        assert max(abs(x[0] - y[0]) for x, y in zip(lp_a, lp_b)) < 1e-4
