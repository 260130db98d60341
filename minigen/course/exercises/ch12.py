"""Chapter 12 exercises: a decode step on the roofline.

1. `decode_intensity(cfg, batch, context, weight_bytes, kv_bytes)`: FLOPs per byte of one decode step of
   `batch` sequences, each attending `context` cached positions. FLOPs: `batch x cfg.forward_flops(1,
   context)`. Bytes: every weight the step streams once (`roofline.streamed_params(cfg)` parameters at
   `weight_bytes` each) plus each row's keys and values (`cfg.kv_bytes_per_token(kv_bytes)` per position).
2. `predict_tokens_per_s(ceiling, cfg, batch, context)`: the roofline's bound on the tokens per second of
   that step with 2-byte weights and cache (all rows together): the step takes the longer of its
   FLOPs at `ceiling.peak_flops` and its bytes at `ceiling.bandwidth`.
"""

from __future__ import annotations

from ...model import ModelConfig
from ...measure.roofline import A100_80GB, GPUS, SHAPES, Ceiling, decode_point, streamed_params, tokens_per_s
from . import compare, known_mistake


# ---------------------------------------------------------------- worked solutions
def solution_decode_intensity(cfg: ModelConfig, batch: int, context: int, weight_bytes: float = 2,
                              kv_bytes: float = 2) -> float:
    """The batch shares one read of the weights; each row reads its own keys and values."""
    flops = batch * cfg.forward_flops(1, context)
    nbytes = streamed_params(cfg) * weight_bytes + batch * context * cfg.kv_bytes_per_token(kv_bytes)
    return flops / nbytes


def solution_predict_tokens_per_s(ceiling: Ceiling, cfg: ModelConfig, batch: int, context: int) -> float:
    flops = batch * cfg.forward_flops(1, context)
    nbytes = streamed_params(cfg) * 2 + batch * context * cfg.kv_bytes_per_token(2)
    return batch / max(flops / ceiling.peak_flops, nbytes / ceiling.bandwidth)


# ---------------------------------------------------------------- the cases
CASES = [(name, b, n, wb, kb) for name in ("SmolLM2-135M", "Llama-2-7B", "Llama-2-70B")
         for b, n, wb, kb in ((1, 1024, 2, 2), (8, 2048, 2, 2), (64, 512, 0.5, 1))]


def _intensity_hints(args: tuple, got) -> str:
    cfg, b, n, wb, kb = args
    flops = b * cfg.forward_flops(1, n)
    weights, kv = streamed_params(cfg) * wb, b * n * cfg.kv_bytes_per_token(kb)
    return known_mistake(round(got, 9), [(round(v, 9), hint) for v, hint in (
        (flops / b / (weights + kv), "a step computes batch x forward_flops(1, context): one token per row"),
        (flops / (b * weights + kv), "the weights are read once for the whole batch, not once per row"),
        (flops / weights, "the step also reads every row's keys and values"),
        (flops / (weights + kv / b), "each row reads its own keys and values: multiply them by the batch"),
        (b * 2 * streamed_params(cfg) / (weights + kv),
         "forward_flops counts attention over the context and the output head; 2 x params leaves out attention"),
    ) if b > 1 or "batch" not in hint])


def check_decode_intensity(fn) -> bool:
    """fn(cfg, batch, context, weight_bytes, kv_bytes) -> FLOP/byte, as roofline.decode_point computes it."""
    cases = [(f"{name}, batch {b}, context {n}, {wb}-byte weights, {kb}-byte KV", (SHAPES[name], b, n, wb, kb),
              decode_point(SHAPES[name], b, n, wb, kb).intensity) for name, b, n, wb, kb in CASES]
    return compare("decode_intensity", cases, fn, _intensity_hints, rel_tol=1e-6)


def _rate_hints(args: tuple, got) -> str:
    ceiling, cfg, b, n = args
    point = decode_point(cfg, b, n)
    return known_mistake(round(got, 3), [
        (round(tokens_per_s(ceiling, point) / b, 3), "tokens/s counts every row of the batch: multiply by batch"),
        (round(b * ceiling.bandwidth / point.bytes, 3), "at a large batch the step can be bound by compute: take the "
                                                        "longer of the two times"),
        (round(b / (point.flops / ceiling.peak_flops + point.bytes / ceiling.bandwidth), 3),
         "the roofline overlaps compute and memory: the step takes the longer one, not their sum"),
    ])


def check_predict_tokens_per_s(fn) -> bool:
    """fn(ceiling, cfg, batch, context) -> tokens/s, as roofline.tokens_per_s(ceiling, decode_point(...))."""
    cases = [(f"{g.name}, {name}, batch {b}, context {n}", (g, SHAPES[name], b, n),
              tokens_per_s(g, decode_point(SHAPES[name], b, n)))
             for g in GPUS for name in ("Llama-2-7B", "Llama-2-70B") for b, n in ((1, 2048), (256, 128))]
    cases.append(("A100-80GB, SmolLM2-135M, batch 512, context 64", (A100_80GB, SHAPES["SmolLM2-135M"], 512, 64),
                  tokens_per_s(A100_80GB, decode_point(SHAPES["SmolLM2-135M"], 512, 64))))
    return compare("predict_tokens_per_s", cases, fn, _rate_hints, rel_tol=1e-6)
