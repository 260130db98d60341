"""The article's benchmark (claim C6) rebuilt on minigen, and the roofline models behind C6 and C7.

    translate(ARTICLE_CONFIG) ─> GenerationConfig + a note per key (what minigen does with it)
    run(model, ids)          ─> "original" (the plain cached loop) vs the article's config, measured:
                                decode tok/s, TTFT, peak memory, longest context in a budget, quality
    a100_table / implied     ─> which model and batch on an A100-80GB give 42 and 128 tok/s
    c7_table                 ─> where a 175B decode step's time goes, and what KV, window and
                                sparse attention can buy

"Original" is the plain cached loop, not the naive one: the article's memory falls from 38.2 to
12.7 GB with settings that only touch the KV cache (no weight quantization among them), so the
original must hold a cache for them to shrink; the naive loop holds none (`naive_has_no_cache`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import GenerationConfig
from ..errors import ConfigError
from ..generate import generate
from .machine import PeakRSS
from ..evaluate import score
from ..checkpoints.model_config import ModelConfig
from ..paths import bar
from .plan import activation_bytes, kv_cache_bytes, weights_bytes
from .roofline import A100_80GB, GPT3_175B, LLAMA2_7B, LLAMA2_70B, SMOLLM2_135M, Ceiling, streamed_params

# The article's generation_config.json (ARTICLE.md, section 4), as it gives it.
ARTICLE_CONFIG = {"cache_chunk_size": 256, "quant_bits": 4, "window_size": 128, "sparsity_threshold": 0.1,
                  "prefetch_depth": 2}
# metric -> (original, optimized), reported by the article (A100 80GB, model not named)
REPORTED = {"decode tokens/s": (42.0, 128.0), "TTFT ms": (350.0, 320.0), "memory GB": (38.2, 12.7),
            "longest sequence": (2048, 8192)}

# key -> what minigen does with it (every key is applied; the notes flag where it differs from the article)
NOTES = {
    "cache_chunk_size": "applied: a paged cache of 256-token blocks (chapter 5: vLLM uses 16; a 256-token block "
                        "leaves up to 255 slots of each row's last block empty)",
    "quant_bits": "applied: 4-bit keys (per channel) and values (per token), groups of 32 with a scale and zero each "
                  "(the article's 32 per scale; chapter 6), the newest 32 tokens in full precision",
    "window_size": "applied, with a difference flagged: minigen keeps 4 sink tokens (sink_tokens=4; the article's "
                   "snippet has none, and chapter 7 measures what a window costs without them); with "
                   "cache_chunk_size, blocks wholly outside the window and the sinks go back to the pool "
                   "(minigen/combinations.py's APPLIED table; section 3 prints the block table)",
    "sparsity_threshold": "applied: keep keys whose |q.k|/sqrt(d) >= 0.1 x the head's largest (sparse_score='abs', "
                          "the article's rule; chapter 8 found it keeps ~88% of keys)",
    "prefetch_depth": "applied, flagged: the cache lives in a second tier and 2 layers are fetched ahead; on a CPU "
                      "both tiers are the same memory, so nothing overlaps and the copies only cost time",
}
SINK_TOKENS = 4
KV_4BIT_RATIO = 5 / 16  # a 4-bit code + a 16-bit scale and zero per 32 elements, against fp16 (chapter 6)


def translate(article: dict | None = None) -> tuple[GenerationConfig, dict[str, str]]:
    """The article's generation_config.json as a GenerationConfig, and a note per key. A key minigen
    has no field for is refused (ConfigError with the closest field), never dropped."""
    article = dict(ARTICLE_CONFIG if article is None else article)
    config = GenerationConfig.from_dict(article, source="the article's generation_config.json")
    unexplained = [k for k in article if k not in NOTES]
    if unexplained:
        raise ConfigError(f"no translation note for {', '.join(unexplained)}: minigen runs these keys, but this "
                          f"benchmark cannot say how they map to the article's; remove them to run it")
    return config, {k: NOTES[k] for k in article}


def naive_has_no_cache(cfg: ModelConfig, context: int = 2048) -> dict[str, int]:
    """Bytes each loop holds besides the weights: the naive loop keeps no KV cache, so settings that only
    change the cache cannot lower its memory; the cached loop holds context x kv bytes per token."""
    return {"naive": kv_cache_bytes(cfg, GenerationConfig(use_cache=False), 1, context),
            "cached": kv_cache_bytes(cfg, GenerationConfig(), 1, context)}


# ---------------------------------------------------------------- measured on our harness
@dataclass
class Row:
    name: str
    decode_tokens_per_s: float  # per sequence, median over the repeats
    ttft_s: float  # the fastest of the repeats (a prefill only gets slower from a busy neighbour)
    peak_memory_bytes: int  # weights + the cache's peak bytes (counted by the cache)
    rss_added_bytes: int  # what the generation added to the process's peak RSS (measured)
    kv_cache_bytes: int
    longest_context: int  # tokens that fit the budget (plan's count), capped at the model's context
    perplexity: float
    top1_agreement: float  # with the original's greedy predictions


def longest_context(cfg: ModelConfig, config: GenerationConfig, budget_bytes: int, batch: int = 1,
                    dtype: torch.dtype = torch.float32) -> int:
    """The longest context whose weights + KV cache + activations (minigen.measure.plan's counts) fit the budget,
    capped at the model's context; 0 when not even one token fits."""
    def total(n: int) -> int:
        return weights_bytes(cfg, dtype) + kv_cache_bytes(cfg, config, batch, n, dtype) + activation_bytes(cfg, batch, n)

    if total(1) > budget_bytes:
        return 0
    lo, hi = 1, cfg.max_seq_len
    if total(hi) <= budget_bytes:
        return hi
    while hi - lo > 1:  # total(lo) fits, total(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= budget_bytes else (lo, mid)
    return lo


def run(model, prompt: torch.Tensor, text: torch.Tensor, new_tokens: int = 24, repeats: int = 2,
        budget_context: int = 2048, article: dict | None = None) -> tuple[list[Row], int]:
    """Measure the original (GenerationConfig()) and the article's config on `prompt` [1, T]; quality on
    `text` [N] fed one token at a time. The memory budget is the original's at `budget_context` tokens.
    The configs take turns within each repeat, so a busy neighbour slows both. -> (rows, budget bytes)"""
    cfg, dtype = model.config, model.dtype
    configs = {"original (cached loop)": GenerationConfig(), "article's config": translate(article)[0]}
    budget = (weights_bytes(cfg, dtype) + kv_cache_bytes(cfg, GenerationConfig(), 1, budget_context, dtype)
              + activation_bytes(cfg, 1, budget_context))
    runs = {name: [] for name in configs}
    progress = bar(total=repeats * len(configs) + len(configs), desc="article bench", unit="run")
    for name, c in configs.items():  # warm-up: first-call allocations are not part of the numbers
        generate(model, prompt, c, max_new_tokens=2, stop_token_ids=[])
    for _ in range(repeats):
        for name, c in configs.items():
            with PeakRSS() as mem:
                out = generate(model, prompt, c, max_new_tokens=new_tokens, stop_token_ids=[])
            runs[name].append((out.stats, mem.added))
            progress.update(1)
    base = score(model, text)
    rows = []
    for name, c in configs.items():
        stats = sorted(runs[name], key=lambda r: r[0].decode_tokens_per_s)[len(runs[name]) // 2][0]
        s = base if name.startswith("original") else score(model, text, c, chunk_size=1)
        progress.update(1)  # quality: the slow part, one token at a time
        rows.append(Row(name, stats.decode_tokens_per_s, min(r[0].ttft_s for r in runs[name]),
                        weights_bytes(cfg, dtype) + stats.peak_kv_cache_bytes, max(r[1] for r in runs[name]),
                        stats.kv_cache_bytes, longest_context(cfg, c, budget, 1, dtype), s.perplexity,
                        (s.top1 == base.top1).float().mean().item()))
    progress.close()
    return rows, budget


def table(rows: list[Row], hardware: str) -> str:
    """Markdown: the measured rows side by side with the article's reported ones."""
    o, a = rows
    mb = 1e6
    lines = ["| metric | original | article's config | gain (> 1: better) | reported by the article (A100 80GB) |",
             "|---|---|---|---|---|",
             f"| decode tokens/s ({hardware}) | {o.decode_tokens_per_s:.1f} | {a.decode_tokens_per_s:.1f} | "
             f"{a.decode_tokens_per_s / o.decode_tokens_per_s:.2f}x | 42 → 128 (3.05x) |",
             f"| TTFT ms ({hardware}) | {o.ttft_s * 1e3:.0f} | {a.ttft_s * 1e3:.0f} | "
             f"{o.ttft_s / a.ttft_s:.2f}x | 350 → 320 (1.09x) |",
             f"| memory MB (weights + peak KV, counted) | {o.peak_memory_bytes / mb:.1f} | "
             f"{a.peak_memory_bytes / mb:.1f} | {o.peak_memory_bytes / a.peak_memory_bytes:.2f}x | "
             "38.2 GB → 12.7 GB (3.01x) |",
             f"| KV cache MB (counted) | {o.kv_cache_bytes / mb:.2f} | {a.kv_cache_bytes / mb:.2f} | "
             f"{o.kv_cache_bytes / a.kv_cache_bytes:.2f}x | – |",
             f"| longest sequence in the budget (plan) | {o.longest_context:,} | {a.longest_context:,} | "
             f"{a.longest_context / o.longest_context:.2f}x | 2,048 → 8,192 (4.00x) |",
             f"| perplexity ({hardware}) | {o.perplexity:.3f} | {a.perplexity:.3f} | "
             f"{a.perplexity / o.perplexity:.3f}x | not reported |",
             f"| top-1 agreement with the original | {o.top1_agreement:.1%} | {a.top1_agreement:.1%} | – | "
             "not reported |"]
    return "\n".join(lines)


# ---------------------------------------------------------------- C6 on an A100-80GB: a roofline model
def implied(ceiling: Ceiling = A100_80GB) -> dict[str, float]:
    """What the reported rows imply at batch 1: the bytes a step may read at most (100% of the bandwidth),
    the share of the bandwidth used if each step reads the whole reported memory once, and the largest
    fp16 model whose weights fit the optimized row's memory (the settings do not touch the weights)."""
    (tok_o, tok_a), (gb_o, gb_a) = REPORTED["decode tokens/s"], REPORTED["memory GB"]
    return {"max_bytes_original": ceiling.bandwidth / tok_o, "max_bytes_optimized": ceiling.bandwidth / tok_a,
            "bandwidth_share_original": tok_o * gb_o * 1e9 / ceiling.bandwidth,
            "bandwidth_share_optimized": tok_a * gb_a * 1e9 / ceiling.bandwidth,
            "max_fp16_params": gb_a * 1e9 / 2, "kv_freed_bytes": (gb_o - gb_a) * 1e9}


@dataclass
class Candidate:
    model: str
    batch: int
    context: int
    weights_bytes: float
    original_tok_s: float  # per sequence, at `efficiency` of the bandwidth (and under the compute roof)
    optimized_tok_s: float
    original_memory: float  # weights + fp16 KV of every row
    optimized_memory: float  # weights + 4-bit KV of the positions held: all, or what the window keeps (`a100_table`)
    fits: bool  # the original fits the device's memory


A100_SHAPES = {"SmolLM2-135M": SMOLLM2_135M, "Llama-2-7B": LLAMA2_7B,
               "Llama-2-13B": ModelConfig(arch="llama", vocab_size=32000, dim=5120, n_layers=40, n_heads=40,
                                          n_kv_heads=40, head_dim=128, hidden_dim=13824, max_seq_len=4096,
                                          tie_embeddings=False),
               "Llama-2-70B": LLAMA2_70B}


def step_bytes(cfg: ModelConfig, batch: int, tokens_read: float, kv_ratio: float = 1.0) -> float:
    """fp16 weights streamed once + each row's KV of `tokens_read` positions (fp16 x kv_ratio)."""
    return streamed_params(cfg) * 2 + batch * tokens_read * cfg.kv_bytes_per_token(2) * kv_ratio


def window_blocks(position: int, window: int = 128, sinks: int = SINK_TOKENS, block: int = 256) -> list[int]:
    """The logical blocks a paged row holds while its query is at `position`: those holding a sink or a
    position of the window (the query's own included); minigen's paged cache gives the others back."""
    seen = {p // block for p in range(min(sinks, position + 1))}
    return sorted(seen | {p // block for p in range(max(0, position - window + 1), position + 1)})


def paged_window_slots(context: int, window: int = 128, sinks: int = SINK_TOKENS, block: int = 256) -> int:
    """The most slots a paged row holds while decoding up to `context` positions under a window: whole
    blocks, so up to a block for the sinks and two for a window that straddles a boundary."""
    return max(len(window_blocks(p, window, sinks, block)) for p in range(context)) * block


def a100_table(shapes: dict[str, ModelConfig] | None = None, batches=(1, 4, 16, 24, 64), context: int = 2048,
               efficiency: float = 0.8, window: int = 128, window_frees: bool = True, block: int | None = None,
               ceiling: Ceiling = A100_80GB) -> list[Candidate]:
    """Per-sequence decode tok/s of each model and batch on `ceiling` for the original (fp16 cache,
    `context` tokens) and the article's settings (4-bit KV, `window` + 4 sinks read), at `efficiency` of
    the bandwidth (0.8: what the reported rows imply, `implied`), never above the compute roof.
    Memory holds the 4-bit KV of: every position when not `window_frees` (a window that only masks, as
    minigen's contiguous quantized cache); the window and sinks alone (a ring that frees per token); or,
    with `block`, the whole blocks a paged cache keeps (`paged_window_slots`: it frees per block)."""
    out = []
    for name, cfg in (shapes or A100_SHAPES).items():
        for b in batches:
            flops = b * cfg.forward_flops(1, context)
            kept = min(context, window + SINK_TOKENS)
            rates = [1 / max(step_bytes(cfg, b, n, r) / (efficiency * ceiling.bandwidth), flops / ceiling.peak_flops)
                     for n, r in ((context, 1.0), (kept, KV_4BIT_RATIO))]
            held = context if not window_frees else kept if block is None else min(
                context, paged_window_slots(context, window, SINK_TOKENS, block))
            out.append(Candidate(name, b, context, streamed_params(cfg) * 2, rates[0], rates[1],
                                 step_bytes(cfg, b, context), step_bytes(cfg, b, held, KV_4BIT_RATIO),
                                 step_bytes(cfg, b, context) <= ceiling.memory_bytes))
    return out


def prefill_tokens(cfg: ModelConfig, ttft_s: float, mfu: float = 1.0, ceiling: Ceiling = A100_80GB) -> float:
    """Prompt tokens (all rows together) a prefill of `ttft_s` can process at `mfu` of the peak FLOP/s
    (2 FLOPs per weight per token; attention's FLOPs left out, so this is an upper bound)."""
    return ttft_s * mfu * ceiling.peak_flops / (2 * streamed_params(cfg))


MATCH_TOLERANCE = 0.25  # a modelled number "matches" a reported one within 25% either way (stated in chapter 17)


def matches(c: Candidate, tolerance: float = MATCH_TOLERANCE) -> dict[str, bool]:
    """Which reported numbers the candidate lands within `tolerance` of (relative, either way)."""
    (tok_o, tok_a), (gb_o, gb_a) = REPORTED["decode tokens/s"], REPORTED["memory GB"]
    near = lambda x, y: abs(x / y - 1) <= tolerance  # noqa: E731
    return {"42 tok/s": near(c.original_tok_s, tok_o), "128 tok/s": near(c.optimized_tok_s, tok_a),
            "38.2 GB": near(c.original_memory / 1e9, gb_o), "12.7 GB": near(c.optimized_memory / 1e9, gb_a)}


# ---------------------------------------------------------------- C7: a 175B decode step
@dataclass
class Split:
    batch: int
    context: int
    weights_s: float  # reading the weights once
    kv_s: float  # reading every row's keys and values
    compute_s: float  # the FLOPs at the peak
    fits: bool  # weights + fp16 KV fit the node's memory
    gpus_needed: int  # devices whose memory holds weights + fp16 KV
    speedups: dict[str, float]  # optimization -> step time before / after (the roofline's bound)


def c7_table(cfg: ModelConfig = GPT3_175B, batches=(1, 8, 32, 128), contexts=(512, 2048, 8192), gpus: int = 8,
             ceiling: Ceiling = A100_80GB, window: int = 128, sparse_keep: float = 0.88) -> list[Split]:
    """Where a decode step's time goes on `gpus` x `ceiling` (ideal tensor parallelism: bandwidth, FLOP/s and
    memory add up), and the bound on what each KV optimization buys. 4-bit KV reads 5/16 of the fp16
    bytes; the window reads window + 4 sinks positions; sparse attention must still read every key to
    score it, and skips the values of the keys it drops (`sparse_keep`: chapter 8's 88% at threshold 0.1).
    None of them reads fewer weights, so the weights' time is a floor."""
    bw, peak, memory = gpus * ceiling.bandwidth, gpus * ceiling.peak_flops, gpus * ceiling.memory_bytes
    weights = streamed_params(cfg) * 2
    out = []
    for n in contexts:
        for b in batches:
            kv = b * n * cfg.kv_bytes_per_token(2)
            compute = b * cfg.forward_flops(1, n) / peak
            kept = min(n, window + SINK_TOKENS) / n
            ratios = {"4-bit KV": KV_4BIT_RATIO, f"window {window}": kept, "sparse": 0.5 + 0.5 * sparse_keep,
                      "all three": KV_4BIT_RATIO * kept * (0.5 + 0.5 * sparse_keep),
                      "no KV reads at all": 0.0}
            base = max((weights + kv) / bw, compute)
            speedups = {k: base / max((weights + kv * r) / bw, compute) for k, r in ratios.items()}
            out.append(Split(b, n, weights / bw, kv / bw, compute, weights + kv <= memory,
                             math.ceil((weights + kv) / ceiling.memory_bytes), speedups))
    return out


@dataclass
class LargestBatch:
    """C7 read at the largest batch each setting fits: freed memory buys a larger batch."""
    setting: str  # "fp16 KV", "4-bit KV", ...
    batch: int  # the most sequences of `context` tokens whose cache fits beside the weights
    tokens_per_s: float  # the roofline's bound for that batch, all sequences together
    speedup: float  # over the fp16 baseline at ITS largest batch
    compute_bound: bool  # the step is bound by FLOPs at that batch, not by reading memory


def c7_largest_batch(cfg: ModelConfig = GPT3_175B, context: int = 2048, gpus: int = 8, ceiling: Ceiling = A100_80GB,
                     window: int = 128, sparse_keep: float = 0.88) -> list[LargestBatch]:
    """Each setting of c7_table at the largest batch its cache lets fit beside the fp16 weights on `gpus` x
    `ceiling` (ideal tensor parallelism, the same formulas): 4-bit KV stores 5/16 of the fp16 bytes, a window
    that frees what it drops stores window + 4 sinks positions, and sparse attention stores every key (it
    only reads fewer values). The speed-up compares each with the fp16 baseline at its own largest batch."""
    weights, per_row = streamed_params(cfg) * 2, context * cfg.kv_bytes_per_token(2)
    out = []
    for name, (stored, read) in _c7_settings(context, window, sparse_keep).items():
        b = int((gpus * ceiling.memory_bytes - weights) // (per_row * stored))
        tokens_per_s, compute_bound = _c7_throughput(cfg, context, gpus, ceiling, b, read)
        out.append(LargestBatch(name, b, tokens_per_s, 0.0, compute_bound))
    for row in out:
        row.speedup = row.tokens_per_s / out[0].tokens_per_s
    return out


def c7_batch_for(speedup: float, cfg: ModelConfig = GPT3_175B, context: int = 2048, gpus: int = 8,
                 ceiling: Ceiling = A100_80GB, window: int = 128, sparse_keep: float = 0.88) -> int | None:
    """The smallest batch at which all three settings give `speedup` x the fp16 baseline's throughput at
    its largest batch (c7_largest_batch); None if no batch that fits does."""
    rows = c7_largest_batch(cfg, context, gpus, ceiling, window, sparse_keep)
    _, read = _c7_settings(context, window, sparse_keep)["all three"]
    for b in range(1, rows[-1].batch + 1):
        if _c7_throughput(cfg, context, gpus, ceiling, b, read)[0] >= speedup * rows[0].tokens_per_s:
            return b
    return None


def _c7_settings(context: int, window: int, sparse_keep: float) -> dict[str, tuple[float, float]]:
    """C7's settings -> (KV bytes stored, KV bytes read) per fp16 byte of a full cache."""
    kept, sparse = min(context, window + SINK_TOKENS) / context, 0.5 + 0.5 * sparse_keep
    return {"fp16 KV": (1.0, 1.0), "4-bit KV": (KV_4BIT_RATIO, KV_4BIT_RATIO),
            f"4-bit KV + window {window}": (KV_4BIT_RATIO * kept, KV_4BIT_RATIO * kept),
            "all three": (KV_4BIT_RATIO * kept, KV_4BIT_RATIO * kept * sparse)}


def _c7_throughput(cfg: ModelConfig, context: int, gpus: int, ceiling: Ceiling, batch: int,
                   read: float) -> tuple[float, bool]:
    """(tokens/s of `batch` sequences by the roofline, whether bound by compute): the fp16 weights and each
    row's KV bytes (`read` per fp16 byte) from memory, against the step's FLOPs."""
    weights, per_row = streamed_params(cfg) * 2, context * cfg.kv_bytes_per_token(2)
    memory_s = (weights + batch * per_row * read) / (gpus * ceiling.bandwidth)
    compute_s = batch * cfg.forward_flops(1, context) / (gpus * ceiling.peak_flops)
    return batch / max(memory_s, compute_s), compute_s >= memory_s


def kv_needed_for(speedup: float, cfg: ModelConfig = GPT3_175B) -> float:
    """KV bytes a step must read, beside the fp16 weights, for removing every KV read to give `speedup`."""
    return (speedup - 1) * streamed_params(cfg) * 2


# ---------------------------------------------------------------- GPU profiles (scripts/gpu_check.py)
GPU_FOLDER = Path(__file__).resolve().parents[2] / "figures" / "gpu"


def gpu_profiles(folder: str | Path = GPU_FOLDER) -> dict[str, dict]:
    """The committed reports of scripts/gpu_check.py (its smoke runs left out), by file name; {} if none."""
    folder = Path(folder)
    reports = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        report = json.loads(path.read_text(encoding="utf-8"))
        if not report.get("smoke") and report.get("hardware", {}).get("gpu"):
            reports[path.name] = report
    return reports
