"""Chapter 1 exercises: the FLOP count of the naive loop.

1. `naive_step_flops(cfg, n)`: the matmul FLOPs of one naive step, i.e. one forward over all n
   tokens of the sequence so far, logits for the last position only. Count 2 FLOPs per
   multiply-add; count q, k, v and output projections, the MLP (three matrices for "llama", two
   for "gpt2"), attention's two products over the whole masked [n, n] score matrix (q·k and the
   weighted sum of v), and the output head. Leave out norms, RoPE and softmax.
2. `crossover_length(cfg)`: the sequence length n at which the attention products of a naive step
   cost as many FLOPs as the projections and the MLP together (the output head left out). Past it,
   the naive loop's total cost grows as N³ rather than N².

The checkers run your function with `ModelConfig.forward_flops` (the package's count) patched to
raise: write the count from the architecture's numbers, do not read it off the package.
"""

from __future__ import annotations

from ...checkpoints.model_config import ModelConfig
from . import compare, forbidding, known_mistake

# Architecture constants of published checkpoints (their config.json on the Hugging Face hub).
SMOLLM2_135M = ModelConfig(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           head_dim=64, hidden_dim=1536, max_seq_len=8192)
LLAMA2_7B = ModelConfig(arch="llama", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                        head_dim=128, hidden_dim=11008, max_seq_len=4096)
GPT2_SMALL = ModelConfig(arch="gpt2", vocab_size=50257, dim=768, n_layers=12, n_heads=12, n_kv_heads=12,
                         head_dim=64, hidden_dim=3072, max_seq_len=1024)
CONFIGS = {"SmolLM2-135M": SMOLLM2_135M, "Llama-2-7B": LLAMA2_7B, "GPT-2 small": GPT2_SMALL}


def answers(fn, cases, solution):
    """fn(*args) for each case, with the package's FLOP count (and the worked solution, unless fn is
    it) patched to raise; the checker then compares them, hints included, outside the patch."""
    forbidden = (ModelConfig.forward_flops,) + (() if fn is solution else (solution,))
    with forbidding(*forbidden):
        got = [fn(*args) for _, args, _ in cases]
    return iter(got)


# ---------------------------------------------------------------- 1. one naive step
def solution_naive_step_flops(cfg: ModelConfig, n: int) -> int:
    """FLOPs of one forward over n tokens attending n keys, logits for the last token only."""
    D, H, Hkv, Dh, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim
    qkv = 2 * n * D * (H + 2 * Hkv) * Dh  # grouped-query: only Hkv heads of keys and values
    out = 2 * n * H * Dh * D
    mlp = 2 * n * D * F * (3 if cfg.arch == "llama" else 2)
    scores = 2 * n * n * H * Dh  # q k^T: [n, Dh] x [Dh, n] per head
    mix = 2 * n * n * H * Dh  # probabilities @ v: [n, n] x [n, Dh] per head
    head = 2 * D * cfg.vocab_size  # one position's logits
    return cfg.n_layers * (qkv + out + mlp + scores + mix) + head


def _naive_step_hints(args: tuple, got) -> str:
    cfg, n = args
    ref = cfg.forward_flops(n, n)
    attention = cfg.forward_flops(n, n) - cfg.forward_flops(n, 0)
    head = cfg.forward_flops(0, 0)
    kv_as_heads = 2 * cfg.n_layers * n * cfg.dim * 2 * (cfg.n_heads - cfg.n_kv_heads) * cfg.head_dim
    return known_mistake(got, [
        (ref // 2, "count 2 FLOPs per multiply-add (you counted multiply-adds)"),
        (ref - head, "the output head: one [D] x [D, V] product for the last position"),
        (ref - head + n * head, "logits for the last position only: generation needs just the next token"),
        (ref - attention, "attention itself: q·k over n keys and the weighted sum of v, per query"),
        (ref - attention // 2, "count the whole [n, n] score matrix: SDPA with a mask computes it all"),
        (ref + kv_as_heads, "grouped-query attention: k and v have n_kv_heads heads, not n_heads"),
    ])


def check_naive_step_flops(fn) -> bool:
    """fn(cfg: ModelConfig, n: int) -> int, compared exactly with ModelConfig.forward_flops(n, n)."""
    cases = [(f"{name}, n={n}", (cfg, n), cfg.forward_flops(n, n))
             for name, cfg in CONFIGS.items() for n in (1, 7, 512)]
    got = answers(fn, cases, solution_naive_step_flops)
    return compare("naive_step_flops", cases, lambda *args: next(got), _naive_step_hints)


# ---------------------------------------------------------------- 2. the N² -> N³ crossover
def solution_crossover_length(cfg: ModelConfig) -> float:
    """n where 4·n·H·Dh (attention per token) equals the projections + MLP per token."""
    D, H, Hkv, Dh, F = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim
    per_token = 2 * D * (H + 2 * Hkv) * Dh + 2 * H * Dh * D + 2 * D * F * (3 if cfg.arch == "llama" else 2)
    return per_token / (4 * H * Dh)


def _crossover_reference(cfg: ModelConfig) -> float:
    """The same length read off the package's formula: linear FLOPs per token / attention per key."""
    linear = cfg.forward_flops(1, 0) - cfg.forward_flops(0, 0)
    per_key = cfg.forward_flops(1, 1) - cfg.forward_flops(1, 0)
    return linear / per_key


def check_crossover_length(fn) -> bool:
    """fn(cfg: ModelConfig) -> float, within 1% of the package's formula."""
    cases = [(name, (cfg,), _crossover_reference(cfg)) for name, cfg in CONFIGS.items()]

    def hints(args, got):
        ref = _crossover_reference(args[0])
        if abs(got - 2 * ref) <= 0.01 * 2 * ref:
            return "attention has two products (q·k and probabilities·v), each 2·n·H·Dh FLOPs per token"
        if abs(got - ref / 2) <= 0.01 * ref / 2:
            return "compare per-token costs: attention 4·n·H·Dh against projections + MLP"
        return ""

    got = answers(fn, cases, solution_crossover_length)
    return compare("crossover_length", cases, lambda *args: next(got), hints, rel_tol=0.01)
