"""The chapters' exercises: each worked solution passes its checker, common wrong answers fail it
with their hint, and the package formulas the checkers trust match an independent count (chapters
1-2 in depth; chapters 3-6 through their checkers, which call the package's caches and attention)."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import minigen.model
from minigen.course.exercises import ExerciseFailed, ch01, ch02, ch03, ch04, ch05, ch06
from minigen.model import Model, ModelConfig, rope_frequencies


# ---------------------------------------------------------------- the oracle behind the checkers
def dense_attend(q, k, v, mask, fp32_softmax=True):
    """Attention written the obvious way, so FlopCounterMode sees its two matmuls (the fused SDPA
    kernel on CPU is invisible to it): q [B, H, T, Dh], k, v [B, Hkv, S, Dh], mask [T, S] bool
    or additive float, or attention.Causal."""
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
def test_naive_step_flops_solution_passes():
    assert ch01.check_naive_step_flops(ch01.solution_naive_step_flops)


@pytest.mark.parametrize("wrong, hint", [
    (lambda cfg, n: ch01.solution_naive_step_flops(cfg, n) // 2, "multiply-add"),
    (lambda cfg, n: ch01.solution_naive_step_flops(cfg, n) - 2 * cfg.dim * cfg.vocab_size, "output head"),
    (lambda cfg, n: cfg.forward_flops(n, 0), "attention itself"),
    (lambda cfg, n: ch01.solution_naive_step_flops(cfg, n) + 1, None),
])
def test_naive_step_flops_wrong_answers_fail(wrong, hint):
    with pytest.raises(ExerciseFailed) as err:
        ch01.check_naive_step_flops(wrong)
    if hint:
        assert hint in str(err.value)


def test_naive_step_flops_ignoring_gqa_gets_the_hint():
    def no_gqa(cfg, n):
        full = ModelConfig(**{**cfg.__dict__, "n_kv_heads": cfg.n_heads})
        return ch01.solution_naive_step_flops(full, n)
    with pytest.raises(ExerciseFailed, match="grouped-query"):
        ch01.check_naive_step_flops(no_gqa)


def test_crossover_length():
    assert ch01.check_crossover_length(ch01.solution_crossover_length)
    assert ch01.solution_crossover_length(ch01.SMOLLM2_135M) == 3072  # 7,077,888 / (4·9·64)
    with pytest.raises(ExerciseFailed, match="two products"):
        ch01.check_crossover_length(lambda cfg: 2 * ch01.solution_crossover_length(cfg))
    with pytest.raises(ExerciseFailed):
        ch01.check_crossover_length(lambda cfg: 1.05 * ch01.solution_crossover_length(cfg))


# ---------------------------------------------------------------- chapter 2
def test_kv_cache_bytes():
    assert ch02.check_kv_cache_bytes(ch02.solution_kv_cache_bytes)
    # Llama-2-7B, fp16: 2 x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB per token (a known figure).
    assert ch02.solution_kv_cache_bytes(ch02.LLAMA2_7B, 1) == 512 * 1024
    with pytest.raises(ExerciseFailed, match="factor 2"):
        ch02.check_kv_cache_bytes(lambda cfg, t, b, e: ch02.solution_kv_cache_bytes(cfg, t, b, e) // 2)
    with pytest.raises(ExerciseFailed, match="n_kv_heads"):
        ch02.check_kv_cache_bytes(lambda cfg, t, b, e: 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * e * t * b)


def test_max_cached_tokens():
    assert ch02.check_max_cached_tokens(ch02.solution_max_cached_tokens)
    with pytest.raises(ExerciseFailed, match="round down"):
        ch02.check_max_cached_tokens(
            lambda cfg, m, b, e: m / (b * cfg.kv_bytes_per_token(e)))
    with pytest.raises(ExerciseFailed, match="divide by batch"):
        ch02.check_max_cached_tokens(lambda cfg, m, b, e: m // cfg.kv_bytes_per_token(e))


# ---------------------------------------------------------------- chapter 0
def test_greedy_by_hand():
    from minigen.course.exercises import ch00
    from minigen.caches.make import make_cache
    from minigen.sampling import sample
    from minigen.steps.eager import decode_step, prefill
    # Wide weights, so that logits depend strongly on positions and a wrong one changes the tokens.
    model = tiny_model("llama", std=0.5)
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    assert ch00.check_greedy_by_hand(ch00.solution_greedy_by_hand, model, ids, n=8)

    def off_by_one(model, ids, n):  # feeds every decode step one position too far
        config = minigen.GenerationConfig(max_new_tokens=n)
        T, out = ids.shape[1], [ids]
        cache = make_cache(model, config, 1, T + n + 1)
        logits = prefill(model, ids, cache)
        for i in range(n):
            token = sample(logits, config)
            out.append(token[:, None])
            logits = decode_step(model, token[:, None], torch.tensor([T + i + 1]), cache)
        return torch.cat(out, dim=1)

    with pytest.raises(ExerciseFailed, match="position T \\+ i"):
        ch00.check_greedy_by_hand(off_by_one, model, ids, n=8)
    with pytest.raises(ExerciseFailed, match="shape"):
        ch00.check_greedy_by_hand(lambda m, i, n: i, model, ids, n=8)


# ---------------------------------------------------------------- chapters 3-6
@pytest.mark.parametrize("check, solution", [
    (ch03.check_slot_of, ch03.solution_slot_of), (ch03.check_blocks_held, ch03.solution_blocks_held),
    (ch04.check_quantize_group, ch04.solution_quantize_group),
    (ch04.check_quantized_cache_bytes, ch04.solution_quantized_cache_bytes),
    (ch05.check_slot_of, ch05.solution_slot_of), (ch05.check_window_attention, ch05.solution_window_attention),
    (ch06.check_keep_keys, ch06.solution_keep_keys), (ch06.check_attention_entropy, ch06.solution_attention_entropy),
], ids=lambda f: f.__module__.rsplit(".", 1)[-1] + "." + f.__name__)
def test_worked_solutions_pass_their_checkers(check, solution):
    """The checkers ask the package itself (paged and ring-buffer caches, quantized stores,
    attention), so this also catches a change of the package that the chapters' cells would hit."""
    assert check(solution)


