"""The chapters' exercises: each worked solution passes its checker, common wrong answers fail it
with their hint, and the package formulas the checkers trust match an independent count (chapter
1 in depth; chapters 5-8 through their checkers, which call the package's caches and attention)."""

from __future__ import annotations

import math
import re
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import minigen.model
from minigen.course.exercises import ExerciseFailed, ch01, ch05, ch06, ch07, ch08
from minigen.model import Model, rope_frequencies
from minigen.checkpoints.model_config import ModelConfig


# ---------------------------------------------------------------- the oracle behind the checkers
def dense_attend(q, k, v, mask, fp32_softmax=True, bf16=False):
    """Attention written the obvious way, so FlopCounterMode sees its two matmuls (the fused SDPA
    kernel on CPU is invisible to it): q [B, H, T, Dh], k, v [B, Hkv, S, Dh], mask [T, S] bool
    or additive float, or attention.Causal (bf16: attention.attend's, False in an fp32 forward)."""
    if isinstance(mask, minigen.attention.Causal):  # a prompt from position 0: the first T slots, lower triangle
        k, v, mask = k[:, :, :mask.T], v[:, :, :mask.T], torch.ones(mask.T, mask.T, dtype=torch.bool).tril()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, S, Dh]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5  # [B, H, T, S]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(-1) @ v


def tiny_model(arch: str, std: float = 0.1) -> Model:
    cfg = ModelConfig(arch=arch, vocab_size=50, dim=32, n_layers=2, n_heads=4,
                      n_kv_heads=2 if arch == "llama" else 4, head_dim=8, hidden_dim=48, max_seq_len=64)
    model = Model(cfg)
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, std)
    if arch == "llama":
        model.inv_freq = rope_frequencies(cfg)
    return model


def counted_flops(model: Model, tokens: int, cache=None, start: int = 0) -> int:
    pos = torch.arange(start, start + tokens)
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, tokens, dtype=torch.long), pos, cache, last_only=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_forward_flops_matches_counted_matmuls(arch, monkeypatch):
    monkeypatch.setattr(minigen.model, "attend", dense_attend)
    model = tiny_model(arch)
    cfg = model.config
    for n in (1, 5, 13):  # a naive step: n tokens attending n keys, logits for the last
        assert counted_flops(model, n) == cfg.forward_flops(n, n)
    # A cached decode step attends every slot of the preallocated cache (masked or not).
    cache = minigen.caches.contiguous.KVCache.for_model(model, 1, 20)
    counted_flops(model, 6, cache)
    assert counted_flops(model, 1, cache, start=6) == cfg.forward_flops(1, 20)


# ---------------------------------------------------------------- chapter 1
def copy_of(solution):
    """The worked solution's code in a new function object: a wrong answer built on it is not refused
    as 'calls minigen's own' (the checkers forbid the solution object itself)."""
    return types.FunctionType(solution.__code__, solution.__globals__, solution.__name__, solution.__defaults__)


naive_flops, crossover = copy_of(ch01.solution_naive_step_flops), copy_of(ch01.solution_crossover_length)


def test_naive_step_flops_solution_passes():
    assert ch01.check_naive_step_flops(ch01.solution_naive_step_flops)


