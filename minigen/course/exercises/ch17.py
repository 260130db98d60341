"""Chapter 17 exercises: put a decode step on the roofline yourself.

1. `decode_step(cfg, batch, context, weight_bytes, kv_bytes) -> (flops, nbytes)`: the roofline point of
   one decode step of `batch` sequences, each with `context` positions already cached: the FLOPs the
   step does and the bytes it must read from memory, weights stored at `weight_bytes` per parameter
   and keys and values at `kv_bytes` per value. Your tools, each for ONE sequence or one position:
   `cfg.forward_flops(new_tokens, context)` (the FLOPs of one sequence's forward), `roofline.streamed_params(cfg)`
   (the parameters a forward reads from memory) and `cfg.kv_bytes_per_token(kv_bytes)` (the bytes of
   one cached position's keys and values, every layer). Chapter 17, section 2 says what a step shares
   across its batch and what it does not.
2. `bound_tokens_per_s(ceiling, flops, nbytes, batch)`: the most tokens per second (all rows together)
   that a machine with `ceiling.peak_flops` FLOP/s and `ceiling.bandwidth` bytes/s allows such a step.

The checkers compare your answers with `roofline.decode_point` and `roofline.tokens_per_s`, with those
functions patched to raise: your code must do the counting.
"""

from __future__ import annotations

from ...checkpoints.model_config import ModelConfig
from ...measure.roofline import (A100_80GB, GPUS, SHAPES, Ceiling, decode_point, streamed_params, tokens_per_s)
from . import ExerciseFailed, forbidding, known_mistake


# ---------------------------------------------------------------- worked solutions
def solution_decode_step(cfg: ModelConfig, batch: int, context: int, weight_bytes: float = 2,
                         kv_bytes: float = 2) -> tuple[float, float]:
    """The batch shares one read of the weights; each row reads its own keys and values."""
    flops = batch * cfg.forward_flops(1, context)
    nbytes = streamed_params(cfg) * weight_bytes + batch * context * cfg.kv_bytes_per_token(kv_bytes)
    return flops, nbytes


def solution_bound_tokens_per_s(ceiling: Ceiling, flops: float, nbytes: float, batch: int) -> float:
    """The step takes the longer of its compute and its reads; it yields one token per row."""
    return batch / max(flops / ceiling.peak_flops, nbytes / ceiling.bandwidth)


# ---------------------------------------------------------------- the cases
CASES = [(name, b, n, wb, kb) for name in ("SmolLM2-135M", "Llama-2-7B", "Llama-2-70B")
         for b, n, wb, kb in ((1, 1024, 2, 2), (8, 2048, 2, 2), (64, 512, 0.5, 1))]
FORBIDDEN = (decode_point, tokens_per_s, Ceiling.step_seconds, Ceiling.attainable)


def _close(got, want, rel_tol=1e-6) -> bool:
    try:
        return abs(float(got) - float(want)) <= rel_tol * abs(float(want))
    except (TypeError, ValueError):
        return False


def _point_hints(args: tuple, got: tuple) -> str:
    cfg, b, n, wb, kb = args
    flops = b * cfg.forward_flops(1, n)
    weights, kv = streamed_params(cfg) * wb, b * n * cfg.kv_bytes_per_token(kb)
    f, nb = got
    hints = []
    if _close(f, flops / b) and b > 1:
        hints.append("a step computes one new token for every row: the batch multiplies the FLOPs")
    if _close(f, b * 2 * streamed_params(cfg)) or _close(f, b * 2 * (streamed_params(cfg) + n * cfg.dim)):
        hints.append("forward_flops(1, context) counts attention over the context and the output head")
    if _close(f, b * cfg.forward_flops(n, n)) or _close(f, b * cfg.forward_flops(1, 1)):
        hints.append("a decode step runs ONE new token per row, attending `context` cached positions: "
                     "forward_flops(1, context)")
    hints.append(known_mistake(True, [(_close(nb, b * weights + kv) and b > 1,
                                       "the weights are read once for the whole batch, not once per row"),
                                      (_close(nb, weights), "the step also reads every row's keys and values"),
                                      (_close(nb, weights + kv / b) and b > 1,
                                       "each row reads its own keys and values: the batch multiplies them"),
                                      (_close(nb, streamed_params(cfg) * wb + b * n * cfg.kv_bytes_per_token(wb))
                                       and wb != kb, "the cache is stored at kv_bytes a value, the weights at "
                                                     "weight_bytes"),
                                      (_close(nb, weights + b * n * cfg.kv_bytes_per_token(kb) * 2),
                                       "kv_bytes_per_token already counts keys and values")]))
    return "; or ".join(h for h in hints if h)