def test_quantized_cache_bytes_counts_an_fp16_models_cache():
    """Chapter 4's exercise is about an fp16 model: fp16 scales, zeros and window. 4,096 tokens at
    4 bits in groups of 32 with a 32-token window: 4,064 tokens quantized at 4 + 1 bits per element
    (keys per channel and values per token each add an fp16 scale and zero per 32 elements), and
    32 tokens at 16 bits, for each of K and V in every layer, KV head and channel."""
    cfg = ch04.SMOLLM2_135M
    channels = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    assert ch04.solution_quantized_cache_bytes(cfg, 4096, 4, 32, 32) == 2 * channels * (4064 * 5 // 8 + 32 * 2)
    with pytest.raises(ExerciseFailed, match="fp16: 2 bytes"):  # an fp32 window is the old answer
        ch04.check_quantized_cache_bytes(lambda *args: ch04._mistaken_bytes(*args, window_bytes=4))
    with pytest.raises(ExerciseFailed, match="scale and zero"):
        ch04.check_quantized_cache_bytes(lambda *args: ch04._mistaken_bytes(*args, meta_numbers=0))


# ---------------------------------------------------------------- chapter 7
def test_round_to_bf16():
    from minigen.course.exercises import ch07
    assert ch07.check_round_to_bf16(ch07.solution_round_to_bf16)

    def unsigned_top(x, bias):  # the top 16 bits after adding `bias`, as a bf16 tensor
        top = ((ch07._as_unsigned(x) + bias) >> 16) & 0xFFFF
        return torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16).view(torch.bfloat16)

    with pytest.raises(ExerciseFailed, match="truncates"):
        ch07.check_round_to_bf16(lambda x: unsigned_top(x, 0))
    with pytest.raises(ExerciseFailed, match="ties away from zero"):  # NaN kept, so the tie case is the one to fail
        ch07.check_round_to_bf16(lambda x: torch.where(x.isnan(), x.to(torch.bfloat16), unsigned_top(x, 0x8000)))
    with pytest.raises(ExerciseFailed, match="NaN must stay NaN"):  # right rounding, NaN carried into the sign
        ch07.check_round_to_bf16(lambda x: unsigned_top(x, 0x7FFF + ((ch07._as_unsigned(x) >> 16) & 1)))
    with pytest.raises(ExerciseFailed, match="torch.bfloat16 tensor"):
        ch07.check_round_to_bf16(lambda x: x.half())