@pytest.mark.parametrize("wrong, hint", [
    (lambda cfg, n: naive_flops(cfg, n) // 2, "multiply-add"),
    (lambda cfg, n: naive_flops(cfg, n) - 2 * cfg.dim * cfg.vocab_size, "output head"),
    (lambda cfg, n: naive_flops(cfg, n) - 4 * cfg.n_layers * n * n * cfg.n_heads * cfg.head_dim,
     "attention itself"),
    (lambda cfg, n: naive_flops(cfg, n) + 1, None),
])
def test_naive_step_flops_wrong_answers_fail(wrong, hint):
    with pytest.raises(ExerciseFailed) as err:
        ch01.check_naive_step_flops(wrong)
    if hint:
        assert hint in str(err.value)


def test_naive_step_flops_ignoring_gqa_gets_the_hint():
    def no_gqa(cfg, n):
        full = ModelConfig(**{**cfg.__dict__, "n_kv_heads": cfg.n_heads})
        return naive_flops(full, n)
    with pytest.raises(ExerciseFailed, match="grouped-query"):
        ch01.check_naive_step_flops(no_gqa)


def test_crossover_length():
    assert ch01.check_crossover_length(ch01.solution_crossover_length)
    assert ch01.solution_crossover_length(ch01.SMOLLM2_135M) == 3072  # 7,077,888 / (4·9·64)
    with pytest.raises(ExerciseFailed, match="two products"):
        ch01.check_crossover_length(lambda cfg: 2 * crossover(cfg))
    with pytest.raises(ExerciseFailed):
        ch01.check_crossover_length(lambda cfg: 1.05 * crossover(cfg))


# chapter 2's exercise (the learner's KV cache): tests/test_exercise_ch02.py


# ---------------------------------------------------------------- chapter 0
def test_greedy_until():
    from minigen.course.exercises import ch00
    from minigen.caches.make import make_cache
    from minigen.sampling import sample
    from minigen.steps.eager import decode_step, prefill
    # Wide weights, so that logits depend strongly on positions and a wrong one changes the tokens.
    model = tiny_model("llama", std=0.5)
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    assert ch00.check_greedy_until(ch00.solution_greedy_until, model, ids, n=8)

    def loop(shift=0, keep_stop=True, stop_rule=True, extra=0):
        def answer(model, ids, n, stop_ids):
            config = minigen.GenerationConfig(max_new_tokens=n)
            T, out = ids.shape[1], [ids]
            cache = make_cache(model, config, 1, T + n + 2)
            logits = prefill(model, ids, cache)
            for i in range(n):
                token = sample(logits, config)
                if stop_rule and int(token) in stop_ids:
                    if keep_stop:
                        out.append(token[:, None])
                    for _ in range(extra):  # one token too many after the stop
                        logits = decode_step(model, token[:, None], torch.tensor([T + i]), cache)
                        out.append(sample(logits, config)[:, None])
                    break
                out.append(token[:, None])
                logits = decode_step(model, token[:, None], torch.tensor([T + i + shift]), cache)
            return torch.cat(out, dim=1)
        return answer

    assert ch00.check_greedy_until(loop(), model, ids, n=8)  # written independently: passes
    for wrong, hint in ((loop(shift=1), "position T \\+ i"), (loop(keep_stop=False), "keep the stop token"),
                        (loop(stop_rule=False), "keep the stop token"), (loop(extra=1), "keep the stop token"),
                        (lambda m, i, n, s: i, "you returned 0 new tokens")):
        with pytest.raises(ExerciseFailed, match=hint):
            ch00.check_greedy_until(wrong, model, ids, n=8)
    with pytest.raises(ExerciseFailed, match="shape|tensor"):
        ch00.check_greedy_until(lambda m, i, n, s: None, model, ids, n=8)


# ---------------------------------------------------------------- chapters 5-8
@pytest.mark.parametrize("check, solution", [
    (ch05.check_slot_of, ch05.solution_slot_of), (ch05.check_blocks_held, ch05.solution_blocks_held),
    (ch06.check_quantize_group, ch06.solution_quantize_group),
    (ch06.check_quantized_cache_bytes, ch06.solution_quantized_cache_bytes),
    (ch07.check_slot_of, ch07.solution_slot_of), (ch07.check_window_attention, ch07.solution_window_attention),
    (ch08.check_keep_keys, ch08.solution_keep_keys), (ch08.check_attention_entropy, ch08.solution_attention_entropy),
], ids=lambda f: f.__module__.rsplit(".", 1)[-1] + "." + f.__name__)
def test_worked_solutions_pass_their_checkers(check, solution):
    """The checkers ask the package itself (paged and ring-buffer caches, quantized stores,
    attention), so this also catches a change of the package that the chapters' cells would hit."""
    assert check(solution)


def test_quantized_cache_bytes_counts_an_fp16_models_cache():
    """Chapter 6's exercise is about an fp16 model: fp16 scales, zeros and window. 4,096 tokens at
    4 bits in groups of 32 with a 32-token window: 4,064 tokens quantized at 4 + 1 bits per element
    (keys per channel and values per token each add an fp16 scale and zero per 32 elements), and
    32 tokens at 16 bits, for each of K and V in every layer, KV head and channel."""
    cfg = ch06.SMOLLM2_135M
    channels = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    assert ch06.solution_quantized_cache_bytes(cfg, 4096, 4, 32, 32) == 2 * channels * (4064 * 5 // 8 + 32 * 2)
    with pytest.raises(ExerciseFailed, match="fp16: 2 bytes"):  # an fp32 window is the old answer
        ch06.check_quantized_cache_bytes(lambda *args: ch06._mistaken_bytes(*args, window_bytes=4))
    with pytest.raises(ExerciseFailed, match="scale and zero"):
        ch06.check_quantized_cache_bytes(lambda *args: ch06._mistaken_bytes(*args, meta_numbers=0))


# ---------------------------------------------------------------- chapter 9
def test_round_mantissa_is_ieee_rounding():
    """round_mantissa against torch's own conversions: 7 bits is bf16 (whole fp32 range), 10 bits is
    fp16 inside fp16's normal range (TF32 has fp16's mantissa and fp32's exponent), 23 is the identity."""
    from minigen.course.exercises import ch09
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(4096, generator=g) * 10.0 ** (torch.rand(4096, generator=g) * 60 - 30)
    assert torch.equal(ch09.round_mantissa(wide, 7), wide.to(torch.bfloat16).float())
    normal = torch.randn(4096, generator=g) * 100  # |x| in fp16's normal range, up to ~400
    normal = normal[normal.abs() > 1e-4]
    assert torch.equal(ch09.round_mantissa(normal, 10), normal.half().float())
    assert torch.equal(ch09.round_mantissa(wide, 23), wide)
    assert ch09.bit_fields(1.0, torch.bfloat16) == "0 | 01111111 | 0000000"
    assert ch09.bit_fields(-2.0, torch.float16) == "1 | 10000 | 0000000000"


# ---------------------------------------------------------------- chapter 12
def test_dequantize_on_load():
    from minigen.course.exercises import ch12
    assert ch12.check_dequantize_on_load(ch12.solution_dequantize_on_load)
    for wrong, hint in ch12.MISTAKES:
        with pytest.raises(ExerciseFailed, match=re.escape(hint)):
            ch12.check_dequantize_on_load(wrong)
    with pytest.raises(ExerciseFailed, match="shape"):
        ch12.check_dequantize_on_load(lambda codes, scales, zeros, channel, G: codes.float())


# ---------------------------------------------------------------- chapter 10
def test_ch10_pack4_checker_takes_the_solution_and_names_the_usual_mistakes():
    from minigen.course.exercises import ch10
    assert ch10.check_pack4(ch10.solution_pack4) and ch10.check_unpack4(ch10.solution_unpack4)

    def adjacent(codes):  # codes j and j + 1 in one byte: the layout many people expect
        pairs = codes.unflatten(-1, (-1, 2))
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)

    def nibbles_swapped(codes):  # code j + 16 low, code j high (the answers are built here, not
        c = codes.unflatten(-1, (-1, 2, 16))  # from ch10's solutions, which the checkers forbid)
        return (c[..., 1, :] | (c[..., 0, :] << 4)).flatten(-2).to(torch.uint8)

    def right_but_int64(codes):
        c = codes.long().unflatten(-1, (-1, 2, 16))
        return (c[..., 0, :] | (c[..., 1, :] << 4)).flatten(-2)

    with pytest.raises(ExerciseFailed, match="not with code j \\+ 1"):
        ch10.check_pack4(adjacent)
    with pytest.raises(ExerciseFailed, match="low nibble, code j \\+ 16 in the high"):
        ch10.check_pack4(nibbles_swapped)
    with pytest.raises(ExerciseFailed, match="not torch.uint8"):
        ch10.check_pack4(right_but_int64)
    unmasked = lambda d: torch.cat([d.unflatten(-1, (-1, 16)), d.unflatten(-1, (-1, 16)) >> 4], -1).flatten(-2)  # noqa: E731
    with pytest.raises(ExerciseFailed, match="& 0xF"):
        ch10.check_unpack4(unmasked)


# ---------------------------------------------------------------- chapters 17 and 18 (issue 26, part 5)
def test_ch17_the_reader_builds_a_roofline_point_and_wrong_or_copied_answers_fail():
    from minigen.course.exercises import ch17
    from minigen.measure.roofline import decode_point, streamed_params, tokens_per_s
    assert ch17.check_decode_step(ch17.solution_decode_step)
    assert ch17.check_bound_tokens_per_s(ch17.solution_bound_tokens_per_s)
    # a reader's own right answer passes (not the worked solution: the package's functions are forbidden)
    assert ch17.check_decode_step(lambda c, b, n, wb, kb: (
        b * c.forward_flops(1, n), streamed_params(c) * wb + b * n * c.kv_bytes_per_token(kb)))
    assert ch17.check_bound_tokens_per_s(lambda g, f, nb, b: b / max(f / g.peak_flops, nb / g.bandwidth))
    # the known wrong answers (issue 26: the formula was in the docstring) and one planted of each kind
    for wrong, hint in (
            (lambda c, b, n, wb, kb: (b * c.forward_flops(1, n), b * streamed_params(c) * wb
                                      + b * n * c.kv_bytes_per_token(kb)), "read once for the whole batch"),
            (lambda c, b, n, wb, kb: (b * c.forward_flops(1, n), streamed_params(c) * wb), "keys and values"),
            (lambda c, b, n, wb, kb: (c.forward_flops(1, n), streamed_params(c) * wb + b * n * c.kv_bytes_per_token(kb)),
             "the batch multiplies the FLOPs"),  # wrong axis: the batch left out of the FLOPs
            (lambda c, b, n, wb, kb: (b * c.forward_flops(1, n), streamed_params(c) * wb
                                      + b * n * c.kv_bytes_per_token(wb)), "stored at kv_bytes"),  # wrong width
            (lambda c, b, n, wb, kb: (b * c.forward_flops(1, n), streamed_params(c) * wb
                                      + b * (n - 1) * c.kv_bytes_per_token(kb)), "expected"),  # off by one position
            (lambda c, b, n, wb, kb: b * c.forward_flops(1, n), "return a pair")):
        with pytest.raises(ExerciseFailed, match=hint):
            ch17.check_decode_step(wrong)
    for wrong, hint in ((lambda g, f, nb, b: 1 / max(f / g.peak_flops, nb / g.bandwidth), "every row of the batch"),
                        (lambda g, f, nb, b: b * g.bandwidth / nb, "bound by compute"),
                        (lambda g, f, nb, b: b / (f / g.peak_flops + nb / g.bandwidth), "not their sum"),
                        (lambda g, f, nb, b: b / min(f / g.peak_flops, nb / g.bandwidth), "max, not min")):
        with pytest.raises(ExerciseFailed, match=hint):
            ch17.check_bound_tokens_per_s(wrong)
    # answers that call minigen's own, by any name
    for copied in (lambda c, b, n, wb, kb: (decode_point(c, b, n, wb, kb).flops, decode_point(c, b, n, wb, kb).bytes),
                   lambda c, b, n, wb, kb: ch17.solution_decode_step(c, b, n, wb, kb)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch17.check_decode_step(copied)
    for copied in (lambda g, f, nb, b: b / g.step_seconds(f, nb),
                   lambda g, f, nb, b: ch17.solution_bound_tokens_per_s(g, f, nb, b)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch17.check_bound_tokens_per_s(copied)
    assert tokens_per_s(ch17.A100_80GB, decode_point(ch17.SHAPES["Llama-2-7B"], 1, 16)) > 0  # restored after


def test_ch18_the_reader_builds_the_planners_rule_and_wrong_or_copied_answers_fail():
    from minigen.course.exercises import ch18
    planner = ch18.planner
    assert ch18.check_plan_choice(ch18.solution_plan_choice)

    def mine(rows, weights, budget, *, fits=lambda need, room: need <= room, order=None, rank=None,
             count_weights=True, none=None):
        """A reader's answer, with one part of the rule changed by the keyword given."""
        room = budget - (weights if count_weights else 0)
        found = []
        for r in rows:
            chunks = sorted((c for c in r["bytes"] if c is not None), reverse=True)
            for chunk in (order(chunks) if order else [None, *chunks]):
                kv, acts = r["bytes"][chunk]
                if fits(kv + acts, room):
                    found.append((r["expected_loss_pct"], weights + kv + acts,
                                  dict(r["config"], **({"prefill_chunk_size": chunk} if chunk else {}))))
                    break
        if not found:
            return none
        return min(found, key=rank or (lambda f: (f[0], f[1])))[2]

    assert ch18.check_plan_choice(mine)  # the reader's own right answer
    assert ch18.check_plan_choice(lambda rows, w, b: mine(rows[::-1], w, b))  # ties go either way
    for kwargs, hint in (
            (dict(count_weights=False), "holds the weights too"),
            (dict(order=lambda chunks: [None]), "run it in chunks"),
            (dict(order=lambda chunks: [None, *chunks[::-1]]), "largest chunk first"),
            (dict(order=lambda chunks: chunks), "take it wherever it fits"),
            (dict(rank=lambda f: (f[1], f[0])), "rank by expected_loss_pct first"),  # the old "fewest bytes"
            (dict(rank=lambda f: (f[0], -f[1])), "the fewest bytes"),
            (dict(fits=lambda need, room: need < room), "exactly the budget fits"),  # off by one
            (dict(none={}), "return None")):
        with pytest.raises(ExerciseFailed, match=hint):
            ch18.check_plan_choice(lambda rows, w, b, kw=kwargs: mine(rows, w, b, **kw))
    least_loss = lambda rows, w, b: min(rows, key=lambda r: (r["expected_loss_pct"],  # noqa: E731  fit ignored
                                                             sum(r["bytes"][None])))["config"]
    for wrong, hint in ((least_loss, "more than the budget"), (lambda rows, w, b: None, "some settings fit"),
                        (lambda rows, w, b: {"quant_bits": 3}, "one of the rows")):
        with pytest.raises(ExerciseFailed, match=hint):
            ch18.check_plan_choice(wrong)
    # answers that call minigen's own planner or the worked solution
    for copied in (lambda rows, w, b: ch18.solution_plan_choice(rows, w, b),
                   lambda rows, w, b: planner.plan(ch18.SMOLLM2, batch=8, context=8192, budget_bytes=b).config):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch18.check_plan_choice(copied)
    assert planner.plan(ch18.SMOLLM2, batch=8, context=8192, budget_bytes=6 * 2**30).fits  # restored after


# ---------------------------------------------------------------- chapter 14
def test_ch14_group_checker_takes_the_solution_and_names_the_usual_mistakes():
    from minigen.course.exercises import ch14
    assert ch14.check_group(ch14.solution_group)

    def arrival_order(lengths, b):  # the batches a FIFO cut gives: more padding
        return [list(range(i, min(i + b, len(lengths)))) for i in range(0, len(lengths), b)]

    with pytest.raises(ExerciseFailed, match="sort the requests by length"):
        ch14.check_group(arrival_order)
    with pytest.raises(ExerciseFailed, match="never drops a request"):
        ch14.check_group(lambda lengths, b: arrival_order(lengths, b)[:-1])
    with pytest.raises(ExerciseFailed, match="runs alone"):
        ch14.check_group(lambda lengths, b: [sorted(range(len(lengths)), key=lambda i: lengths[i])[j:j + b]
                                             for j in range(0, len(lengths), b)])
    with pytest.raises(ExerciseFailed, match="use 1 to"):
        ch14.check_group(lambda lengths, b: [list(range(len(lengths)))])


# ---------------------------------------------------------------- chapter 13
@pytest.mark.usefixtures("one_thread")
def test_ch13_distribution_tools_agree_with_plain_sampling():
    """The exact joint of a tiny model's continuations sums to 1, and plain sampling (no speculation)
    passes the chi-square test against it, while sampling at another temperature does not."""
    from minigen.course import distributions
    model = distributions.tiny_llama(8, seed=0)
    prompt = torch.tensor([1, 5, 2, 7])
    config = minigen.GenerationConfig(do_sample=True, max_new_tokens=2, stop_token_ids=[], seed=0)
    exact = distributions.continuation_probabilities(model, prompt, 2, config)
    assert exact.shape == (8, 8) and abs(float(exact.sum()) - 1) < 1e-9
    for temperature, passes in ((1.0, True), (0.7, False)):
        out = minigen.generate(model, prompt.expand(4000, -1), config, temperature=temperature)
        counts = distributions.outcome_counts(out.tokens[:, len(prompt):], 8)
        assert counts.sum() == 4000
        assert (distributions.chi_square(counts, exact)[2] > 1e-3) == passes, temperature
    # a count where the distribution puts nothing: impossible under it, p-value 0
    assert distributions.chi_square(torch.tensor([5.0, 5.0, 1.0]), torch.tensor([0.5, 0.5, 0.0]))[2] == 0.0


@pytest.mark.usefixtures("one_thread")
def test_ch13_accept_checker_takes_the_solution_and_refuses_wrong_rules():
    import sys
    from minigen import drafts
    from minigen.course import distributions
    from minigen.course.exercises import ch13
    from minigen.sampling import probabilities
    from minigen.steps import speculative
    from minigen.steps.speculative import accept_sampled
    assert ch13.check_accept_sampled(ch13.solution_accept_sampled)
    # minigen's own rule passes the same distribution test (what the checker holds answers to)
    model, (label, case, prompt) = distributions.tiny_llama(8, seed=0), ch13._cases()[0]
    counts, _ = ch13.run_rule(accept_sampled, model, prompt, case["config"], drafts.layer_skip(model, 1))
    exact = distributions.continuation_probabilities(model, prompt, ch13.NEW, case["config"]).sum(0)
    assert distributions.chi_square(counts, exact)[2] > ch13.P_MIN

    def ignores_the_config(logits, proposal, q, config, generator):  # the rule on softmax of the raw logits
        p = torch.softmax(logits.double(), dim=-1)
        for i, x in enumerate(proposal):
            q_x = 1.0 if q is None else float(q[i, x])
            if float(torch.rand((), generator=generator)) * q_x >= float(p[i, x]):
                residual = p[i].clone() if q is None else (p[i] - q[i]).clamp(min=0)
                if q is None:
                    residual[x] = 0
                return list(proposal[:i]) + [int(torch.multinomial(residual, 1, generator=generator))]
        return list(proposal) + [int(torch.multinomial(p[len(proposal)], 1, generator=generator))]

    def never_keeps(logits, proposal, q, config, generator):
        return [int(torch.multinomial(probabilities(logits, config)[0], 1, generator=generator))]

    for wrong, hint in ((ch13.keep_every_proposal, "you keep every proposal"),
                        (ch13.resample_from_target, "residual max\\(0, p - q\\)"),
                        (ignores_the_config, "probabilities\\(logits, config\\)"),
                        (never_keeps, "every guess must be kept"),
                        (lambda *args: None, "returned None"),
                        (lambda logits, proposal, *rest: list(proposal) + [0, 0], "tokens for")):
        with pytest.raises(ExerciseFailed, match=hint):
            ch13.check_accept_sampled(wrong)
    # an answer that calls minigen's rule, imported by name or looked up in its module, fails
    for calls in (accept_sampled, lambda *args: accept_sampled(*args), lambda *args: speculative.accept_sampled(*args)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own accept_sampled"):
            ch13.check_accept_sampled(calls)
    assert speculative.accept_sampled is accept_sampled and sys.getprofile() is None  # the checker put them back


# ---------------------------------------------------------------- chapter 12: FlashAttention's key tiles
def test_ch12_visible_tiles_checker_takes_the_solution_and_names_the_usual_mistakes():
    import math
    from minigen.course.exercises import ch12
    assert ch12.check_visible_tiles(ch12.solution_visible_tiles)
    # the rule pair by pair and the Triton kernel's own count agree (what the checker holds answers to)
    assert ch12.kernel_visits(5, 16, 20, 4) == [len(ch12.expected_tiles(16 * i, 16 * i + 15, 16, 20, 4))
                                                for i in range(5)]

    def no_skipping(first, last, bn, window, sinks):  # every tile up to the diagonal, window or not
        return list(range(last // bn + 1))

    def last_querys_window(first, last, bn, window, sinks):
        if window is None:
            return list(range(last // bn + 1))
        far = max(last - window + 1, 0) // bn
        return sorted(set(range(math.ceil(min(sinks, last + 1) / bn))) | set(range(far, last // bn + 1)))

    def forgets_sinks(first, last, bn, window, sinks):
        return list(range(0 if window is None else max(first - window + 1, 0) // bn, last // bn + 1))

    def past_the_diagonal(first, last, bn, window, sinks):
        return list(range(last // bn + 2))

    for wrong, hint in ((no_skipping, "wholly outside every query's window"),
                        (last_querys_window, "the first query's window"),
                        (forgets_sinks, "sinks stay visible"), (past_the_diagonal, "causality"),
                        (lambda *args: None, "returned None")):
        with pytest.raises(ExerciseFailed, match=hint):
            ch12.check_visible_tiles(wrong)
    with pytest.raises(ExerciseFailed, match="calls minigen's own solution_visible_tiles"):
        ch12.check_visible_tiles(lambda *args: ch12.solution_visible_tiles(*args))


# ---------------------------------------------------------------- the rule every checker follows
def test_forbidding_catches_an_answer_that_calls_the_solution_by_any_name():
    from minigen.course.exercises import forbidding
    from minigen.numerics import weight_quant
    codes = torch.arange(64, dtype=torch.uint8) % 16
    alias = weight_quant.pack4
    for answer in (alias, lambda c: alias(c), lambda c: weight_quant.pack4(c.clone())):
        with pytest.raises(ExerciseFailed, match="calls minigen's own pack4"), forbidding(weight_quant.pack4):
            answer(codes)
    assert torch.equal(alias(codes), weight_quant.pack4(codes))  # restored afterwards
    with pytest.raises(ValueError), forbidding(weight_quant.pack4):  # other errors pass through untouched
        raise ValueError("the answer's own mistake")


# ================================================================ chapters 12 and 14 (issue 26)
# Each exercise's worked solution passes, each known and planted wrong answer fails with its hint, and
# an answer that calls minigen's own solution fails, however it is reached.
def test_ch12_dequantize_on_load_refuses_an_answer_that_calls_quants_own():
    from minigen.course.exercises import ch12
    from minigen.numerics import quant
    from minigen.numerics.quant import QuantizedTensor

    def through_dequantize(codes, scales, zeros, channel, G):
        q = QuantizedTensor(codes, scales, zeros, 4, G, -1, torch.float32)
        return quant.dequantize(q)[..., channel]

    def through_unpack(codes, scales, zeros, channel, G):
        code = quant.unpack(codes, 4)[..., channel].float()
        return zeros[..., channel // G].float() + code * scales[..., channel // G].float()

    label, args, want = ch12._cases()[1]
    assert torch.equal(through_dequantize(*args), want) and torch.equal(through_unpack(*args), want)  # right, unforbidden
    for cheat, name in ((through_dequantize, "dequantize"), (through_unpack, "unpack"),
                        (lambda *args: ch12.solution_dequantize_on_load(*args), "solution_dequantize_on_load")):
        with pytest.raises(ExerciseFailed, match=f"calls minigen's own {name}"):
            ch12.check_dequantize_on_load(cheat)
    assert ch12.check_dequantize_on_load(ch12.solution_dequantize_on_load)  # restored


def test_ch12_merge_kernel_checker_takes_the_solution_and_names_the_usual_mistakes():
    from minigen.course.exercises import ch12
    from minigen.kernels import triton_attention
    from minigen.kernels.triton_attention import tl, triton
    assert ch12.check_merge_splits(ch12.solution_merge_kernel)
    for wrong, hint in ch12.MERGE_MISTAKES:  # forgetting the rescale, dividing first, no max, off by one, wrong axis...
        with pytest.raises(ExerciseFailed, match=re.escape(hint)):
            ch12.check_merge_splits(wrong)

    @triton.jit
    def does_nothing(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)  # noqa: F841

    @triton.jit
    def wraps_the_solution(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
        # a kernel runs with its module's globals: minigen is imported at the top of this file
        minigen.course.exercises.ch12.solution_merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P, BLOCK_D)

    class CallsMinigensMerge(triton.runtime.KernelInterface):  # launched like a kernel, merges in torch
        def run(self, m, l, o, out, P, D, grid, warmup, **constants):
            out.copy_(triton_attention.merge_splits(o / l[..., None], m + l.log()))

    with pytest.raises(ExerciseFailed, match="stored nothing"):
        ch12.check_merge_splits(does_nothing)
    with pytest.raises(ExerciseFailed, match="calls this module's worked solution"):
        ch12.check_merge_splits(wraps_the_solution)
    with pytest.raises(ExerciseFailed, match="calls minigen's own merge_splits"):
        ch12.check_merge_splits(CallsMinigensMerge())
    with pytest.raises(ExerciseFailed, match="the @triton.jit kernel itself"):
        ch12.check_merge_splits(lambda *args: None)


def test_ch14_checkers_refuse_answers_that_call_minigens_batcher_or_admission_rule():
    """Issue 26's cheats: exercise 1 passed with batching.group_by_length, and chapter 14 printed
    scheduler.can_admit, exercise 2's exact answer, before asking for it."""
    from minigen.course.exercises import ch14
    from minigen.serving import batching
    from minigen.serving.batching import group_by_length
    for cheat in (group_by_length, lambda lengths, b: batching.group_by_length(lengths, b)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own group_by_length"):
            ch14.check_group(cheat)
    with pytest.raises(ExerciseFailed, match="calls minigen's own solution_group"):
        ch14.check_group(lambda lengths, b: ch14.solution_group(lengths, b))
    # (exercise 2, admission with preemption, is tested in test_exercise_ch14.py)
    # the worked solution still passes, and the package's function is back
    assert ch14.check_group(ch14.solution_group)
    assert batching.group_by_length([3, 1], 2) == [[1, 0]]
# ---------------------------------------------------------------- chapters 0, 1, 2 and 5 (issue 26): the reader builds
def test_ch00_greedy_checker_refuses_an_answer_that_calls_minigens_loop():
    from minigen.course.exercises import ch00
    model, ids = tiny_model("llama", std=0.5), torch.tensor([[3, 14, 15, 9, 2, 6]])
    for cheat in (lambda m, i, n, s: minigen.generate(m, i, max_new_tokens=n, stop_token_ids=list(s)).tokens,
                  lambda m, i, n, s: ch00.solution_greedy_until(m, i, n, s)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch00.check_greedy_until(cheat, model, ids, n=4)


@pytest.mark.parametrize("cheat", [
    lambda cfg, n: cfg.forward_flops(n, n),
    lambda cfg, n: ch01.solution_naive_step_flops(cfg, n),
], ids=["package", "solution"])
def test_ch01_naive_step_checker_refuses_the_packages_count(cheat):
    with pytest.raises(ExerciseFailed, match="calls minigen's own"):
        ch01.check_naive_step_flops(cheat)


def test_ch01_crossover_checker_refuses_the_packages_count():
    # what the chapter's section 4 does with forward_flops: the answer the reader must not copy
    def read_off(cfg):
        return (cfg.forward_flops(1, 0) - cfg.forward_flops(0, 0)) / (cfg.forward_flops(1, 1) - cfg.forward_flops(1, 0))
    for cheat in (read_off, lambda cfg: ch01.solution_crossover_length(cfg)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch01.check_crossover_length(cheat)
    with pytest.raises(ExerciseFailed, match="per-token"):  # planted: half of it
        ch01.check_crossover_length(lambda cfg: crossover(cfg) / 2)


def ch05_write(variant):
    """The allocator's write with one planted mistake (see ch05's docstring for the rule)."""
    import math

    def write(alloc, seq, start, end):
        bs, table, copies = alloc.block_size, alloc.tables[seq], []
        last = end // bs if variant == "floor" else math.ceil(end / bs)  # "floor": off by one block
        for j in range(start // bs, last):
            if j >= len(table):
                table.append(alloc.take())
            elif variant != "never copies" and (alloc.refs[table[j]] > 1 or variant == "always copies"):
                src, dst = table[j], alloc.take()
                if variant != "keeps the count":
                    alloc.refs[src] -= 1
                if variant != "empty copy":
                    alloc.fill[dst] = alloc.fill[src]
                table[j] = dst
                copies.append((dst, src) if variant == "swapped" else (src, dst))
            alloc.fill[table[j]] = max(alloc.fill[table[j]], min(bs, end - j * bs))
        if variant != "no length":
            alloc.lengths[seq] = max(alloc.lengths[seq], end)
        return copies
    return write


def test_ch05_write_checker_takes_the_solution_and_a_rewrite():
    assert ch05.check_write(ch05.solution_write)
    assert ch05.check_write(ch05_write("correct"))  # written independently of the solution


@pytest.mark.parametrize("variant, hint", [
    ("never copies", "must be copied before it is written"),
    ("always copies", "last holder"),
    ("keeps the count", "decrement its reference count"),
    ("empty copy", "its fill starts at the source's"),
    ("floor", "round end / block_size up"),
    ("swapped", "(src, dst) pairs"),
    ("no length", "new length"),
])
def test_ch05_write_checker_names_each_planted_mistake(variant, hint):
    with pytest.raises(ExerciseFailed, match=re.escape(hint)):
        ch05.check_write(ch05_write(variant))


def test_ch05_checkers_refuse_minigens_own():
    from minigen.caches.blocks import BlockAllocator
    for cheat in (lambda alloc, seq, start, end: alloc.write(seq, start, end), BlockAllocator.write,
                  lambda *args: ch05.solution_write(*args)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch05.check_write(cheat)
    for cheat in (ch05._slot_by_package, lambda *args: ch05.solution_slot_of(*args)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch05.check_slot_of(cheat)
    with pytest.raises(ExerciseFailed, match="calls minigen's own"):
        ch05.check_blocks_held(lambda *args: ch05.solution_blocks_held(*args))
    with pytest.raises(ExerciseFailed, match="multiply the physical block"):  # planted: wrong scale
        ch05.check_slot_of(lambda table, p, bs: table[p // bs] + p % bs)
    with pytest.raises(ExerciseFailed, match="partly filled block is copied"):  # planted: partial block shared
        ch05.check_blocks_held(lambda T, w, n, bs: math.ceil(T / bs) + n * (math.ceil((T + w) / bs) - math.ceil(T / bs)))
# ---------------------------------------------------------------- chapters 13 and 3: answers that call minigen's own
# (issue 26) The checkers run the answer inside `forbidding`: the package's function that is the answer,
# and the chapter's worked solution, raise by whatever name the answer reaches them.
@pytest.mark.usefixtures("one_thread")
def test_ch13_accept_checker_refuses_minigens_rule_and_the_worked_solution_by_any_name():
    from minigen.course.exercises import ch13
    from minigen.steps import speculative
    rule, solution = speculative.accept_sampled, ch13.solution_accept_sampled
    for calls, name in ((rule, "accept_sampled"), (lambda *args: rule(*args), "accept_sampled"),
                        (lambda *args: solution(*args), "solution_accept_sampled"),
                        (lambda *args: ch13.solution_accept_sampled(*args), "solution_accept_sampled")):
        with pytest.raises(ExerciseFailed, match=f"calls minigen's own {name}"):
            ch13.check_accept_sampled(calls)
    # both are themselves again afterwards (their code was swapped only while the answer ran)
    assert speculative.accept_sampled is rule and rule.__code__.co_name == "accept_sampled"
    logits, q = torch.zeros(2, 8), torch.full((1, 8), 1 / 8)
    config = minigen.GenerationConfig(do_sample=True)
    assert len(solution(logits, [3], q, config, torch.Generator().manual_seed(0))) in (1, 2)


def test_ch12_visible_tiles_checker_refuses_the_rule_pair_by_pair_and_the_worked_solution():
    from minigen.course.exercises import ch12
    alias = ch12.solution_visible_tiles
    for calls, name in ((ch12.expected_tiles, "expected_tiles"), (lambda *args: ch12.expected_tiles(*args), "expected_tiles"),
                        (lambda *args: alias(*args), "solution_visible_tiles"),
                        (lambda *args: list(ch12.solution_visible_tiles(*args)), "solution_visible_tiles")):
        with pytest.raises(ExerciseFailed, match=f"calls minigen's own {name}"):
            ch12.check_visible_tiles(calls)
    # restored afterwards: both still give the tiles
    assert ch12.expected_tiles(96, 111, 16, 20, 4) == alias(96, 111, 16, 20, 4) == [0, 4, 5, 6]
# ================================================================ issue 26, chapters 09 and 11
# ---------------------------------------------------------------- chapter 9: bf16 rounding from integer operations
def _top_bits(x, bias):
    """A planted answer's core: the top 16 bits of x's bits after adding `bias`, as int16."""
    from minigen.course.exercises import ch09
    top = ((ch09._as_unsigned(x) + bias) >> 16) & 0xFFFF
    return torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16)


def test_round_to_bf16_takes_integer_operations_only():
    from minigen.course.exercises import ch09
    assert ch09.check_round_to_bf16(ch09.solution_round_to_bf16)
    # Known wrong answers (issue 26): torch's own conversion, however it is dressed up, and roundings
    # done by floating-point hardware.
    bf16 = "makes or uses a torch.bfloat16 tensor"
    cheats = [
        (lambda x: x.to(torch.bfloat16), bf16),
        (lambda x: x.to(torch.bfloat16).view(torch.int16), bf16),
        (lambda x: x.bfloat16().view(torch.int16), bf16),
        (lambda x: (x.to(torch.bfloat16).float().view(torch.int32) >> 16).to(torch.int16), bf16),
        (lambda x: (x.to(dtype=torch.bfloat16).float().view(torch.int32) >> 16).to(torch.int16), bf16),
        (lambda x: x.half().view(torch.int16), "converts between floating-point formats"),
        (lambda x: (x.double().float().view(torch.int32) >> 16).to(torch.int16), "converts between floating-point"),
        # Veltkamp's split: x * (2^16 + 1) rounds x to 8 bits in fp32 arithmetic
        (lambda x: ((x * 65537.0 - (x * 65537.0 - x)).view(torch.int32) >> 16).to(torch.int16), "floating-point arithmetic"),
        (lambda x: (torch.round(x * 128) / 128).view(torch.int32).to(torch.int16), "floating-point arithmetic"),
        (lambda x: (x.__iadd__(0.0).view(torch.int32) >> 16).to(torch.int16), "floating-point arithmetic"),
        (lambda x: (torch.tensor(x.tolist()).view(torch.int32) >> 16).to(torch.int16), r"calls \.tolist\(\)"),
    ]
    for cheat, hint in cheats:
        with pytest.raises(ExerciseFailed, match=hint):
            ch09.check_round_to_bf16(cheat)
    # Answers that call minigen's own rounding, by any name.
    with pytest.raises(ExerciseFailed, match="calls minigen's own round_mantissa"):
        ch09.check_round_to_bf16(lambda x: (ch09.round_mantissa(x, 7).view(torch.int32) >> 16).to(torch.int16))
    with pytest.raises(ExerciseFailed, match="calls minigen's own solution_round_to_bf16"):
        ch09.check_round_to_bf16(lambda x: ch09.solution_round_to_bf16(x))
    # Planted wrong answers of each kind: truncation, ties away from zero, NaN lost, a signed shift.
    with pytest.raises(ExerciseFailed, match="truncates"):
        ch09.check_round_to_bf16(lambda x: _top_bits(x, 0))
    with pytest.raises(ExerciseFailed, match="ties away from zero"):  # NaN kept, so the tie case is the one to fail
        ch09.check_round_to_bf16(lambda x: torch.where(x.isnan(), torch.full(x.shape, 0x7FC0, dtype=torch.int16),
                                                       _top_bits(x, 0x8000)))
    with pytest.raises(ExerciseFailed, match="NaN must stay NaN"):  # right rounding, NaN carried into the sign
        ch09.check_round_to_bf16(lambda x: _top_bits(x, 0x7FFF + ((ch09._as_unsigned(x) >> 16) & 1)))
    with pytest.raises(ExerciseFailed, match="NaN must stay NaN"):  # NaN kept apart, but as its truncated bits
        ch09.check_round_to_bf16(lambda x: torch.where(
            x.isnan(), _top_bits(x, 0), _top_bits(x, 0x7FFF + ((ch09._as_unsigned(x) >> 16) & 1))))
    with pytest.raises(ExerciseFailed, match="int16 tensor"):
        ch09.check_round_to_bf16(lambda x: x.view(torch.int32))


def test_round_to_bf16_sees_infinities_and_overflow():
    """The checker's cases hold what the exercise states: infinities stay, fp32's largest rounds to
    infinity, bf16's largest stays, and the worked solution returns int16 bits."""
    from minigen.course.exercises import ch09
    x = torch.tensor([float("inf"), float("-inf"), 3.4028235e38, 3.3895314e38, float("nan")])
    bits = ch09.solution_round_to_bf16(x).to(torch.int64) & 0xFFFF
    assert bits[:4].tolist() == [0x7F80, 0xFF80, 0x7F80, 0x7F7F] and ch09._is_nan16(bits[4:]).all()


# ---------------------------------------------------------------- chapter 11: a decode step without host syncs
def _planted_step(logits, finished, pad_id, stop_ids, sync=None, pad=True, side_effect=False):
    """A sync-free greedy tail written apart from the package, with one planted mistake at a time:
    sync names a host sync left in it, pad=False forgets the finished rows, side_effect prints."""
    top = logits.max().item() if sync == "item" else logits.amax(dim=-1, keepdim=True)
    shifted = logits - top
    logprobs = shifted - shifted.exp().sum(dim=-1, keepdim=True).log()
    tokens = logits.argmax(dim=-1)
    if sync == "tolist":
        tokens = torch.tensor(tokens.tolist())
    if sync == "int":
        pad_id = torch.full_like(tokens, int(finished.sum() * 0 + pad_id))
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    if sync == "if":
        if finished.any():
            tokens, chosen = tokens.masked_fill(finished, pad_id), chosen.masked_fill(finished, 0.0)
    elif pad:
        tokens = torch.where(finished, torch.full_like(tokens, pad_id) if isinstance(pad_id, int) else pad_id, tokens)
        chosen = torch.where(finished, torch.zeros_like(chosen), chosen)
    if side_effect:
        print("step")
    return tokens, chosen, finished | torch.isin(tokens, stop_ids)


def test_step_without_syncs_refuses_every_host_sync():
    from minigen.course.exercises import ch11
    args = ch11._cases()[1][1]
    assert ch11.count_host_syncs(ch11.synced_step, *args) == 2  # .item() and the `if`
    assert ch11.count_host_syncs(ch11.solution_step_without_syncs, *args) == 0
    assert ch11.count_host_syncs(_planted_step, *args) == 0
    assert ch11.check_step_without_syncs(ch11.solution_step_without_syncs)
    assert ch11.check_step_without_syncs(_planted_step)  # written apart from the package: it passes
    with pytest.raises(ExerciseFailed, match="reads 2 tensor value"):
        ch11.check_step_without_syncs(ch11.synced_step)
    for sync in ("item", "tolist", "int", "if"):  # one planted sync of each kind
        with pytest.raises(ExerciseFailed, match="reads 1 tensor value"):
            ch11.check_step_without_syncs(lambda *a, sync=sync: _planted_step(*a, sync=sync))
    with pytest.raises(ExerciseFailed, match="tokens differ"):  # syncs removed, finished rows not padded
        ch11.check_step_without_syncs(lambda *a: _planted_step(*a, pad=False))
    with pytest.raises(ExerciseFailed, match=r"fullgraph=True\) refused.*print"):  # no sync; a print leaves the graph
        ch11.check_step_without_syncs(lambda *a: _planted_step(*a, side_effect=True))
    with pytest.raises(ExerciseFailed, match="calls minigen's own solution_step_without_syncs"):
        ch11.check_step_without_syncs(lambda *a: ch11.solution_step_without_syncs(*a))


def test_count_host_syncs_sees_copies_to_the_host():
    from minigen.course.exercises import ch11
    t = torch.arange(4.0)
    assert [ch11.count_host_syncs(f) for f in (lambda: t.tolist(), lambda: t.numpy(), lambda: t.cpu(),
                                               lambda: t.sum().item(), lambda: t + 1)] == [1, 1, 1, 1, 0]

# ---------------------------------------------------------------- chapters 06, 07, 08 (issue 26: the reader builds)
def test_ch07_slot_checker_takes_the_solution_and_names_the_usual_mistakes():
    from minigen.caches.window import WindowKVCache
    assert ch07.check_slot_of(ch07.solution_slot_of)
    ring = lambda p, W, s: p if p < s else s + (p - s) % W  # noqa: E731  the reader's own arithmetic
    assert ch07.check_slot_of(ring)
    planted = [
        (lambda p, W, s: p % W, "keep the sink slots"),  # forgets the sinks
        (lambda p, W, s: p if p < s else s + p % W, "count the cycle from the first non-sink"),  # wrong origin
        (lambda p, W, s: p % (W + s), "the sinks are never overwritten"),  # the sinks cycle too
        (lambda p, W, s: p if p < s else s + (p - s) % (W - 1), "not window_size - 1"),  # off by one (ring size)
        (lambda p, W, s: p if p < s else s + (p - s - 1) % W, "do not shift by one"),  # off by one (origin)
    ]
    for wrong, hint in planted:
        with pytest.raises(ExerciseFailed, match=re.escape(hint)):
            ch07.check_slot_of(wrong)
    for cheat in (lambda p, W, s: int(WindowKVCache(1, 1, 1, 1, W, s).slot_of(torch.tensor(p))),
                  lambda p, W, s: ch07.solution_slot_of(p, W, s)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch07.check_slot_of(cheat)


def test_ch07_window_attention_checker_refuses_the_snippet_and_the_package():
    from minigen import attention

    def own(q, k, v, query_pos, key_pos, window_size, sink_tokens=0):  # the reader's fix, mask built here
        p, j = query_pos[:, None], key_pos[None, :]
        visible = (j <= p) & ((j < sink_tokens) | (p - j < window_size))
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    assert ch07.check_window_attention(ch07.solution_window_attention) and ch07.check_window_attention(own)

    def unscaled(q, k, v, qp, kp, W, s=0):  # bug 1 kept
        return own(q * q.shape[-1] ** 0.5, k, v, qp, kp, W, s)

    def no_sinks(q, k, v, qp, kp, W, s=0):
        return own(q, k, v, qp, kp, W, 0)
    planted = [(lambda q, k, v, qp, kp, W, s=0: ch07.article_window_attention(q, k, v, W), "1/sqrt(Dh)"),
               (unscaled, "1/sqrt(Dh)"), (no_sinks, "sink_tokens first positions")]
    for wrong, hint in planted:
        with pytest.raises(ExerciseFailed, match=re.escape(hint)):
            ch07.check_window_attention(wrong)
    for cheat in (attention.window_attention,
                  lambda q, k, v, qp, kp, W, s=0: attention.attend(q, k, v, attention.window_mask(qp, kp, W, s)),
                  lambda *args: ch07.solution_window_attention(*args)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch07.check_window_attention(cheat)


def test_ch08_victim_checker_takes_the_solution_and_names_the_usual_mistakes():
    from minigen.caches.h2o import HeavyHitterCache
    assert ch08.check_victim(ch08.solution_victim)

    def own(slot_pos, score, recent):  # the reader's rule, written with a sort
        if (slot_pos < 0).any():
            return int((slot_pos < 0).nonzero()[0])
        order = slot_pos.argsort(descending=True)  # newest first
        rest = order[recent:]
        return int(rest[score[rest].argmin()])
    assert ch08.check_victim(own)

    def least(score, excluded):
        return int(score.masked_fill(excluded, float("inf")).argmin())

    def newest(slot_pos, n):
        return torch.zeros(len(slot_pos), dtype=torch.bool).index_fill_(0, slot_pos.topk(n).indices, True)

    def with_empty_first(rule):
        return lambda p, s, r: int((p < 0).nonzero()[0]) if (p < 0).any() else rule(p, s, r)
    planted = [
        (with_empty_first(lambda p, s, r: least(s, p < 0)), "never evict the `recent` newest"),  # no recent kept
        (with_empty_first(lambda p, s, r: least(-s, newest(p, r))), "evict the least attended"),  # wrong direction
        (with_empty_first(lambda p, s, r: least(p.float(), newest(p, r))), "as a window does"),  # oldest out
        (with_empty_first(lambda p, s, r: least(s, newest(p, r + 1))), "not recent + 1"),  # off by one
        (with_empty_first(lambda p, s, r: least(s, newest(p, r - 1)) if r > 1 else least(s, newest(p, r))),
         "not recent - 1"),  # off by one
        (with_empty_first(lambda p, s, r: least(s, torch.arange(len(p)) >= len(p) - r)), "not by slot index"),
        (lambda p, s, r: least(s, (p < 0) | newest(p, r)), "write into an empty slot first"),  # ignores empty
    ]
    for wrong, hint in planted:
        with pytest.raises(ExerciseFailed, match=re.escape(hint)):
            ch08.check_victim(wrong)

    def through_the_cache(p, s, r):  # asks the package's cache which slot it writes
        cache = HeavyHitterCache(1, 1, 1, 1, len(p), r)
        cache.slot_pos[0], cache.score[0] = p, s
        cache.prepare(torch.tensor([int(p.max()) + 1]))
        return int((cache.slot_pos[0] == int(p.max()) + 1).nonzero()[0, 0])
    for cheat in (through_the_cache, lambda p, s, r: ch08.solution_victim(p, s, r)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch08.check_victim(cheat)


def test_ch08_keep_keys_and_entropy_checkers_refuse_the_package():
    from minigen import attention, entropy
    sparse = lambda s, k, t: attention.sparse_keep(s.view(1, 1, 1, -1), torch.ones(1, len(s), dtype=torch.bool),  # noqa: E731
                                                    k, t).view(-1)
    with pytest.raises(ExerciseFailed, match="calls minigen's own"):
        ch08.check_keep_keys(sparse)
    with pytest.raises(ExerciseFailed, match="calls minigen's own"):
        ch08.check_attention_entropy(lambda p: float(entropy.entropy(p)))
    with pytest.raises(ExerciseFailed, match=re.escape("rank keys by |score|")):  # the article's sign mistake
        ch08.check_keep_keys(attention_signed)
    with pytest.raises(ExerciseFailed, match="log2"):
        ch08.check_attention_entropy(lambda p: float(-(p[p > 0] * p[p > 0].log2()).sum()))


def attention_signed(scores, top_k, threshold):
    """keep_keys ranking by q.k instead of |q.k| (what section 1 recommends, not the article's rule)."""
    keep = torch.ones_like(scores, dtype=torch.bool)
    if top_k is not None and top_k < len(scores):
        keep = torch.zeros_like(keep)
        keep[scores.topk(top_k).indices] = True
    if threshold is not None:
        keep &= scores >= threshold * scores.max()
    return keep


def test_ch06_quantize_group_checker_refuses_the_package_and_the_usual_mistakes():
    from minigen.numerics import quant
    assert ch06.check_quantize_group(ch06.solution_quantize_group)

    def package(x, bits):  # the package's quantizer, unpacked: refused, the exercise is the arithmetic
        q = quant.quantize(x[None], bits, len(x), scale_dtype=torch.float32)
        return quant.unpack(q.data, bits)[0], q.scales.item(), q.zeros.item()

    def via_round_trip(x, bits):
        x_hat = quant.round_trip(x[None], bits, len(x))[0]
        scale = (x.max() - x.min()).item() / (2**bits - 1)
        return ((x_hat - x.min()) / max(scale, 1e-12)).round().long(), scale, x.min().item()
    for cheat in (package, via_round_trip, lambda x, bits: ch06.solution_quantize_group(x, bits)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch06.check_quantize_group(cheat)

    def steps(n_steps, rounding=torch.round, zero_at_min=True):
        def fn(x, bits):
            lo, hi = x.min().item(), x.max().item()
            scale = (hi - lo) / n_steps(bits)
            if scale == 0:
                return torch.zeros_like(x, dtype=torch.long), 0.0, lo
            zero = lo if zero_at_min else 0.0
            return rounding((x - zero) / scale).clamp(max=2**bits - 1).long(), scale, zero
        return fn
    planted = [(steps(lambda b: 2**b), "2^bits codes make 2^bits - 1 steps"),  # off by one: 2^b steps
               (steps(lambda b: 2**b - 1, torch.floor), "round, do not truncate"),  # truncation
               (steps(lambda b: 2**b - 1, zero_at_min=False), "codes are unsigned")]  # symmetric: no zero point
    for wrong, hint in planted:
        with pytest.raises(ExerciseFailed, match=re.escape(hint)):
            ch06.check_quantize_group(wrong)
# ---------------------------------------------------------------- issue 26, chapter 10 (helper f)
def test_ch10_checkers_reject_an_answer_that_calls_minigens_own_packing():
    """Issue 26: `my_pack4 = pack4` passed. Every alias or wrapper of the package's pack4/unpack4, or
    of the chapter's worked solutions, now fails; the checkers still take an answer of one's own."""
    from minigen.course.exercises import ch10
    from minigen.numerics import weight_quant
    from minigen.numerics.weight_quant import pack4, unpack4
    for cheat in (pack4, weight_quant.pack4, lambda c: pack4(c), lambda c: ch10.solution_pack4(c.clone()),
                  lambda c: weight_quant.pack4(weight_quant.unpack4(pack4(c)))):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch10.check_pack4(cheat)
    for cheat in (unpack4, lambda d: weight_quant.unpack4(d), lambda d: ch10.solution_unpack4(d)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch10.check_unpack4(cheat)
    # the cheat's forbidden functions are back afterwards, and the package still packs
    codes = torch.arange(64, dtype=torch.uint8) % 16
    assert torch.equal(unpack4(pack4(codes)), codes)


def test_ch10_unpack4_checker_names_the_planted_mistakes():
    from minigen.course.exercises import ch10

    def interleaved(data):  # low, high, low, high: pairs neighbours, the wrong axis
        b = data.unflatten(-1, (-1, 16))
        return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-3)

    def high_first(data):
        b = data.unflatten(-1, (-1, 16))
        return torch.cat([b >> 4, b & 0xF], dim=-1).flatten(-2)

    def one_block_short(data):  # off by one block: drops the last 16 bytes
        b = data[..., :-16].unflatten(-1, (-1, 16))
        return torch.cat([b & 0xF, b >> 4], dim=-1).flatten(-2)

    with pytest.raises(ExerciseFailed, match="not every other code"):
        ch10.check_unpack4(interleaved)
    with pytest.raises(ExerciseFailed, match="low nibble \\(& 0xF\\) comes first"):
        ch10.check_unpack4(high_first)
    with pytest.raises(ExerciseFailed, match="expected shape"):
        ch10.check_unpack4(one_block_short)
    with pytest.raises(ExerciseFailed, match="returned None"):
        ch10.check_unpack4(lambda data: None)


# ---------------------------------------------------------------- chapter 4
def test_ch04_min_p_checker_takes_the_solution_and_its_reference_is_transformers():
    """The checker's own reference is transformers' rule: TemperatureLogitsWarper, then
    MinPLogitsWarper (the order of its warpers), softmaxed; and an answer written independently passes."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper
    from minigen.course.exercises import ch04
    assert ch04.check_min_p_probabilities(ch04.solution_min_p_probabilities)
    for label, logits, temperature, min_p in ch04._cases():
        if min_p == 0:  # transformers' warper refuses 0; the distribution is the tempered softmax
            hf = torch.softmax(logits / temperature, dim=-1)
        else:
            scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
            hf = torch.softmax(MinPLogitsWarper(min_p)(None, scores), dim=-1)
        assert torch.allclose(ch04.reference(logits, temperature, min_p), hf, atol=1e-6), label

    def in_log_space(logits, temperature, min_p):  # another way to the same distribution
        logp = torch.log_softmax(logits / temperature, dim=-1)
        drop = logp < logp.max(dim=-1, keepdim=True).values + math.log(min_p) if min_p > 0 else logp.isnan()
        return torch.softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    assert ch04.check_min_p_probabilities(in_log_space)


def min_p_variant(mistake):
    """min-p with one planted mistake."""
    def answer(logits, temperature, min_p):
        if mistake == "before temperature":  # the cut on the untempered distribution, then the temperature
            p = torch.softmax(logits, dim=-1)
            keep = p >= min_p * p.amax(dim=-1, keepdim=True)
            return torch.softmax((logits / temperature).masked_fill(~keep, float("-inf")), dim=-1)
        p = torch.softmax(logits / temperature, dim=-1)
        floor = {"absolute": min_p}.get(mistake, min_p * p.amax(dim=-1, keepdim=True))
        drop = p <= floor if mistake == "strict" else p < floor
        if mistake == "masked logits":
            return (logits / temperature).masked_fill(drop, float("-inf"))
        kept = p.masked_fill(drop, 0.0)
        return kept if mistake == "unnormalised" else kept / kept.sum(dim=-1, keepdim=True)
    return answer


@pytest.mark.parametrize("mistake, hint", [
    ("before temperature", "min-p comes after the temperature"),
    ("absolute", "min_p times the row's largest probability, not min_p itself"),
    ("strict", "with min_p = 1 a row came out NaN"),
    ("unnormalised", "renormalise"),
    ("masked logits", "not masked logits"),
])
def test_ch04_min_p_checker_names_the_usual_mistakes(mistake, hint):
    from minigen.course.exercises import ch04
    assert ch04.check_min_p_probabilities(min_p_variant("right"))  # the variants' common part is right
    with pytest.raises(ExerciseFailed, match=hint):
        ch04.check_min_p_probabilities(min_p_variant(mistake))


def test_ch04_min_p_checker_refuses_minigens_sampling_and_the_worked_solution():
    from minigen import sampling
    from minigen.course.exercises import ch04

    def through_the_package(logits, temperature, min_p):
        return sampling.probabilities(logits, minigen.GenerationConfig(do_sample=True, temperature=temperature))
    probabilities = sampling.probabilities
    for cheat, name in ((through_the_package, "probabilities"),
                        (lambda *args: ch04.solution_min_p_probabilities(*args), "solution_min_p_probabilities")):
        with pytest.raises(ExerciseFailed, match=f"calls minigen's own {name}"):
            ch04.check_min_p_probabilities(cheat)
    with pytest.raises(ExerciseFailed, match="returned NoneType"):
        ch04.check_min_p_probabilities(lambda *args: None)
    assert sampling.probabilities is probabilities and sampling.probabilities(  # put back, and it works
        torch.zeros(1, 4), minigen.GenerationConfig(do_sample=True)).sum() == 1
