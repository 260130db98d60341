"""The hybrid cache measured: its bytes against the count, and its decode speed against a
uniform cache on the same model.

Shapes: L layers (Lf full, Ls sliding), Hkv key/value heads, Dh head dim, S slots a layer reads.

A model trained with sliding layers (Gemma 3: five sliding layers of 512 tokens to one full layer)
needs, per sequence of `context` tokens,

    (Ls x min(window, context) + Lf x context) x 2 (K and V) x Hkv x Dh x bytes

of cache: what `HybridKVCache` (caches/hybrid.py) holds, beside the uniform cache's L x context.
`cache_bytes` checks the first against the count. A decode step reads every weight once plus each
layer's slots, so the hybrid cache should be no slower than a uniform cache whose sliding layers
mask the same window: faster where attention reads every slot it is given (torch's SDPA, a GPU's
kernels), about as fast where it skips the masked ones (minigen's C attention). `decode_speed`
measures both on one random-weight model, the same keys in both caches, steps in turns on a shared
machine, with the roofline of each beside it (bench.bytes_per_decode_step's weights + slots_read).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass

import torch

from ..caches.contiguous import KVCache
from ..caches.make import make_cache
from ..config import GenerationConfig
from ..errors import BenchError
from ..kernels import build as kernel_build
from ..kernels import dispatch
from ..model import Model
from ..checkpoints.model_config import ModelConfig
from ..numerics.precision import Precision
from ..run_plan import make_plan
from .bench import bytes_per_decode_step
from .machine import memory_read_bandwidth

# Gemma-3-270M's shapes (its config.json: hidden_size 640, 18 layers, 4 heads of 256, 1 KV head,
# intermediate 2048, vocab 262,144, sliding_window 512, every sixth layer full), as a Llama-family
# model: the Gemma 3 architecture's extra norms and scalings change no cache byte and few FLOPs.
GEMMA3_270M = ModelConfig(
    arch="llama", vocab_size=262144, dim=640, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256,
    hidden_dim=2048, max_seq_len=32768, norm_eps=1e-6, tie_embeddings=True,
    layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)),
    sliding_window=512)
TOLERANCE = 0.05  # the bound on |hybrid bytes / count - 1|


@dataclass
class _Shapes:
    """What make_cache reads of a model (config, dtype, device): the caches' bytes need no weights."""
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")


def counted_bytes(cfg: ModelConfig, context: int, bytes_per_element: int) -> int:
    """Keys and values the hybrid rule holds for `context` tokens: each layer at its own size."""
    positions = sum(cfg.kv_positions(layer, context) for layer in range(cfg.n_layers))
    return positions * 2 * cfg.n_kv_heads * cfg.head_dim * bytes_per_element


def cache_bytes(cfg: ModelConfig = GEMMA3_270M, contexts: tuple[int, ...] = (256, 1024, 4096, 8192, 32768),
                dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> list[dict]:
    """For each dtype and context: the default cache's nbytes (make_cache: the hybrid cache), the
    count, their ratio, and the uniform cache's nbytes (the same model with every layer full).
    Allocations are zeros that are never touched, so even 32,768 tokens cost no resident memory.
    A context shorter than the window is measured as it is: the ring keeps `sliding_window` slots
    whatever the context (caches/hybrid.py), more than the count's min(window, context)."""
    if not cfg.sliding_layers:
        raise BenchError("cache_bytes compares the hybrid cache with a uniform one: give a ModelConfig with "
                         "sliding layers (layer_types, sliding_window)")
    uniform_cfg = dataclasses.replace(cfg, layer_types=None, sliding_window=None)
    rows = []
    for dtype in dtypes:
        for context in contexts:
            hybrid = make_cache(_Shapes(cfg, dtype), GenerationConfig(), 1, context)
            uniform = make_cache(_Shapes(uniform_cfg, dtype), GenerationConfig(), 1, context)
            count = counted_bytes(cfg, context, dtype.itemsize)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "context": context,
                         "cache": type(hybrid).__name__, "hybrid_nbytes": hybrid.nbytes, "count_bytes": count,
                         "hybrid_over_count": hybrid.nbytes / count,
                         "within_tolerance": abs(hybrid.nbytes / count - 1) <= TOLERANCE,
                         "uniform_nbytes": uniform.nbytes, "hybrid_share_of_uniform": hybrid.nbytes / uniform.nbytes})
    return rows