def test_round_mantissa_is_ieee_rounding():
    """round_mantissa against torch's own conversions: 7 bits is bf16 (whole fp32 range), 10 bits is
    fp16 inside fp16's normal range (TF32 has fp16's mantissa and fp32's exponent), 23 is the identity."""
    from minigen.course.exercises import ch07
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(4096, generator=g) * 10.0 ** (torch.rand(4096, generator=g) * 60 - 30)
    assert torch.equal(ch07.round_mantissa(wide, 7), wide.to(torch.bfloat16).float())
    normal = torch.randn(4096, generator=g) * 100  # |x| in fp16's normal range, up to ~400
    normal = normal[normal.abs() > 1e-4]
    assert torch.equal(ch07.round_mantissa(normal, 10), normal.half().float())
    assert torch.equal(ch07.round_mantissa(wide, 23), wide)
    assert ch07.bit_fields(1.0, torch.bfloat16) == "0 | 01111111 | 0000000"
    assert ch07.bit_fields(-2.0, torch.float16) == "1 | 10000 | 0000000000"


# ---------------------------------------------------------------- chapter 8
def test_step_without_syncs():
    from minigen.course.exercises import ch08
    args = ch08._cases()[1][1]
    assert ch08.count_host_syncs(ch08.synced_step, *args) == 2  # .item() and the `if`
    assert ch08.count_host_syncs(ch08.solution_step_without_syncs, *args) == 0
    assert ch08.check_step_without_syncs(ch08.solution_step_without_syncs)
    with pytest.raises(ExerciseFailed, match="reads 2 tensor value"):
        ch08.check_step_without_syncs(ch08.synced_step)

    def no_pad(logits, finished, pad_id, stop_ids):  # syncs removed, but finished rows not padded
        return ch08.solution_step_without_syncs(logits, torch.zeros_like(finished), pad_id, stop_ids)

    with pytest.raises(ExerciseFailed, match="tokens differ"):
        ch08.check_step_without_syncs(no_pad)

    def debug_print(logits, finished, pad_id, stop_ids):  # no sync, but a print leaves the graph
        print("step")
        return ch08.solution_step_without_syncs(logits, finished, pad_id, stop_ids)

    with pytest.raises(ExerciseFailed, match=r"fullgraph=True\) refused.*print"):
        ch08.check_step_without_syncs(debug_print)


# ---------------------------------------------------------------- chapter 9
def test_dequantize_on_load():
    from minigen.course.exercises import ch09
    assert ch09.check_dequantize_on_load(ch09.solution_dequantize_on_load)
    for wrong, hint in ch09.MISTAKES:
        with pytest.raises(ExerciseFailed, match=re.escape(hint)):
            ch09.check_dequantize_on_load(wrong)
    with pytest.raises(ExerciseFailed, match="shape"):
        ch09.check_dequantize_on_load(lambda codes, scales, zeros, channel, G: codes.float())


# ---------------------------------------------------------------- chapter 14
def test_ch14_pack4_checker_takes_the_solution_and_names_the_usual_mistakes():
    from minigen.course.exercises import ch14
    assert ch14.check_pack4(ch14.solution_pack4) and ch14.check_unpack4(ch14.solution_unpack4)

    def adjacent(codes):  # codes j and j + 1 in one byte: the layout many people expect
        pairs = codes.unflatten(-1, (-1, 2))
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)

    def nibbles_swapped(codes):  # code j + 16 low, code j high (the answers are built here, not
        c = codes.unflatten(-1, (-1, 2, 16))  # from ch14's solutions, which the checkers forbid)
        return (c[..., 1, :] | (c[..., 0, :] << 4)).flatten(-2).to(torch.uint8)

    def right_but_int64(codes):
        c = codes.long().unflatten(-1, (-1, 2, 16))
        return (c[..., 0, :] | (c[..., 1, :] << 4)).flatten(-2)

    with pytest.raises(ExerciseFailed, match="not with code j \\+ 1"):
        ch14.check_pack4(adjacent)
    with pytest.raises(ExerciseFailed, match="low nibble, code j \\+ 16 in the high"):
        ch14.check_pack4(nibbles_swapped)
    with pytest.raises(ExerciseFailed, match="not torch.uint8"):
        ch14.check_pack4(right_but_int64)
    unmasked = lambda d: torch.cat([d.unflatten(-1, (-1, 16)), d.unflatten(-1, (-1, 16)) >> 4], -1).flatten(-2)  # noqa: E731
    with pytest.raises(ExerciseFailed, match="& 0xF"):
        ch14.check_unpack4(unmasked)


