"""The memory planner: which cache settings fit a memory budget, cheapest in quality first.

    plan(model, batch, context, budget_bytes) ─> weights + KV cache + activations for each setting
                                              ─> the settings that fit, ranked by expected quality loss

The KV bytes of a setting are exact, not a formula to keep in step with the caches: `make_cache`
builds the cache the config selects on PyTorch's "meta" device (shapes, no memory), and its
`nbytes` is what `generate` reports in `stats.kv_cache_bytes` (a paged cache adds the buffer it
gathers blocks into, counted here). The weights are counted the same way, on a meta `Model`.
The activations are an estimate: the largest tensors alive in one layer of the prefill.

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
from ..model import Model, ModelConfig
from ..numerics.precision import DTYPES

# setting -> (expected perplexity change in %, where it was measured), SmolLM2-135M
QUALITY_LOSS = {
    "kv_dtype": (0.2, "chapter 07: a 16-bit KV cache kept perplexity within 0.2% of fp32's (512 tokens)"),
    "quant_bits=8": (0.0, "chapter 04: 8-bit keys per channel, +0.00% perplexity (600 tokens)"),
    "quant_bits=4": (0.32, "chapter 04: 4-bit keys per channel, 32-token window, +0.32% perplexity (600 tokens)"),
    "window_size=256": (7.0, "chapter 05: window 256 + 4 sinks, 1.07x perplexity (1,200 tokens)"),
    "window_size=128": (11.0, "chapter 05: window 128 + 4 sinks, 1.11x perplexity (1,200 tokens)"),
    "window_size=64": (26.0, "chapter 05: window 64 + 4 sinks, 1.26x perplexity (1,200 tokens)"),
}
KV_STORAGE = [{}, {"kv_dtype": "bfloat16"}, {"kv_dtype": "float16"}, {"quant_bits": 8}, {"quant_bits": 4}]
PAGED_CHUNKS = (16, 256)  # vLLM's default block size, and the article's cache_chunk_size
WINDOWS = [None, 256, 128, 64]


def model_config(model: str | os.PathLike | ModelConfig | Model) -> ModelConfig:
    """A ModelConfig from a config, a model, or a name that `load` takes (only config.json is read)."""
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
    stub = _meta_model(cfg, dtype)
    cache = make_cache(stub, config, batch, context)
    held = cache.nbytes
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
    """Blocks in a paged cache's gather buffer at the end of a generation: the prefill's blocks, then
    grown by doubling whenever a decode step's rows hold more (blocks outside a window are freed)."""
    bs, window, sinks = config.cache_chunk_size, config.window_size, config.sink_tokens
    size = 0
    # the prefill writes [0, prompt_len); decode step i writes position prompt_len + i, up to context - 2
    for start, end in [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, context - 1)]:
        freed = 0
        if window is not None:  # block j is freed when all of it is past the sinks and out of the window:
            # j * bs >= sinks and start - (j * bs + bs - 1) >= window (attention.in_window)
            freed = max(0, (start - window - bs + 1) // bs - math.ceil(sinks / bs) + 1)
        need = batch * (math.ceil(end / bs) - freed)
        if need > size:
            size = max(need, 2 * size)
    return size


def activation_bytes(cfg: ModelConfig, batch: int, context: int, compute: str | torch.dtype = "float32") -> int:
    """An estimate of the largest activations alive at once: one layer of a prefill of `context`
    tokens (generate prefills the prompt in one pass). Per token: the residual and the normed input,
    q/k/v, and the MLP's gate, up, silu(gate) and their product; the causal mask [T, S], fp32 and
    bool, shared by the rows; the last position's logits. CPU SDPA does not materialize the
    [B, H, T, S] scores. Checked once on SmolLM2 at 3,000 tokens, batch 1 (2-core CPU): a
    generation added 275 MiB of peak memory, 132 MiB of it the cache; this estimates 138 MiB."""
    T, e = context, _dtype(compute).itemsize
    per_token = 2 * cfg.dim + (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + 4 * cfg.hidden_dim
    return batch * T * per_token * e + T * T * (4 + 1) + batch * cfg.vocab_size * 4


@dataclass
class Option:
    config: dict  # the GenerationConfig fields this option sets
    kv_cache_bytes: int
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
    activation_bytes: int
    total_bytes: int
    budget_bytes: int
    expected_loss_pct: float
    smallest_budget: int  # the least memory any option needs
    options: list[Option] = field(default_factory=list)  # every option, fitting ones first by loss
    # cache_chunk_size -> the chosen option paged: its KV bytes, and the token slots of its pool left
    # empty (the last block of each row), in bytes
    paged: dict[int, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["options"] = [dict(o.__dict__) for o in self.options]
        return d


def options(cfg: ModelConfig, batch: int, context: int, dtype: str | torch.dtype = "float32",
            cache_chunk_size: int | None = None) -> list[tuple[dict, int, float, list[str]]]:
    """(config fields, KV bytes, expected loss %, sources) for every storage x window setting.

    A quantized cache keeps every token (the window is only a mask: config.py's APPLIED table), so
    quantization is not paired with a window; a window no shorter than the context changes nothing."""
    out = []
    for storage in KV_STORAGE:
        for window in WINDOWS:
            if window is not None and ("quant_bits" in storage or window + 4 >= context):
                continue
            fields = dict(storage, **({"window_size": window} if window else {}))
            if "quant_bits" in storage and cfg.head_dim % 32:  # groups of 32 (KIVI) must divide the head dim
                fields["quant_group_size"] = math.gcd(32, cfg.head_dim)
            if cache_chunk_size is not None:
                fields["cache_chunk_size"] = cache_chunk_size
            keys = [k if k == "kv_dtype" else f"{k}={v}" for k, v in fields.items()
                    if k not in ("cache_chunk_size", "quant_group_size")]
            loss = sum(QUALITY_LOSS[k][0] for k in keys)
            kv = kv_cache_bytes(cfg, GenerationConfig(**fields), batch, context, dtype)
            out.append((fields, kv, loss, [QUALITY_LOSS[k][1] for k in keys]))
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
    acts = activation_bytes(cfg, batch, context, compute)
    rows = [Option(fields, kv, weights + kv + acts, weights + kv + acts <= budget_bytes, loss, src)
            for fields, kv, loss, src in options(cfg, batch, context, dtype, cache_chunk_size)]
    rows.sort(key=lambda o: (not o.fits, o.expected_loss_pct if o.fits else o.total_bytes, o.total_bytes))
    smallest = min(o.total_bytes for o in rows)
    if budget_bytes < weights:
        raise ConfigError(f"budget_bytes={budget_bytes:,} is below the model's weights alone ({weights:,} bytes "
                          f"in {_dtype(dtype)}): no cache setting can fit. The smallest budget that could work "
                          f"is {smallest:,} bytes (weights + the smallest cache + activations), or load the "
                          "weights in bfloat16 or with weight_bits=8/4")
    best = rows[0]
    return Plan(fits=best.fits, config=best.config, kv_cache_bytes=best.kv_cache_bytes, weights_bytes=weights,
                activation_bytes=acts, total_bytes=best.total_bytes, budget_bytes=budget_bytes,
                expected_loss_pct=best.expected_loss_pct, smallest_budget=smallest, options=rows,
                paged=paged_waste(cfg, best.config, batch, context, dtype))


def paged_waste(cfg: ModelConfig, fields: dict, batch: int, context: int,
                dtype: str | torch.dtype = "float32") -> dict[int, dict[str, int]]:
    """For each of PAGED_CHUNKS: the KV bytes of `fields` in a paged cache, and the bytes of the
    slots its pool holds past `context` (a pool sized to the context leaves only each row's last
    block partly empty). {} where the settings do not page (a quantized block must hold whole groups)."""
    out = {}
    for bs in PAGED_CHUNKS:
        config = GenerationConfig(**dict(fields, cache_chunk_size=bs))
        if config.quant_bits is not None and bs % config.quant_group_size:
            continue
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
    lines = [head, "", f"{'fits':<5} {'loss %':>7} {'KV MiB':>10} {'total MiB':>10}  config"]
    for o in p.options:
        lines.append(f"{'yes' if o.fits else 'no':<5} {o.expected_loss_pct:7.2f} {o.kv_cache_bytes / mib:10.1f} "
                     f"{o.total_bytes / mib:10.1f}  {o.config or '{} (full precision)'}")
    for bs, paged in p.paged.items():
        lines.append(f"paged (cache_chunk_size={bs}): KV {paged['kv_cache_bytes'] / mib:,.1f} MiB, of which "
                     f"{paged['waste_bytes'] / mib:,.2f} MiB empty slots in the rows' last blocks")
    if not p.fits:
        lines.append(f"\nnothing fits: the smallest option needs {p.smallest_budget:,} bytes")
    return "\n".join(lines)
