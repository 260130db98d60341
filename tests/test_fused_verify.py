"""fused_decode=True's verify: a chunk of one sequence in one C call (fused.py, csrc/decode.c: verify_layers),
as speculative decoding's check of k guessed tokens runs it. Split from test_fused.py so that make test's two
workers (--dist loadfile gives each file whole to one worker) share the fused step's tests.

Oracle: the eager torch step's verify (EagerStep.verify) on the same model, prompt and chunk: every position's
logits and the keys/values it leaves; and fused decode steps one token at a time, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from conftest import skip_where_aside, tiny_hf
from minigen import GenerationConfig
from minigen.steps import fused
from minigen.errors import CacheFullError
from minigen.steps.eager import EagerStep, prefill
from minigen.caches.contiguous import KVCache
from minigen.caches.make import make_cache


# ---------------------------------------------------------------- verify: a chunk of one sequence in one C call
def verify_side_by_side(model, prompt, chunk, kv_dtype=None):
    """Prefill prompt [1, P] into two caches, then verify chunk [1, T] at positions P..P+T-1 with the
    eager step (torch) and the fused one (csrc/decode.c: verify_layers) -> (eager logits [1, T, V],
    fused logits, eager cache, fused cache)."""
    dtype = getattr(torch, kv_dtype) if kv_dtype else None
    P, T = prompt.shape[1], chunk.shape[1]
    eager, mine = (KVCache.for_model(model, 1, P + T + 4, dtype) for _ in range(2))
    pos = torch.arange(P, P + T)
    with torch.inference_mode():
        prefill(model, prompt, eager)
        prefill(model, prompt, mine)
        a = EagerStep().verify(model, chunk, pos, eager)
        b = fused.FusedStep().verify(model, chunk, pos, mine)
    return a, b, eager, mine


def relative(a, b) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("qwen2", {}),
    ("llama", dict(hidden_size=40, intermediate_size=72, num_attention_heads=4, num_key_value_heads=1)),
])
def test_tiny_models_verify_matches_the_eager_verify(kind, overrides):
    """T tokens at consecutive positions after a prompt, for T in 2..9: every position's logits and
    the keys/values of every slot, against EagerStep.verify's torch forward (~1e-5, as decode)."""
    model = minigen.from_hf(tiny_hf(kind, **overrides))
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 97, (1, 9), generator=g)
    for T in range(2, 10):
        a, b, eager, mine = verify_side_by_side(model, prompt, torch.randint(0, 97, (1, T), generator=g))
        assert b.shape == a.shape == (1, T, 97) and b.dtype == torch.float32
        assert relative(a, b) < 1e-5 and torch.equal(a.argmax(-1), b.argmax(-1)), (T, relative(a, b))
        torch.testing.assert_close(mine.k, eager.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.v, eager.v, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("kv_dtype", [None, "bfloat16"])
def test_smollm2_verify_matches_the_eager_verify(smollm2, english_text_ids, kv_dtype):
    """SmolLM2 after a 120-token prompt (long enough for attention to share heads over the threads),
    T in 2..9 real tokens. fp32 cache: logits within 1e-5 of their largest value (measured ~6e-7) and
    keys/values within 1e-5. bf16 cache: C and torch round a key or value that lands next to a
    rounding boundary to neighbouring bf16 numbers, and a number rounded the other way moves what the
    later layers compute: each layer's keys and values within 2e-2 of the layer's largest (measured
    5e-3, under one bf16 step of it, 2^-7), the logits within 1e-2 (measured ~4e-4), as the decode
    tests allow."""
    model, _ = smollm2
    prompt = english_text_ids[None, :120]
    for T in range(2, 10):
        a, b, eager, mine = verify_side_by_side(model, prompt, english_text_ids[None, 120:120 + T], kv_dtype)
        assert relative(a, b) < (1e-2 if kv_dtype else 1e-5), (T, relative(a, b))
        assert torch.equal(a.argmax(-1), b.argmax(-1)), T
        if kv_dtype:
            for ours, theirs in ((mine.k, eager.k), (mine.v, eager.v)):
                worst = max(relative(theirs[layer].float(), ours[layer].float()) for layer in range(len(ours)))
                assert worst < 2e-2, (T, worst)
        else:
            torch.testing.assert_close(mine.k, eager.k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.v, eager.v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
def test_smollm2_verify_every_weight_format(smollm2, english_text_ids, kind):
    """Weights other than fp32 meet the chunk's rows in their own several-row loops (decode.c: product); the
    logits agree with the eager forward as a decode step's do (fp32 cache: ~1e-5)."""
    folder = minigen.loading.resolve_folder("smollm2-135m")
    cfg, state = minigen.loading.read_config(folder), minigen.loading.read_safetensors(folder)
    if kind == "bf16":
        model = minigen.loading.build_model(cfg, state, torch.bfloat16)
    else:
        model = minigen.quantize_weights(minigen.loading.build_model(cfg, state), 8 if kind == "int8" else 4)
    a, b, eager, mine = verify_side_by_side(model, english_text_ids[None, :40], english_text_ids[None, 40:46],
                                            "float32")
    assert relative(a, b) < 1e-5 and torch.equal(a.argmax(-1), b.argmax(-1)), (kind, relative(a, b))
    torch.testing.assert_close(mine.k, eager.k, atol=1e-4, rtol=1e-4)


def _smollm2_as(kind: str):
    """SmolLM2 with its weights as `kind`: "float32", "bfloat16", or "int8" / "int4" with ":G" groups."""
    folder = minigen.loading.resolve_folder("smollm2-135m")
    cfg, state = minigen.loading.read_config(folder), minigen.loading.read_safetensors(folder)
    if kind in ("float32", "bfloat16"):
        return minigen.loading.build_model(cfg, state, getattr(torch, kind))
    bits, group = kind.split(":")
    return minigen.quantize_weights(minigen.loading.build_model(cfg, state), int(bits.removeprefix("int")),
                                    int(group))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, threads", [("float32", 1), ("float32", 2), ("bfloat16", 2), ("int8:32", 1),
                                           ("int8:32", 2), ("int8:64", 2), ("int4:32", 1), ("int4:32", 2),
                                           ("int4:64", 2)])