# ---------------------------------------------------------------- chapter 12
def test_ch12_roofline_checkers_take_the_solutions_and_name_the_usual_mistakes():
    from minigen.course.exercises import ch12
    from minigen.measure.roofline import decode_point, streamed_params
    assert ch12.check_decode_intensity(ch12.solution_decode_intensity)
    assert ch12.check_predict_tokens_per_s(ch12.solution_predict_tokens_per_s)
    with pytest.raises(ExerciseFailed, match="read once for the whole batch"):
        ch12.check_decode_intensity(lambda cfg, b, n, wb, kb: b * cfg.forward_flops(1, n) / (
            b * streamed_params(cfg) * wb + b * n * cfg.kv_bytes_per_token(kb)))
    with pytest.raises(ExerciseFailed, match="keys and values"):
        ch12.check_decode_intensity(lambda cfg, b, n, wb, kb: b * cfg.forward_flops(1, n) / (streamed_params(cfg) * wb))
    with pytest.raises(ExerciseFailed, match="multiply by batch"):
        ch12.check_predict_tokens_per_s(lambda g, cfg, b, n: ch12.solution_predict_tokens_per_s(g, cfg, b, n) / b)
    with pytest.raises(ExerciseFailed, match="bound by compute"):
        ch12.check_predict_tokens_per_s(lambda g, cfg, b, n: b * g.bandwidth / decode_point(cfg, b, n).bytes)


# ---------------------------------------------------------------- chapter 13
def test_ch13_cheapest_fit_agrees_with_the_planner_and_names_the_usual_mistakes():
    from minigen.course.exercises import ch13
    assert ch13.check_cheapest_fit(ch13.solution_cheapest_fit)
    # a tie in loss and bytes (bf16 against fp16 storage, one of the cases) accepts either
    assert any(want and "kv_dtype" in want for _, _, _, want in ch13._cases())
    assert ch13.check_cheapest_fit(lambda opts, b: ch13.solution_cheapest_fit(opts[::-1], b))
    fewest = lambda opts, b: min(opts, key=lambda o: o["total_bytes"])["config"]  # noqa: E731
    least_loss = lambda opts, b: min(opts, key=lambda o: o["expected_loss_pct"])["config"]  # noqa: E731
    most_bytes = lambda opts, b: min((o for o in opts if o["total_bytes"] <= b),  # noqa: E731
                                     key=lambda o: (o["expected_loss_pct"], -o["total_bytes"]))["config"]
    never_none = lambda opts, b: ch13.solution_cheapest_fit(opts, b) or {}  # noqa: E731
    for wrong, hint in ((fewest, "rank by expected_loss_pct first"), (least_loss, "more than the budget"),
                        (most_bytes, "fewest bytes"),
                        (never_none, "return None"), (lambda opts, b: None, "some options fit")):
        with pytest.raises(ExerciseFailed, match=hint):
            ch13.check_cheapest_fit(wrong)


# ---------------------------------------------------------------- chapter 10
def test_ch10_group_checker_takes_the_solution_and_names_the_usual_mistakes():
    from minigen.course.exercises import ch10
    assert ch10.check_group(ch10.solution_group)

    def arrival_order(lengths, b):  # the batches a FIFO cut gives: more padding
        return [list(range(i, min(i + b, len(lengths)))) for i in range(0, len(lengths), b)]

    with pytest.raises(ExerciseFailed, match="sort the requests by length"):
        ch10.check_group(arrival_order)
    with pytest.raises(ExerciseFailed, match="never drops a request"):
        ch10.check_group(lambda lengths, b: ch10.solution_group(lengths, b)[:-1])
    with pytest.raises(ExerciseFailed, match="runs alone"):
        ch10.check_group(lambda lengths, b: [sorted(range(len(lengths)), key=lambda i: lengths[i])[j:j + b]
                                             for j in range(0, len(lengths), b)])
    with pytest.raises(ExerciseFailed, match="use 1 to"):
        ch10.check_group(lambda lengths, b: [list(range(len(lengths)))])


def test_ch10_admission_checker_asks_the_engine_and_names_the_usual_mistakes():
    from minigen.course.exercises import ch10
    assert ch10.check_can_admit(ch10.solution_can_admit)
    for wrong, hint in [
            (lambda need, free, reserved, running, b: running < b and need <= free, "free - reserved"),
            (lambda need, free, reserved, running, b: need <= free - reserved, "batch slot"),
            (lambda need, free, reserved, running, b: running <= b and need <= free - reserved, "batch is full"),
            (lambda need, free, reserved, running, b: running < b and need < free - reserved, "exactly fits")]:
        with pytest.raises(ExerciseFailed, match=hint):
            ch10.check_can_admit(wrong)