# ---------------------------------------------------------------- decode speed
def random_model(cfg: ModelConfig, seed: int = 0) -> Model:
    """A seeded fp32 model of `cfg`'s shapes, set up as loading.build_model sets up a checkpoint's:
    weights N(0, 0.02) (transformers' init), norms 1, CPU precision, the kernels' dispatch."""
    model = Model(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights 1, biases 0
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model = model.eval()
    model.precision = Precision.default(torch.float32, "cpu")
    dispatch.install(model)
    return model


def fill(cache, cfg: ModelConfig, context: int, seed: int) -> None:
    """Write positions 0..context-1 of seeded random keys and values into every layer, through the
    cache contract (reserve, prepare, then update per layer): the hybrid cache's rings keep the last window."""
    g = torch.Generator().manual_seed(seed)
    cache.reserve(torch.arange(context))
    cache.prepare(torch.arange(context))
    for layer in range(cfg.n_layers):
        k = torch.randn(1, cfg.n_kv_heads, context, cfg.head_dim, generator=g)  # [B, Hkv, T, Dh]
        v = torch.randn(1, cfg.n_kv_heads, context, cfg.head_dim, generator=g)
        cache.update(layer, k, v)


def slots_read(cfg: ModelConfig, slots: int, seen: int, hybrid: bool, skips_masked: bool) -> int:
    """Slots one decode step's attention reads over all layers: caches of `slots` slots per full
    layer, a query that sees `seen` positions. torch's SDPA reads every slot it is given, masked or
    not: all `slots` of a full layer, and of a sliding one in a uniform cache, the ring in the
    hybrid cache. minigen's C attention (kernels/csrc/attend.c) skips a slot whose mask is -inf,
    keys and values: it reads the positions seen, and of a sliding layer the window alone, in
    either cache."""
    total = 0
    for layer in range(cfg.n_layers):
        window = cfg.window_of(layer)
        if window is None:
            total += seen if skips_masked else slots
        elif hybrid or skips_masked:
            total += min(window, seen)  # the ring (the window), or the window's slots alone
        else:
            total += slots
    return total


def decode_speed(cfg: ModelConfig = GEMMA3_270M, context: int = 4096, steps: int = 96, seed: int = 0,
                 threads: int | None = None, kernels: bool = True, model: Model | None = None,
                 memory_read_gb_s: float | None = None) -> dict:
    """Decode tok/s of one model with the hybrid cache ("hybrid") and with a uniform KVCache of every
    position in every layer ("uniform"; the sliding layers still mask to their window).

    Both caches hold the same random keys at positions 0..context-1 (`fill`); a first step at
    `context` must give the same logits through both (else the comparison is void: BenchError),
    and warms both up. Then `steps` pairs of decode steps, hybrid then uniform (A B A B ...), at
    the same positions and tokens, through one step object (the eager step: the fused one refuses
    sliding models); the context runs from `context` to context + steps. On a shared machine a
    busy spell lasts longer than a step, so it falls on both steps of a pair: each pair's ratio,
    then their median, is the speed ratio, and each cache's tok/s is 1 / its median step time.
    kernels=False runs torch's own ops (kernels.build.enabled(False)): SDPA then reads every slot of
    the uniform cache, as a GPU's attention does, where the C kernel skips the masked ones. The
    roofline divides memory_read_gb_s (default: machine.py's probe, after the runs) by the bytes
    each step reads (slots_read).
    """
    with kernel_build.enabled(kernels):
        return _decode_speed(cfg, context, steps, seed, threads, model, memory_read_gb_s)


def _decode_speed(cfg: ModelConfig, context: int, steps: int, seed: int, threads: int | None, model: Model | None,
                  memory_read_gb_s: float | None) -> dict:
    if not cfg.sliding_layers:
        raise BenchError("decode_speed compares the hybrid cache with a uniform one: give a ModelConfig with "
                         "sliding layers (layer_types, sliding_window)")
    if steps < 1 or context < 1:
        raise BenchError(f"context={context}, steps={steps}: each must be >= 1")
    if threads is not None:
        torch.set_num_threads(threads)
    max_len = context + 1 + steps
    if max_len > cfg.max_seq_len:
        raise BenchError(f"context {context} + {1 + steps} decode steps exceeds the model's context of "
                         f"{cfg.max_seq_len}: lower context or steps")
    model = model or random_model(cfg, seed)
    config = GenerationConfig(fused_decode=False)
    caches = {"hybrid": make_cache(model, config, 1, max_len), "uniform": KVCache.for_model(model, 1, max_len)}
    for cache in caches.values():
        fill(cache, cfg, context, seed + 1)  # the same keys and values in both
    step = make_plan(model, config, 1, max_len=max_len).step
    skips_masked = kernel_build.available()  # attention runs in C (cpu.attend_decode takes fp32 on a CPU)
    g = torch.Generator().manual_seed(seed + 2)
    tokens = torch.randint(0, cfg.vocab_size, (1 + steps, 1, 1), generator=g)  # [N, B, 1]
    load_before = os.getloadavg()
    seconds = {name: [] for name in caches}
    with step.grad_mode():
        first = {name: step.decode(model, tokens[0], torch.tensor([context]), cache) for name, cache in caches.items()}
        diff = (first["hybrid"] - first["uniform"]).abs().max().item()
        scale = first["uniform"].abs().max().item()
        if not diff <= 1e-4 * max(scale, 1.0):  # attention sums its slots in another order: rounding only
            raise BenchError(f"the hybrid and uniform caches give different logits at position {context} "
                             f"(max diff {diff:.3g}, logits up to {scale:.3g}): they do not hold the same window")
        for n in range(1, 1 + steps):
            for name, cache in caches.items():  # hybrid, uniform, hybrid, uniform, ...
                t = time.perf_counter()
                step.decode(model, tokens[n], torch.tensor([context + n]), cache)
                seconds[name].append(time.perf_counter() - t)
    load_after = os.getloadavg()
    bandwidth = 1e9 * (memory_read_gb_s or memory_read_bandwidth())  # bytes/s
    weights = bytes_per_decode_step(model, 0)  # every weight once (a tied head: all of the embedding)
    seen = context + 1 + steps // 2  # positions the middle step's query sees
    per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * model.dtype.itemsize  # K and V of one position, one layer
    result = {"context": context, "context_end": context + steps, "cache_slots": max_len, "steps": steps,
              "threads": torch.get_num_threads(), "step": step.name, "ops": kernel_build.status(),
              "attention_skips_masked_slots": skips_masked, "first_step_max_logit_diff": diff,
              "load_average_before": load_before, "load_average_after": load_after,
              "memory_read_gb_s": bandwidth / 1e9, "weight_bytes_per_step": weights, "caches": {}}
    for name, cache in caches.items():
        times = seconds[name]
        read = weights + slots_read(cfg, max_len, seen, name == "hybrid", skips_masked) * per_slot
        result["caches"][name] = {
            "cache": type(cache).__name__, "nbytes": cache.nbytes, "step_seconds": times,
            "tokens_per_s": 1 / statistics.median(times),
            "step_ms_quartiles": [1e3 * q for q in statistics.quantiles(times, n=4)] if len(times) > 1 else None,
            "bytes_read_per_step": read, "roofline_tokens_per_s": bandwidth / read}
    ratios = [u / h for h, u in zip(seconds["hybrid"], seconds["uniform"])]  # hybrid speed / uniform speed
    result["pair_speed_ratio_median"] = statistics.median(ratios)
    result["pair_speed_ratio_quartiles"] = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else None
    result["pairs_hybrid_faster"] = sum(r > 1 for r in ratios) / len(ratios)
    result["roofline_ratio"] = (result["caches"]["uniform"]["bytes_read_per_step"]
                                / result["caches"]["hybrid"]["bytes_read_per_step"])
    return result