def check_decode_step(fn) -> bool:
    """fn(cfg, batch, context, weight_bytes, kv_bytes) -> (flops, nbytes), as roofline.decode_point counts them."""
    worked = fn is solution_decode_step
    cases = [(f"{name}, batch {b}, context {n:,}, {wb}-byte weights, {kb}-byte KV", (SHAPES[name], b, n, wb, kb),
              decode_point(SHAPES[name], b, n, wb, kb)) for name, b, n, wb, kb in CASES]
    answers = []
    with forbidding(*FORBIDDEN, *([] if worked else [solution_decode_step])):
        for _, args, _ in cases:
            answers.append(fn(*args))
    for (label, args, want), got in zip(cases, answers):
        if not (isinstance(got, tuple) and len(got) == 2):
            raise ExerciseFailed(f"decode_step: for {label} return a pair (flops, nbytes), not {got!r}")
        if not (_close(got[0], want.flops) and _close(got[1], want.bytes)):
            hint = _point_hints(args, got)
            raise ExerciseFailed(f"decode_step: for {label} expected ({want.flops:,.0f} FLOP, {want.bytes:,.0f} "
                                 f"bytes), got ({got[0]:,.0f}, {got[1]:,.0f})" + (f". Hint: {hint}" if hint else ""))
    print(f"✓ decode_step: all {len(cases)} roofline points agree with roofline.decode_point"
          + (" (the worked solution: yours is not checked yet)" if worked else ""))
    return True


def _rate_hints(args: tuple, got) -> str:
    g, flops, nbytes, b = args
    compute, memory = flops / g.peak_flops, nbytes / g.bandwidth
    return known_mistake(True, [
        (_close(got, 1 / max(compute, memory)) and b > 1, "tokens/s counts every row of the batch: one token a "
                                                          "row a step"),
        (_close(got, b / memory) and compute > memory, "at a large batch the step can be bound by compute: take "
                                                       "the longer of the two times"),
        (_close(got, b / compute) and memory > compute, "at a small batch the step waits on memory: take the "
                                                        "longer of the two times"),
        (_close(got, b / (compute + memory)), "the roofline overlaps compute and memory: the step takes the "
                                              "longer one, not their sum"),
        (_close(got, b / min(compute, memory)), "the slower of compute and memory sets the step's time: max, "
                                                "not min"),
    ])


def check_bound_tokens_per_s(fn) -> bool:
    """fn(ceiling, flops, nbytes, batch) -> tokens/s, as roofline.tokens_per_s bounds a decode point."""
    worked = fn is solution_bound_tokens_per_s
    shapes = [(g, name, b, n) for g in GPUS for name in ("Llama-2-7B", "Llama-2-70B") for b, n in ((1, 2048), (256, 128))]
    shapes.append((A100_80GB, "SmolLM2-135M", 512, 64))
    cases = []
    for g, name, b, n in shapes:
        p = decode_point(SHAPES[name], b, n)
        cases.append((f"{g.name}, {name}, batch {b}, context {n:,}", (g, p.flops, p.bytes, b), tokens_per_s(g, p)))
    answers = []
    with forbidding(*FORBIDDEN, *([] if worked else [solution_bound_tokens_per_s])):
        for _, args, _ in cases:
            answers.append(fn(*args))
    for (label, args, want), got in zip(cases, answers):
        if not _close(got, want):
            hint = _rate_hints(args, got) if got is not None else ""
            raise ExerciseFailed(f"bound_tokens_per_s: for {label} expected {want:,.1f} tokens/s, got {got!r}"
                                 + (f". Hint: {hint}" if hint else ""))
    print(f"✓ bound_tokens_per_s: all {len(cases)} cases agree with roofline.tokens_per_s"
          + (" (the worked solution: yours is not checked yet)" if worked else ""))
    return True
