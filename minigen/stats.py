"""What a generation measured, split by concern: its timing, its cache, and its speculation.

    stats.timing        prefill, TTFT, decode rate, each token's latency and their percentiles
    stats.cache         the KV cache's bytes (held, peak, on the device) and a paged cache's blocks
    stats.speculation   proposals, acceptances and the time each side took (chapter 13)
    stats.step, stats.plan   which step ran, and the plan in words (run_plan.py)

Each part is filled by the code that knows it: the loop times the tokens (generate.run_steps), the
cache reports its bytes (record_cache), a step its own numbers (step.report: the compile seconds of
a compiled step, a speculative step's counts). Every field is also read and written by its own name
on the stats (stats.ttft_s is stats.timing.ttft_s), the way the chapters print them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields


@dataclass
class Timing:
    prefill_s: float = 0.0  # seconds to run the prompt through the model
    ttft_s: float = 0.0  # seconds from the call to the first new token (prefill + sampling)
    decode_s: float = 0.0  # seconds for every token after the first, compile_s left out
    new_tokens: int = 0  # tokens generated per sequence (the longest one, when some stop early)
    decode_tokens_per_s: float = 0.0  # (new_tokens - 1) / decode_s, per sequence
    token_latencies_s: list[float] = field(default_factory=list)  # wall time of each new token
    # Percentiles of the decode tokens' latencies (every token after the first): jitter (chapter 11).
    latency_p50_s: float = 0.0
    latency_p90_s: float = 0.0
    latency_p99_s: float = 0.0
    compile_s: float = 0.0  # compile=True / cuda_graphs=True: seconds spent compiling or capturing (0: reused)


@dataclass
class CacheUse:
    """The cache's memory (caches/contract.py): keys and values plus everything the cache keeps to use
    them (scales and zeros, slot positions, block tables, gather buffers), on every tier."""
    kv_cache_bytes: int = 0  # bytes held at the end; a preallocated cache counts its whole allocation
    peak_kv_cache_bytes: int = 0  # the most bytes held at any moment, a step's short-lived tensors included
    kv_device_bytes: int = 0  # of kv_cache_bytes, the bytes on the model's device (less with an offload tier)
    kv_blocks_in_use: int | None = None  # paged cache: blocks held by the rows at the end; None: not paged
    kv_blocks_in_pool: int | None = None  # paged cache: blocks in the preallocated pool


@dataclass
class Speculation:
    """Speculative decoding (steps/speculative.py, chapter 13); all 0 without it."""
    draft_tokens: int = 0  # tokens proposed, over every row and round
    accepted_tokens: int = 0  # of those, the ones the target kept
    acceptance_rate: float = 0.0  # accepted_tokens / draft_tokens
    target_forwards: int = 0  # verify forwards, counted per row (the prompt's not included)
    mean_acceptance_length: float = 0.0  # tokens emitted per target forward, the bonus token included
    draft_s: float = 0.0  # seconds spent proposing (the draft model's forwards, the n-gram search)
    verify_s: float = 0.0  # seconds spent in the target's verify forwards and the acceptance rule


PARTS = {"timing": Timing, "cache": CacheUse, "speculation": Speculation}
OWNER = {f.name: part for part, cls in PARTS.items() for f in fields(cls)}  # field name -> the part that holds it


@dataclass
class GenerationStats:
    timing: Timing = field(default_factory=Timing)
    cache: CacheUse = field(default_factory=CacheUse)
    speculation: Speculation = field(default_factory=Speculation)
    step: str = ""  # the step that ran (steps/eager.py): "naive", "eager", "compiled", "graphed", "fused", "speculative ..."
    plan: str = ""  # what ran, in words: str(plan) of the generation's plan (run_plan.py)

    def __getattr__(self, name: str):  # called only for names the stats itself lacks: a part's field
        part = OWNER.get(name)
        if part is None:
            raise AttributeError(f"GenerationStats has no field {name!r}")
        return getattr(object.__getattribute__(self, part), name)

    def __setattr__(self, name: str, value) -> None:
        part = OWNER.get(name)
        if part is None:
            object.__setattr__(self, name, value)
        else:
            setattr(getattr(self, part), name, value)


def record_cache(stats: GenerationStats, cache) -> None:
    """The cache's bytes (and a paged cache's blocks) into stats.cache."""
    if cache is not None:
        use = stats.cache
        use.kv_cache_bytes, use.peak_kv_cache_bytes, use.kv_device_bytes = (cache.nbytes, cache.peak_nbytes,
                                                                            cache.device_nbytes)
        if cache.blocks is not None:
            use.kv_blocks_in_use, use.kv_blocks_in_pool = cache.blocks


def finish_timing(t: Timing, start: float) -> None:
    """The decode time, rate and latency percentiles from what the loop recorded (start: the call's
    perf_counter)."""
    t.decode_s = time.perf_counter() - start - t.ttft_s - t.compile_s
    if t.new_tokens > 1 and t.decode_s > 0:
        t.decode_tokens_per_s = (t.new_tokens - 1) / t.decode_s
    # the percentiles of decode steps as they run: a step that compiled or captured is left out
    decode = sorted(t.token_latencies_s[2 if t.compile_s > 0 else 1:])
    if decode:
        t.latency_p50_s, t.latency_p90_s, t.latency_p99_s = (
            decode[min(len(decode) - 1, int(q * len(decode)))] for q in (0.5, 0.9, 0.99))