def test_smollm2_verify_equals_fused_decode_steps_bit_for_bit(smollm2, english_text_ids, kind, threads):
    """A chunk of T tokens in one C call gives each token the bits that T fused decode steps give it,
    one token at a time: the several-row products give each row the bits of that row alone (fp32:
    rows_batch.c; int8 and int4: the codes widened once, then each row of x through the one-row
    loop's own order of sums, rows_avx512.c; bf16 and the other groupings: the one-row loop per row of
    x), and a row's norms, RoPE, cache write and attention never read another row. So speculative
    decoding over the fused step sees the logits plain fused decoding would, whatever the weights.
    13 tokens: three passes of four rows and one left over."""
    model = smollm2[0] if kind == "float32" else _smollm2_as(kind)
    prompt, chunk = english_text_ids[None, :130], english_text_ids[None, 130:143]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        chunked, stepped = _prefilled(model, prompt, 150), _prefilled(model, prompt, 150)
        with torch.inference_mode():
            together = fused.FusedStep().verify(model, chunk, torch.arange(130, 143), chunked)[0]
            step = fused.FusedStep()
            alone = torch.cat([step.decode(model, chunk[:, t:t + 1], torch.tensor([130 + t]), stepped)
                               for t in range(chunk.shape[1])])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)
    assert torch.equal(chunked.k, stepped.k) and torch.equal(chunked.v, stepped.v)


def test_verify_after_a_rewind_equals_a_fresh_run(tiny_llama):
    """Speculative decoding's rewind: verify 8 tokens at p..p+7, keep 2 (the rest rejected), verify 3
    new ones from p+2. Slots p+5..p+7 still hold rejected keys; each token attends to slots up to its
    own position only, so the logits are those of a cache that never held them, bit for bit (each
    row of a C call is computed alone: the same bits whatever the other rows), and within 1e-5 of
    the eager step's forward over the kept text."""
    _, model = tiny_llama
    g = torch.Generator().manual_seed(7)
    prompt, first, second = (torch.randint(0, 97, (1, n), generator=g) for n in (9, 8, 3))
    p = prompt.shape[1]
    rewound, fresh, eager = (_prefilled(model, prompt, 24) for _ in range(3))
    step, clean = fused.FusedStep(), fused.FusedStep()
    with torch.inference_mode():
        step.verify(model, first, torch.arange(p, p + 8), rewound)
        again = step.verify(model, second, torch.arange(p + 2, p + 5), rewound)
        clean.verify(model, first[:, :2], torch.arange(p, p + 2), fresh)
        want = clean.verify(model, second, torch.arange(p + 2, p + 5), fresh)
        kept = torch.cat([first[:, :2], second], 1)
        reference = EagerStep().verify(model, kept, torch.arange(p, p + 5), eager)[:, 2:]
    assert torch.equal(again, want)
    assert relative(reference, again) < 1e-5
    assert torch.equal(rewound.k[..., :p + 5, :], fresh.k[..., :p + 5, :])
    assert not torch.equal(rewound.k[..., p + 5:p + 8, :], fresh.k[..., p + 5:p + 8, :])  # the stale slots


@pytest.mark.parametrize("k", [1, 4, 8])
def test_smollm2_speculative_greedy_over_the_fused_step_equals_plain_greedy(smollm2, k, monkeypatch):
    """Prompt lookup over the fused target: every verify of 2..k+1 tokens runs in C (the torch
    forward is made to fail), and the greedy tokens are plain greedy decoding's."""
    model, tokenizer = smollm2
    skip_where_aside("fused_step", model)
    skip_where_aside("fused_verify", model)
    ids = tokenizer("The quick brown fox jumps over the lazy dog near the quiet river bank. " * 3,
                    return_tensors="pt").input_ids
    plain = minigen.generate(model, ids, max_new_tokens=40, stop_token_ids=[])

    def no_torch_verify(*args, **kwargs):
        raise AssertionError("FusedStep.verify fell back to the torch forward")
    monkeypatch.setattr(EagerStep, "verify", no_torch_verify)
    fast = minigen.generate(model, ids, max_new_tokens=40, stop_token_ids=[], speculative_method="ngram",
                            num_speculative_tokens=k)
    assert "fused" in fast.stats.step and plain.stats.step == "fused", (fast.stats.step, plain.stats.step)
    assert fast.stats.accepted_tokens > 0  # the text repeats: some rounds verified and kept proposals
    assert torch.equal(fast.tokens, plain.tokens)


