"""Chapter 2 exercises: what the KV cache costs in memory.

1. `kv_cache_bytes(cfg, tokens, batch, bytes_per_element)`: the bytes a cache holding `tokens`
   positions for `batch` sequences takes, keys and values of every layer, at `bytes_per_element`
   bytes per number (2 for fp16/bf16, 4 for fp32).
2. `max_cached_tokens(cfg, budget_bytes, batch, bytes_per_element)`: the most positions per
   sequence whose cache fits in `budget_bytes` (a whole number of tokens).

The checkers run your function with `ModelConfig.kv_bytes_per_token` (the package's count) and the
worked solutions patched to raise: write the count from the architecture's numbers.
"""

from __future__ import annotations

from ...checkpoints.model_config import ModelConfig
from . import compare, forbidding, known_mistake
from .ch01 import GPT2_SMALL, LLAMA2_7B, SMOLLM2_135M

# Llama-2-70B (config.json on the hub): grouped-query attention with 8 KV heads for 64 query heads.
LLAMA2_70B = ModelConfig(arch="llama", vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                         head_dim=128, hidden_dim=28672, max_seq_len=4096)
CONFIGS = {"SmolLM2-135M": SMOLLM2_135M, "Llama-2-7B": LLAMA2_7B, "Llama-2-70B": LLAMA2_70B,
           "GPT-2 small": GPT2_SMALL}


def answers(fn, cases):
    """fn(*args) for each case, with the package's byte count and the worked solutions (but the one
    fn is) patched to raise; the checker then compares them, hints included, outside the patch."""
    forbidden = [ModelConfig.kv_bytes_per_token] + [s for s in (solution_kv_cache_bytes,
                                                                solution_max_cached_tokens) if s is not fn]
    with forbidding(*forbidden):
        got = [fn(*args) for _, args, _ in cases]
    return iter(got)


# ---------------------------------------------------------------- 1. bytes held
def solution_kv_cache_bytes(cfg: ModelConfig, tokens: int, batch: int = 1, bytes_per_element: int = 2) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes, per token, times tokens and batch."""
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_element
    return per_token * tokens * batch


def _reference_bytes(cfg: ModelConfig, tokens: int, batch: int, bytes_per_element: int) -> int:
    return cfg.kv_bytes_per_token(bytes_per_element) * tokens * batch


def _bytes_hints(args: tuple, got) -> str:
    cfg, tokens, batch, bpe = args
    ref = _reference_bytes(*args)
    return known_mistake(got, [
        (ref // 2, "store both keys and values (the factor 2)"),
        (ref // cfg.n_kv_heads * cfg.n_heads, "grouped-query attention caches n_kv_heads heads, not n_heads"),
        (ref * 8, "bytes_per_element is already in bytes (fp16 = 2), not bits"),
        (ref // bpe, "multiply by bytes_per_element"),
        (ref // batch, "every sequence of the batch has its own cache"),
        (ref // cfg.n_layers, "every layer has its own keys and values"),
    ])


def check_kv_cache_bytes(fn) -> bool:
    """fn(cfg, tokens, batch, bytes_per_element) -> int, exactly ModelConfig.kv_bytes_per_token x tokens x batch."""
    cases = [(f"{name}, {tokens} tokens, batch {batch}, {bpe} bytes", (cfg, tokens, batch, bpe),
              _reference_bytes(cfg, tokens, batch, bpe))
             for name, cfg in CONFIGS.items() for tokens, batch, bpe in ((2048, 1, 2), (100, 3, 4))]
    got = answers(fn, cases)
    return compare("kv_cache_bytes", cases, lambda *args: next(got), _bytes_hints)


# ---------------------------------------------------------------- 2. the longest context that fits
def solution_max_cached_tokens(cfg: ModelConfig, budget_bytes: int, batch: int = 1,
                               bytes_per_element: int = 2) -> int:
    """Whole tokens whose keys and values, for every sequence of the batch, fit in the budget."""
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_element  # K and V, every layer
    return budget_bytes // (batch * per_token)


def check_max_cached_tokens(fn) -> bool:
    """fn(cfg, budget_bytes, batch, bytes_per_element) -> int, exactly the package's answer."""
    cases = []
    for name, cfg in CONFIGS.items():
        for budget, batch, bpe in ((16 * 2**30, 1, 2), (10**9, 8, 4), (10**7 + 1, 3, 2)):
            expected = budget // (batch * cfg.kv_bytes_per_token(bpe))
            cases.append((f"{name}, budget {budget:,} B, batch {batch}, {bpe} bytes", (cfg, budget, batch, bpe),
                          expected))

    def hints(args, got):
        cfg, budget, batch, bpe = args
        exact = budget / (batch * cfg.kv_bytes_per_token(bpe))
        if isinstance(got, float) and got != int(got):
            return "a cache holds whole tokens: round down"
        if got == int(exact) + 1:
            return "round down, not up: the last partial token does not fit"
        if got == budget // cfg.kv_bytes_per_token(bpe):
            return "the batch shares the budget: divide by batch too"
        return ""

    got = answers(fn, cases)
    return compare("max_cached_tokens", cases, lambda *args: next(got), hints)