# ---------------------------------------------------------------- chapter 15
@pytest.mark.usefixtures("one_thread")
def test_ch15_distribution_tools_agree_with_plain_sampling():
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
def test_ch15_accept_checker_takes_the_solution_and_refuses_wrong_rules():
    import sys
    from minigen import drafts
    from minigen.course import distributions
    from minigen.course.exercises import ch15
    from minigen.sampling import probabilities
    from minigen.steps import speculative
    from minigen.steps.speculative import accept_sampled
    assert ch15.check_accept_sampled(ch15.solution_accept_sampled)
    # minigen's own rule passes the same distribution test (what the checker holds answers to)
    model, (label, case, prompt) = distributions.tiny_llama(8, seed=0), ch15._cases()[0]
    counts, _ = ch15.run_rule(accept_sampled, model, prompt, case["config"], drafts.layer_skip(model, 1))
    exact = distributions.continuation_probabilities(model, prompt, ch15.NEW, case["config"]).sum(0)
    assert distributions.chi_square(counts, exact)[2] > ch15.P_MIN

    def ignores_the_config(logits, proposal, q, config, generator):  # softmax of the raw logits
        return ch15.solution_accept_sampled(logits, proposal, q, minigen.GenerationConfig(do_sample=True), generator)

    def never_keeps(logits, proposal, q, config, generator):
        return [int(torch.multinomial(probabilities(logits, config)[0], 1, generator=generator))]

    for wrong, hint in ((ch15.keep_every_proposal, "you keep every proposal"),
                        (ch15.resample_from_target, "residual max\\(0, p - q\\)"),
                        (ignores_the_config, "probabilities\\(logits, config\\)"),
                        (never_keeps, "every guess must be kept"),
                        (lambda *args: None, "returned None"),
                        (lambda logits, proposal, *rest: list(proposal) + [0, 0], "tokens for")):
        with pytest.raises(ExerciseFailed, match=hint):
            ch15.check_accept_sampled(wrong)
    # an answer that calls minigen's rule, imported by name or looked up in its module, fails
    for calls in (accept_sampled, lambda *args: accept_sampled(*args), lambda *args: speculative.accept_sampled(*args)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own accept_sampled"):
            ch15.check_accept_sampled(calls)
    assert speculative.accept_sampled is accept_sampled and sys.getprofile() is None  # the checker put them back


# ---------------------------------------------------------------- chapter 16
def test_ch16_visible_tiles_checker_takes_the_solution_and_names_the_usual_mistakes():
    import math
    from minigen.course.exercises import ch16
    assert ch16.check_visible_tiles(ch16.solution_visible_tiles)
    # the rule pair by pair and the Triton kernel's own count agree (what the checker holds answers to)
    assert ch16.kernel_visits(5, 16, 20, 4) == [len(ch16.expected_tiles(16 * i, 16 * i + 15, 16, 20, 4))
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
            ch16.check_visible_tiles(wrong)
    with pytest.raises(ExerciseFailed, match="calls this module's worked solution"):
        ch16.check_visible_tiles(lambda *args: ch16.solution_visible_tiles(*args))


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


# ---------------------------------------------------------------- issue 26, chapter 14 (helper f)
def test_ch14_checkers_reject_an_answer_that_calls_minigens_own_packing():
    """Issue 26: `my_pack4 = pack4` passed. Every alias or wrapper of the package's pack4/unpack4, or
    of the chapter's worked solutions, now fails; the checkers still take an answer of one's own."""
    from minigen.course.exercises import ch14
    from minigen.numerics import weight_quant
    from minigen.numerics.weight_quant import pack4, unpack4
    for cheat in (pack4, weight_quant.pack4, lambda c: pack4(c), lambda c: ch14.solution_pack4(c.clone()),
                  lambda c: weight_quant.pack4(weight_quant.unpack4(pack4(c)))):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch14.check_pack4(cheat)
    for cheat in (unpack4, lambda d: weight_quant.unpack4(d), lambda d: ch14.solution_unpack4(d)):
        with pytest.raises(ExerciseFailed, match="calls minigen's own"):
            ch14.check_unpack4(cheat)
    # the cheat's forbidden functions are back afterwards, and the package still packs
    codes = torch.arange(64, dtype=torch.uint8) % 16
    assert torch.equal(unpack4(pack4(codes)), codes)


def test_ch14_unpack4_checker_names_the_planted_mistakes():
    from minigen.course.exercises import ch14

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
        ch14.check_unpack4(interleaved)
    with pytest.raises(ExerciseFailed, match="low nibble \\(& 0xF\\) comes first"):
        ch14.check_unpack4(high_first)
    with pytest.raises(ExerciseFailed, match="expected shape"):
        ch14.check_unpack4(one_block_short)
    with pytest.raises(ExerciseFailed, match="returned None"):
        ch14.check_unpack4(lambda data: None)