def test_verify_runs_what_c_does_not_take_through_torch(tiny_llama):
    """More rows than one C call takes, positions that do not follow each other, or a batch of rows:
    FusedStep.verify hands them to EagerStep.verify, the same forward bit for bit."""
    _, model = tiny_llama
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 97, (1, 5), generator=g)
    cases = [(torch.randint(0, 97, (1, 17), generator=g), torch.arange(5, 22)),
             (torch.randint(0, 97, (1, 3), generator=g), torch.tensor([5, 7, 8]))]
    for chunk, pos in cases:
        caches = [_prefilled(model, prompt, 24) for _ in range(2)]
        with torch.inference_mode():
            want = EagerStep().verify(model, chunk, pos, caches[0])
            got = fused.FusedStep().verify(model, chunk, pos, caches[1])
        assert torch.equal(got, want) and torch.equal(caches[0].k, caches[1].k)


def test_a_verify_past_the_cache_raises_cache_full_before_c_writes(tiny_llama):
    _, model = tiny_llama
    cache = _prefilled(model, torch.tensor([[1, 2, 3, 4, 5, 6]]), 8)
    before = cache.k.clone()
    with torch.inference_mode(), pytest.raises(CacheFullError, match="holds 8 tokens but position 8"):
        fused.FusedStep().verify(model, torch.tensor([[5, 6, 7]]), torch.arange(6, 9), cache)
    assert torch.equal(cache.k, before)


def test_a_verify_token_outside_the_vocabulary_is_refused_before_c_reads_it(tiny_llama):
    _, model = tiny_llama
    cache = _prefilled(model, torch.tensor([[1, 2, 3]]), 8)
    with torch.inference_mode(), pytest.raises(minigen.errors.PromptError, match="token id 97 is outside"):
        fused.FusedStep().verify(model, torch.tensor([[5, 97]]), torch.arange(3, 5), cache)


def _prefilled(model, prompt, max_len):
    """A fresh contiguous cache of max_len slots holding prompt [1, P] (the eager prefill)."""
    cache = KVCache.for_model(model, 1, max_len)
    with torch.inference_mode():
        prefill(model, prompt, cache)
    return cache


# ---------------------------------------------------------------- short prompts in one C call (chapter 3)
def test_a_short_prompt_prefills_in_one_c_call_with_the_eager_logits(smollm2, english_text_ids, monkeypatch):
    """A prompt of 2..16 tokens (or pieces of that size) is a verify chunk from position 0: one C
    call, the eager prefill's logits within 1e-5, and the same greedy tokens as transformers' (the
    test above) and the eager step's, for every weight format the step reads."""
    model, _ = smollm2
    calls = []
    real = fused.FusedStep.verify
    monkeypatch.setattr(fused.FusedStep, "verify", lambda self, m, t, *a, **k: calls.append(t.shape[1])
                        or real(self, m, t, *a, **k))
    for T, chunk in ((16, None), (5, None), (37, 8)):
        ids = english_text_ids[None, :T]
        with torch.inference_mode():
            eager_cache, fused_cache = (make_cache(model, GenerationConfig(), 1, 64) for _ in range(2))
            want = EagerStep().prefill(model, ids, torch.arange(T), eager_cache)
            step = fused.FusedStep()
            step.prefill_chunk_size = chunk
            calls.clear()
            got = step.prefill(model, ids, torch.arange(T), fused_cache)
        assert calls == ([T] if chunk is None else [8, 8, 8, 8, 5]), calls
        assert relative(want, got) < 1e-5
        torch.testing.assert_close(fused_cache.k[..., :T, :], eager_cache.k[..., :T, :], atol=1e-4, rtol=1e-4)
    ids = english_text_ids[None, :12]
    config = GenerationConfig(max_new_tokens=12, stop_token_ids=[])
    skip_where_aside("fused_step", model)
    skip_where_aside("fused_verify", model)
    calls.clear()
    out = minigen.generate(model, ids, config)
    assert out.stats.step == "fused" and calls[:1] == [12], (out.stats.step, calls)
    assert torch.equal(out.tokens, minigen.generate(model, ids, config.replace(fused_decode=False)).tokens)
    # 17 tokens and more: torch's GEMMs (EagerStep.prefill); a batch of rows: the same
    calls.clear()
    minigen.generate(model, english_text_ids[None, :17], config.replace(max_new_tokens=1))
    minigen.generate(model, english_text_ids[None, :8].repeat(2, 1), config.replace(max_new_tokens=1))
    assert calls == [], calls
