"""Generation over N tensor-parallel ranks from one call, measured (chapter 16; `minigen generate --tp N`).

    out = generate_over_ranks("smollm2-135m", ids, GenerationConfig(max_new_tokens=32), tp_size=3)
    out.tokens                     # [B, T + n]: every rank's, which must agree
    out.ranks[0]["all_reduces"]    # rank 0's decode steps: all-reduces, bytes and seconds

A spawned rank unpickles the function it runs by importing its module, so a function defined in a
notebook cell cannot be one; `rank_generate` is the module-level worker that run_ranks (group.py)
starts in each rank. It loads the rank's shard (minigen.load(..., tp_size=N): every rank reads the
checkpoint and keeps its heads), streams the generation, and reports what the chapter compares with
its predictions: the decode steps' all-reduces (count, bytes, seconds: `CommMeter`), the decode rate,
and the rank's memory (its parameters, its KV cache, the process's peak resident set).

CommMeter wraps torch.distributed.all_reduce in the rank's own process while a generation runs, and
puts it back after: tensor.py's hooks call it through the module, so each call is counted and timed
where it happens. A rank's all-reduce time includes waiting for the slowest rank to arrive.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import GenerationConfig
from ..errors import RankError
from ..generate import stream
from ..loading import load, read_config, resolve_folder
from .tensor import check_tp_size
from ..stats import GenerationStats
from .group import run_ranks

RANKS_TIMEOUT_S = 600.0  # what one generation over ranks may take, loads included


@dataclass
class CommMeter:
    """The all-reduces a process runs while `watching`: how many, their bytes, their wall time."""
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.count, self.bytes, self.seconds = 0, 0, 0.0

    @contextlib.contextmanager
    def watching(self) -> Iterator["CommMeter"]:
        """Count and time every torch.distributed.all_reduce of this process until the block ends."""
        plain = dist.all_reduce

        def timed(tensor: Tensor, *args, **kwargs):
            start = time.perf_counter()
            out = plain(tensor, *args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.count += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return out
        dist.all_reduce = timed
        try:
            yield self
        finally:
            dist.all_reduce = plain


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rank_generate(rank: int, tp_size: int, model_name: str, input_ids: Tensor, config: dict,
                  load_options: dict) -> dict:
    """One rank: load its shard, generate `input_ids` [B, T] under `config` (a GenerationConfig's dict),
    and report its tokens [B, T + n], stats, plan and measurements (module docstring)."""
    model, tokenizer = load(model_name, tp_size=tp_size, **load_options)
    config = GenerationConfig.from_dict(config)
    stats, meter, new = GenerationStats(), CommMeter(), []
    with meter.watching():
        for token in stream(model, input_ids, config, stats=stats, tokenizer=tokenizer):
            if not new:  # the prompt's forward is done: from here on, decode steps only
                prompt_reduces = (meter.count, meter.bytes, meter.seconds)
                meter.reset()
            new.append(token)
    steps = max(len(new) - 1, 0)  # decode steps that ran (the first token comes from the prompt's forward)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"rank": rank, "tokens": torch.cat([input_ids, torch.stack(new, dim=1)], dim=1) if new else input_ids,
            "plan": stats.plan, "step": stats.step, "decode_tokens_per_s": stats.decode_tokens_per_s,
            "new_tokens": len(new), "decode_s": sum(stats.token_latencies_s[1:]), "decode_steps": steps,
            "all_reduces": {"count": meter.count, "bytes": meter.bytes, "seconds": meter.seconds},
            "prompt_all_reduces": dict(zip(("count", "bytes", "seconds"), prompt_reduces)) if new else None,
            "param_bytes": params, "kv_cache_bytes": stats.kv_cache_bytes, "peak_rss_bytes": peak_rss_bytes(),
            "n_heads": model.config.n_heads, "n_kv_heads": model.config.n_kv_heads,
            "hidden_dim": model.config.hidden_dim}


@dataclass
class RanksOutput:
    tokens: Tensor  # [B, T + n]: rank 0's (generate_over_ranks checks that every rank's are the same)
    ranks: list[dict] = field(default_factory=list)  # each rank's report (rank_generate)


def generate_over_ranks(model_name: str, input_ids: Tensor, config: GenerationConfig, tp_size: int, *,
                        dtype: str = "float32", weight_bits: int | None = None,
                        timeout: float = RANKS_TIMEOUT_S) -> RanksOutput:
    """Start `tp_size` gloo ranks on 127.0.0.1, each generating with its shard of `model_name`, and
    return their tokens and reports; RankError when a rank fails or the ranks disagree. A tp_size that
    does not split the model is refused (ConfigError) before any rank starts. Sampling without a seed
    draws one here, for every rank (each rank samples its own copy of the same logits)."""
    check_tp_size(read_config(resolve_folder(model_name)), tp_size)
    if config.do_sample and config.seed is None:  # one seed for every rank, drawn here: each rank samples alike
        config = config.replace(seed=int(torch.randint(0, 2**63 - 1, ()).item()))
    reports = run_ranks(rank_generate, tp_size, args=(model_name, input_ids, config.to_dict(),
                                                      {"dtype": dtype, "weight_bits": weight_bits}), timeout=timeout)
    for report in reports[1:]:
        if not torch.equal(report["tokens"], reports[0]["tokens"]):
            raise RankError(f"rank {report['rank']} of {tp_size} generated other tokens than rank 0: the ranks must "
                            "sample alike (the same seed, the same logits after each all-reduce)")
    return RanksOutput(reports[0]["tokens"], reports)


def ranks_line(out: RanksOutput) -> str:
    """`minigen generate --tp N`'s summary: tokens, the decode rate, the all-reduces' share of a decode
    step, and each rank's cache and peak memory (rank 0's; every rank holds the same share)."""
    r, n = out.ranks[0], len(out.ranks)
    steps = max(r["decode_steps"], 1)
    comm_ms = r["all_reduces"]["seconds"] / steps * 1e3
    share = r["all_reduces"]["seconds"] / r["decode_s"] if r["decode_s"] else 0.0
    return (f"[{r['new_tokens']} tokens | tensor parallel over {n} "
            f"ranks (gloo, 127.0.0.1) | decode {r['decode_tokens_per_s']:.1f} tok/s | {r['all_reduces']['count'] // steps} "
            f"all-reduces a token, {comm_ms:.2f} ms ({share:.0%} of a step) | a rank: {r['param_bytes'] / 2**20:.0f} MiB "
            f"of weights, KV cache {r['kv_cache_bytes'] / 2**20:.2f} MiB, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB | "
            f"{r['step']} step]")
