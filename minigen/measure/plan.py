"""The memory planner: which cache settings fit a memory budget, cheapest in quality first.

    plan(model, batch, context, budget_bytes) ─> weights + KV cache + activations for each setting
                                              ─> the settings that fit, ranked by expected quality loss

The KV bytes of a setting are exact, not a formula to keep in step with the caches: `make_cache`
builds the cache the config selects on PyTorch's "meta" device (shapes, no memory), for one row
and for two (a cache's bytes are affine in its rows, so a plan for any batch allocates nothing),
and its `nbytes` is what `generate` reports in `stats.kv_cache_bytes` (a paged cache adds the buffer
it gathers blocks into, counted here). The weights are counted the same way, on a meta `Model`.
The activations are counted from the tensors one layer of the prefill holds at its peak (the
MLP's), for the rows one forward runs: the whole prompt, or `prefill_chunk_size` of them. Where the
whole prompt's activations do not fit, the planner offers the largest prompt chunk that does
(PREFILL_CHUNKS). `profiling.peak_tensor_bytes` measures what a generation really allocates, to hold the
estimate against (tests/test_plan.py: within 10%).

A model trained with sliding layers (Gemma 3, Mistral; ModelConfig.layer_types) gets the hybrid
cache by default (caches/hybrid.py): each sliding layer a ring of `sliding_window` slots, each full
layer every position; `Plan.hybrid` states that rule, and `format_plan` prints it. Storage features
that keep every position (quant_bits, cache_chunk_size) and an imposed window (which masks every layer)
choose their own cache, counted the same exact way.

The quality loss of each setting is the chapters' measurement on SmolLM2 (perplexity change):
QUALITY_LOSS cites where each number comes from. Settings that combine add their losses (an
approximation: they were measured one at a time).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..caches.make import make_cache
from ..config import GenerationConfig
from ..errors import ConfigError
from ..loading import read_config, resolve_folder
from ..model import Model
from ..checkpoints.model_config import ModelConfig
from ..numerics.precision import DTYPES

# setting -> (expected perplexity change in %, where it was measured), SmolLM2-135M
QUALITY_LOSS = {
    "kv_dtype": (0.2, "chapter 09: a 16-bit KV cache kept perplexity within 0.2% of fp32's (512 tokens)"),
    # quant_bits: minigen/data/kv_quant_quality.json, written by scripts/kv_quant_quality.py on 2026-12-03
    # (AMD EPYC, one thread of a two-core CPU, 600 tokens, bf16 scales and zeros); chapter 06 renders it.
    "quant_bits=8": (0.0, "chapter 06: 8-bit keys per channel, +0.00% perplexity (600 tokens)"),
    "quant_bits=4": (0.37, "chapter 06: 4-bit keys per channel, 32-token window, +0.37% perplexity (600 tokens)"),
    "window_size=256": (7.0, "chapter 07: window 256 + 4 sinks, 1.07x perplexity (1,200 tokens)"),
    "window_size=128": (11.0, "chapter 07: window 128 + 4 sinks, 1.11x perplexity (1,200 tokens)"),
    "window_size=64": (26.0, "chapter 07: window 64 + 4 sinks, 1.26x perplexity (1,200 tokens)"),
}
KV_STORAGE = [{}, {"kv_dtype": "bfloat16"}, {"kv_dtype": "float16"}, {"quant_bits": 8}, {"quant_bits": 4}]
PAGED_CHUNKS = (16, 256)  # vLLM's default block size, and the article's cache_chunk_size
PREFILL_CHUNKS = (2048, 1024, 512, 256)  # prompt chunks the planner offers, the largest that fits first
WINDOWS = [None, 256, 128, 64]


def model_config(model: str | os.PathLike | ModelConfig | Model) -> ModelConfig:
    """A ModelConfig from a config, a model, or a name that `load` takes (only config.json is read)."""
    if not isinstance(model, (str, os.PathLike, ModelConfig, Model)):  # os.fspath's TypeError, before
        raise ConfigError(f"model={model!r} is invalid: plan takes a model name or folder (str or Path, as "
                          "`load` does), a ModelConfig or a Model")
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, Model):
        return model.config
    return read_config(resolve_folder(model))


def weights_bytes(cfg: ModelConfig, dtype: str | torch.dtype = "float32") -> int:
    """Bytes of the weights in `dtype`: a Model built on the meta device, its parameters counted."""
    with torch.device("meta"):
        params = sum(p.numel() for p in Model(cfg).parameters())
    return params * _dtype(dtype).itemsize


def kv_cache_bytes(cfg: ModelConfig, config: GenerationConfig, batch: int, context: int,
                   dtype: str | torch.dtype = "float32", prompt_len: int | None = None) -> int:
    """The bytes `generate` holds at the end for `batch` rows of `context` positions (prompt + new
    tokens) under `config`, the weights in `dtype` (the cache's dtype unless kv_dtype says another).
    A paged cache's gather buffer depends on the prompt's length (`prompt_len`; None: the whole context)."""
    if not config.use_cache:
        return 0
    # Built for one row and for two, never for `batch`: a cache's bytes are affine in its rows (each
    # row's tensors, plus what all rows share, as a window's slot positions), and a paged pool keeps
    # Python lists of its blocks, which a plan for 10**12 rows ran out of memory building.
    stub = _meta_model(cfg, dtype)
    one, two = (make_cache(stub, config, rows, context).nbytes for rows in (1, 2))
    held = one + (batch - 1) * (two - one)
    bs = config.cache_chunk_size
    if bs is not None:
        # the block tables (paged.py nbytes): an int32 entry per block a row has written
        held += 4 * batch * math.ceil((context - 1 if prompt_len and prompt_len < context else context) / bs)
    if bs is not None and config.quant_bits is None:
        # the buffer attention gathers the rows' blocks into, keys and values (paged.py `_buffer`)
        stored = DTYPES[config.kv_dtype] if config.kv_dtype else _dtype(dtype)
        block = bs * cfg.n_kv_heads * cfg.head_dim * stored.itemsize
        held += 2 * block * _gather_blocks(config, batch, context, prompt_len or context)
    return held


def _meta_model(cfg: ModelConfig, dtype: str | torch.dtype) -> SimpleNamespace:
    """What make_cache reads of a model, on the meta device: its caches are sized, never filled."""
    return SimpleNamespace(config=cfg, device=torch.device("meta"), dtype=_dtype(dtype))


def _gather_blocks(config: GenerationConfig, batch: int, context: int, prompt_len: int) -> int:
    """Blocks in a paged cache's gather buffer at the end of a generation: the prefill's blocks (chunk
    by chunk with prefill_chunk_size), then grown by doubling whenever a step's rows hold more
    (blocks outside a window are freed)."""
    bs, window, sinks = config.cache_chunk_size, config.window_size, config.sink_tokens
    size, C = 0, config.prefill_chunk_size or prompt_len
    # the prefill writes [0, prompt_len), C at a time; decode step i writes position prompt_len + i, up to context - 2
    pieces = [(s, min(s + C, prompt_len)) for s in range(0, prompt_len, C)]
    for start, end in pieces + [(p, p + 1) for p in range(prompt_len, context - 1)]:
        freed = 0
        if window is not None:  # block j is freed when all of it is past the sinks and out of the window:
            # j * bs >= sinks and start - (j * bs + bs - 1) >= window (attention.in_window)
            freed = max(0, (start - window - bs + 1) // bs - math.ceil(sinks / bs) + 1)
        need = batch * (math.ceil(end / bs) - freed)
        if need > size:
            size = max(need, 2 * size)
    return size


def activation_bytes(cfg: ModelConfig, batch: int, context: int, compute: str | torch.dtype = "float32",
                     config: GenerationConfig | None = None) -> int:
    """The largest activations alive at once: one layer of the prefill, for the rows one forward
    runs (the whole prompt of `context` tokens, or config.prefill_chunk_size of them).

    Per row, at the layer's peak, the MLP: the residual coming in and the one after attention, the
    normed input, gate|up (one product), silu(gate) and its product with up; attention's peak (the
    residuals, q/k/v and the rotations) where it is larger. Per position: the rotary tables and the
    angles they come from (fp32). A mask [rows, S] (bool, and the additive one in the compute
    dtype) only where attention needs one: a chunk after the first, a window or sparse selection.
    A prompt that starts at position 0 runs SDPA's causal tiles without a mask, and CPU SDPA never
    materializes the [B, H, T, S] scores. Plus the last position's logits. (Sparse selection's
    scores are not counted: the planner does not offer it.)"""
    config = config or GenerationConfig()
    rows, e = min(config.prefill_chunk_size or context, context), _dtype(compute).itemsize
    D, Dh, qk = cfg.dim, cfg.head_dim, (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim
    mlp = 3 * D + 4 * cfg.hidden_dim
    attention = 2 * D + (qk + cfg.n_kv_heads * cfg.head_dim) + 3 * qk  # residual, normed, qkv, rotation's temporaries
    rope = 3 * (Dh // 2) * 4 + 2 * Dh * e  # angles, cos, sin (fp32); the two tables
    policy = config.window_size is not None or config.sparse  # its mask stays bool
    mask = rows * context * (1 + (0 if policy else e)) if rows < context or policy else 0
    return batch * rows * max(mlp, attention) * e + rows * rope + mask + batch * cfg.vocab_size * 4


def engine_bytes(cfg: ModelConfig, config: GenerationConfig, max_batch_size: int, context: int,
                 max_num_batched_tokens: int | None = None, num_blocks: int | None = None,
                 dtype: str | torch.dtype = "float32") -> tuple[int, int]:
    """(KV bytes, activation bytes) of a serving Engine(model, config, max_batch_size=...,
    num_blocks=..., max_num_batched_tokens=...) whose sequences reach `context` positions.

    KV: the pool, allocated whole when the engine starts (num_blocks blocks; None: max_batch_size
    sequences of `context`), and the buffer attention gathers a forward's rows into (each row's
    blocks, up to `context`). Activations: the largest forward a step runs. The engine runs its rows
    at their own positions, so every forward builds a mask [B, 1, T, S]. Without a budget, a step
    prefills every admitted prompt in one forward, left-padded to the longest: up to max_batch_size
    whole prompts. With a budget, each forward's padded rows stay within it (scheduler.forward_groups): at most
    max_num_batched_tokens rows. The decode forward runs max_batch_size rows of one token.

    A model with sliding layers (and no window_size of the config's) keeps them in a second, fixed
    pool of windows (caches/hybrid.py, HybridPagedKVCache): engine_pool_bytes counts it."""
    pool, gathered = engine_pool_bytes(cfg, config, max_batch_size, context, max_num_batched_tokens, num_blocks, dtype)
    if max_num_batched_tokens is None:
        batch, rows = max_batch_size, context
    else:
        batch, rows = 1, min(max_num_batched_tokens, context)
    mask = 1 + _dtype(dtype).itemsize  # bytes per entry: the bool mask and the additive one

    def forward(batch: int, rows: int) -> int:  # generate's count, with the engine's [B, 1, T, S] mask
        shared = rows * context * mask if rows < context else 0  # the [T, S] mask activation_bytes counts
        chunk = GenerationConfig(prefill_chunk_size=rows)
        return activation_bytes(cfg, batch, context, dtype, chunk) - shared + batch * rows * context * mask

    whole = max_num_batched_tokens is None
    prefill = forward(max_batch_size, context) if whole else forward(1, min(max_num_batched_tokens, context))
    return pool + gathered, max(prefill, forward(max_batch_size, 1))


def engine_pool_bytes(cfg: ModelConfig, config: GenerationConfig, max_batch_size: int, context: int,
                      max_num_batched_tokens: int | None = None, num_blocks: int | None = None,
                      dtype: str | torch.dtype = "float32") -> tuple[int, int]:
    """(the pools' bytes, the gather buffers' bytes) of engine_bytes' Engine, by the engine's own rule:
    its pool holds the full layers, num_blocks blocks (None: max_batch_size sequences of `context`);
    a model's sliding layers, when it has them, sit in a pool of max_batch_size windows
    (HybridPagedKVCache.sliding_pool_blocks: a window plus a step's tokens per row). Each pool has a
    buffer that a forward gathers its rows' blocks into, for one layer: every row's blocks for the
    full layers, every row's window for the sliding ones."""
    from ..caches.hybrid import HybridPagedKVCache
    bs = config.cache_chunk_size or 16  # the engine's default block size (serving/engine.py)
    e = DTYPES[config.kv_dtype].itemsize if config.kv_dtype else _dtype(dtype).itemsize
    block = bs * cfg.n_kv_heads * cfg.head_dim * e  # keys, or values, of one block of one layer
    per_row = math.ceil(context / bs)
    sliding = cfg.sliding_layers if config.window_size is None else 0  # an imposed window: one pool
    windows = (HybridPagedKVCache.sliding_pool_blocks(max_batch_size, cfg.sliding_window, bs, context,
                                                      max_num_batched_tokens or context) if sliding else 0)
    blocks = num_blocks if num_blocks is not None else max_batch_size * per_row
    pool = 2 * block * ((cfg.n_layers - sliding) * blocks + sliding * windows)
    # the decode forward gathers every row's blocks (the full layers') and every row's window (the sliding ones')
    gathered = 2 * block * ((max_batch_size * per_row if cfg.n_layers > sliding else 0) + windows)
    return pool, gathered


@dataclass
class Option:
    config: dict  # the GenerationConfig fields this option sets
    kv_cache_bytes: int
    activation_bytes: int  # one forward's: the whole prompt, or a chunk of it (prefill_chunk_size)
    total_bytes: int  # weights + KV cache + activations
    fits: bool
    expected_loss_pct: float  # perplexity change the chapters measured for these settings
    source: list[str]  # where each loss was measured


@dataclass
class Plan:
    fits: bool  # whether some option fits the budget
    config: dict  # the chosen option's GenerationConfig fields ({}: the defaults)
    kv_cache_bytes: int
    weights_bytes: int
    activation_bytes: int  # the chosen option's
    total_bytes: int
    budget_bytes: int
    expected_loss_pct: float
    smallest_budget: int  # the least memory any option needs
    options: list[Option] = field(default_factory=list)  # every option, fitting ones first by loss
    # cache_chunk_size -> the chosen option paged: its KV bytes, and the token slots of its pool left
    # empty (the last block of each row), in bytes
    paged: dict[int, dict[str, int]] = field(default_factory=dict)
    # a model trained with sliding layers, the rows on its default cache: {"sliding_layers", "sliding_window",
    # "full_layers", "context"} (hybrid_rule); {} when no row holds the hybrid cache
    hybrid: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["options"] = [dict(o.__dict__) for o in self.options]
        return d


def options(cfg: ModelConfig, batch: int, context: int, dtype: str | torch.dtype = "float32",
            cache_chunk_size: int | None = None, room: int | None = None,
            compute: str | torch.dtype = "float32") -> list[tuple[dict, int, int, float, list[str]]]:
    """(config fields, KV bytes, activation bytes, expected loss %, sources) for every storage x
    window setting, each with the prompt whole, or else in the largest of PREFILL_CHUNKS whose KV
    and activations fit in `room` bytes (the smallest chunk when none does; None: always whole).

    A quantized cache keeps every token (the window is only a mask: minigen/combinations.py's APPLIED table), so
    quantization is not paired with a window; a window no shorter than the context changes nothing,
    and one larger than the model's own sliding window is refused (combinations.py), so not offered.
    A chunked prompt gives the same tokens (chapter 3), so chunking costs no quality, only some
    prefill speed: the whole prompt is offered wherever it fits."""
    out, own = [], cfg.own_window  # own: the model's sliding window, 0 when no layer slides
    for storage in KV_STORAGE:
        for window in WINDOWS:
            if window is not None and ("quant_bits" in storage or window + 4 >= context or 0 < own < window):
                continue
            fields = dict(storage, **({"window_size": window} if window else {}))
            if "quant_bits" in storage and cfg.head_dim % 32:  # groups of 32 (KIVI) must divide the head dim
                fields["quant_group_size"] = math.gcd(32, cfg.head_dim)
            if cache_chunk_size is not None:
                fields["cache_chunk_size"] = cache_chunk_size
            keys = [k if k == "kv_dtype" else f"{k}={v}" for k, v in fields.items()
                    if k not in ("cache_chunk_size", "quant_group_size")]
            loss = sum(QUALITY_LOSS[k][0] for k in keys)
            for chunk in (None, *(c for c in PREFILL_CHUNKS if c < context)):
                config = GenerationConfig(**fields, prefill_chunk_size=chunk)
                kv = kv_cache_bytes(cfg, config, batch, context, dtype)
                acts = activation_bytes(cfg, batch, context, compute, config)
                if room is None or kv + acts <= room:
                    break
            chunked = dict(fields, prefill_chunk_size=chunk) if chunk else fields
            out.append((chunked, kv, acts, loss, [QUALITY_LOSS[k][1] for k in keys]))
    return out


def plan(model: str | os.PathLike | ModelConfig | Model = "smollm2-135m", batch: int = 1, context: int = 2048,
         budget_bytes: int = 2**30, dtype: str | torch.dtype = "float32", compute: str | torch.dtype = "float32",
         cache_chunk_size: int | None = None) -> Plan:
    """The cache settings that fit `budget_bytes` for `batch` rows of `context` tokens, the one with
    the least expected quality loss first (ties: the fewest bytes)."""
    for name, value, low in (("batch", batch, 1), ("context", context, 1), ("budget_bytes", budget_bytes, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{name}={value!r} is invalid: use an integer >= {low}")
    cfg = model_config(model)
    if context > cfg.max_seq_len:
        raise ConfigError(f"context={context} is past the model's context of {cfg.max_seq_len} tokens: "
                          f"plan for at most {cfg.max_seq_len}")
    weights = weights_bytes(cfg, dtype)
    rows = [Option(fields, kv, acts, weights + kv + acts, weights + kv + acts <= budget_bytes, loss, src)
            for fields, kv, acts, loss, src in options(cfg, batch, context, dtype, cache_chunk_size,
                                                       budget_bytes - weights, compute)]
    rows.sort(key=lambda o: (not o.fits, o.expected_loss_pct if o.fits else o.total_bytes, o.total_bytes))
    # the least memory any option needs: each with the smallest prompt chunk (no room for a larger one)
    smallest = weights + min(kv + acts for _, kv, acts, _, _ in options(cfg, batch, context, dtype, cache_chunk_size,
                                                                         -1, compute))
    if budget_bytes < weights:
        raise ConfigError(f"budget_bytes={budget_bytes:,} is below the model's weights alone ({weights:,} bytes "
                          f"in {_dtype(dtype)}): no cache setting can fit. The smallest budget that could work "
                          f"is {smallest:,} bytes (weights + the smallest cache + activations), or load the "
                          "weights in bfloat16 or with weight_bits=8/4")
    best = rows[0]
    return Plan(fits=best.fits, config=best.config, kv_cache_bytes=best.kv_cache_bytes, weights_bytes=weights,
                activation_bytes=best.activation_bytes, total_bytes=best.total_bytes, budget_bytes=budget_bytes,
                expected_loss_pct=best.expected_loss_pct, smallest_budget=smallest, options=rows,
                paged=paged_waste(cfg, best.config, batch, context, dtype),
                hybrid=hybrid_rule(cfg, context) if cache_chunk_size is None else {})


def hybrid_rule(cfg: ModelConfig, context: int) -> dict[str, int]:
    """How the default cache of a model trained with sliding layers holds `context` positions per row:
    each sliding layer a ring of sliding_window slots, each full layer every position (caches/hybrid.py).
    {} for a model whose every layer is full."""
    if not cfg.sliding_layers:
        return {}
    return {"sliding_layers": cfg.sliding_layers, "sliding_window": cfg.sliding_window,
            "full_layers": cfg.n_layers - cfg.sliding_layers, "context": context}


def paged_waste(cfg: ModelConfig, fields: dict, batch: int, context: int,
                dtype: str | torch.dtype = "float32") -> dict[int, dict[str, int]]:
    """For each of PAGED_CHUNKS: the KV bytes of `fields` in a paged cache, and the bytes of the
    slots its pool holds past `context` (a pool sized to the context leaves only each row's last
    block partly empty). {} where the settings do not page (a quantized block must hold whole groups)."""
    out = {}
    for bs in PAGED_CHUNKS:
        group = fields.get("quant_group_size", GenerationConfig.quant_group_size)
        if fields.get("quant_bits") is not None and bs % group:  # the config would refuse it (combinations.py)
            continue
        config = GenerationConfig(**dict(fields, cache_chunk_size=bs))
        slots = batch * (math.ceil(context / bs) * bs - context)
        stub = _meta_model(cfg, dtype)
        block = make_cache(stub, config, 1, 2 * bs).nbytes - make_cache(stub, config, 1, bs).nbytes  # one block
        per_slot = block // bs
        out[bs] = {"kv_cache_bytes": kv_cache_bytes(cfg, config, batch, context, dtype),
                   "waste_bytes": slots * per_slot}
    return out


def oom_remedies(model: str | os.PathLike | ModelConfig | Model = "smollm2-135m", batch: int = 8,
                 context: int = 8192, cache_chunk_size: int = 256, smaller_chunk: int = 16,
                 max_length: int = 4096, dtype: str | torch.dtype = "float32") -> dict[str, int]:
    """Bytes each of the article's three out-of-memory remedies frees, from its own paged cache of
    `cache_chunk_size` tokens per block at `context` tokens: smaller chunks, 4-bit KV, capping the length."""
    cfg = model_config(model)
    base_config = GenerationConfig(cache_chunk_size=cache_chunk_size)
    base = kv_cache_bytes(cfg, base_config, batch, context, dtype)
    return {
        "baseline_bytes": base,
        f"cache_chunk_size={smaller_chunk}": base - kv_cache_bytes(
            cfg, base_config.replace(cache_chunk_size=smaller_chunk), batch, context, dtype),
        "quant_bits=4": base - kv_cache_bytes(cfg, base_config.replace(quant_bits=4), batch, context, dtype),
        f"max_length={max_length}": base - kv_cache_bytes(cfg, base_config, batch, min(context, max_length), dtype),
    }


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is invalid: use one of {', '.join(map(repr, DTYPES))}")
    return DTYPES[dtype]


def format_plan(p: Plan) -> str:
    """The answer, then every option: fits, loss, bytes."""
    mib = 2**20
    head = (f"{'fits' if p.fits else 'does NOT fit'}: {p.config or 'the defaults'} | KV cache "
            f"{p.kv_cache_bytes / mib:,.1f} MiB + weights {p.weights_bytes / mib:,.1f} MiB + activations "
            f"~{p.activation_bytes / mib:,.1f} MiB = {p.total_bytes / mib:,.1f} MiB of "
            f"{p.budget_bytes / mib:,.1f} MiB; "
            f"expected perplexity +{p.expected_loss_pct:.2f}%")
    lines = [head, "", f"{'fits':<5} {'loss %':>7} {'KV MiB':>10} {'acts MiB':>9} {'total MiB':>10}  config"]
    for o in p.options:
        lines.append(f"{'yes' if o.fits else 'no':<5} {o.expected_loss_pct:7.2f} {o.kv_cache_bytes / mib:10.1f} "
                     f"{o.activation_bytes / mib:9.1f} {o.total_bytes / mib:10.1f}  {o.config or '{} (full precision)'}")
    if p.hybrid:
        h = p.hybrid
        lines.append(f"hybrid (the model's own window): {h['sliding_layers']} sliding layers x {h['sliding_window']:,} "
                     f"+ {h['full_layers']} full layers x {h['context']:,} positions per row, in the rows without "
                     "quant_bits or window_size (those keep every position, or window every layer)")
    for bs, paged in p.paged.items():
        lines.append(f"paged (cache_chunk_size={bs}): KV {paged['kv_cache_bytes'] / mib:,.1f} MiB, of which "
                     f"{paged['waste_bytes'] / mib:,.2f} MiB empty slots in the rows' last blocks")
    if not p.fits:
        lines.append(f"\nnothing fits: the smallest option needs {p.smallest_budget:,} bytes")
    return "\n".join(lines)
