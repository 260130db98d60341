"""Pipeline parallelism (GPipe, Huang et al. 2019, run for inference): a model's layers split over N ranks.

Shapes: B batch, T prompt tokens, n new tokens, D model width, V vocabulary, L layers, N stages
(n_stages), m micro-batches of b rows each (b = B/m, the first B mod m of them one row more).

Stage r holds layers r L/N, ..., (r+1) L/N - 1 and the KV cache of those layers only. Stage 0
embeds; the last stage applies the final norm and the head, and samples. Activations [b, T, D]
(a prompt) or [b, 1, D] (a decode step) go from stage to stage by point-to-point send/recv, and
each new token [b] goes from the last stage back to stage 0, which embeds it for the next step:

    stage 0:     tokens -> embed -> blocks 0 .. L/N-1      -> send x to stage 1
    stage r:     recv x ->          its L/N blocks         -> send x to stage r+1
    stage N-1:   recv x ->          its blocks -> norm, head -> sample -> send tokens to stage 0

With one micro-batch (m = 1) each stage waits while the others work: a step costs N stage-times and
each stage is idle (N-1)/N of it, the pipeline's "bubble". Split the batch into m micro-batches and
they follow each other round the ring: stage 0 embeds micro-batch 1 while stage 1 runs micro-batch 0,
and micro-batch 0's next token comes back by the time stage 0 has sent micro-batch m-1 (m >= N).
N = 2, two steps, numbers = micro-batch, "." = waiting:

    m = 1   stage 0: 0 . 0 . 0 .          m = 2   stage 0: 0 1 0 1 0 1
            stage 1: . 0 . 0 . 0                  stage 1: . 0 1 0 1 0 1

Every micro-batch meets exactly the ops one process runs on its rows, and row r samples from its
own generator seeded seed + r (sampling.make_generators): the tokens equal one process's for any m.
Unlike vLLM, nothing ends early: every stage runs max_new_tokens steps (a stop needs every stage to
know of it), finished rows are fed their stop token as one process feeds them, and the tokens are
cut where one process would have stopped. StageTimes measures each stage's work and waits, and
`bubble` turns them into busy fractions and tokens per second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..caches.contiguous import KVCache
from ..config import GenerationConfig, resolve_config
from ..errors import ConfigError
from ..generate import check_prompt
from ..kernels import build
from .. import loading  # the module, not its names: loading imports parallel/ itself
from ..model import Model
from ..sampling import make_generators, sample

# The settings a pipeline runs: the sampler's and stop_token_ids. fused_decode is a step kind the
# pipeline has no use for (its stages run the eager forward), so it is ignored; any other setting
# away from its default is refused rather than silently not applied.
PIPELINE_SETTINGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "seed",
                     "stop_token_ids", "fused_decode")


# ---------------------------------------------------------------- which layers a stage holds
def check_stages(n_layers: int, n_stages: int) -> None:
    """ConfigError, naming the sizes and the stage counts that work, unless `n_stages` divides `n_layers`.
    An uneven split would work as well, but its slowest stage sets the pace: equal stages keep the
    measured bubble the schedule's alone."""
    if not isinstance(n_stages, int) or isinstance(n_stages, bool) or n_stages < 1:
        raise ConfigError(f"n_stages={n_stages!r} is invalid: the number of pipeline stages, a positive int")
    if n_layers % n_stages:
        works = [n for n in range(1, n_layers + 1) if n_layers % n == 0]
        raise ConfigError(f"n_stages={n_stages} does not divide this model's {n_layers} layers: every stage "
                          f"holds an equal share. n_stages that work: {', '.join(map(str, works))}")


def stage_layers(n_layers: int, stage: int, n_stages: int) -> range:
    """The layers stage `stage` of `n_stages` holds: stage L/N, ..., (stage+1) L/N - 1."""
    check_stages(n_layers, n_stages)
    if not 0 <= stage < n_stages:
        raise ConfigError(f"stage={stage} is not one of the {n_stages} stages 0..{n_stages - 1}")
    per = n_layers // n_stages
    return range(stage * per, (stage + 1) * per)


def micro_batch_rows(batch: int, micro_batches: int) -> list[slice]:
    """The rows of each of `micro_batches` micro-batches of a batch of `batch` rows, in order, as even
    as they split (sizes differ by one at most); ConfigError unless 1 <= micro_batches <= batch."""
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or not 1 <= micro_batches <= batch:
        raise ConfigError(f"micro_batches={micro_batches!r} is invalid: a batch of {batch} rows splits into "
                          f"1 to {batch} micro-batches")
    bounds = [len(part) for part in torch.arange(batch).tensor_split(micro_batches)]
    starts = [sum(bounds[:j]) for j in range(micro_batches)]
    return [slice(start, start + size) for start, size in zip(starts, bounds)]


@dataclass
class Stage:
    """One stage of a pipeline: `model` holds this stage's blocks only (config.n_layers of them,
    renumbered from 0, so its cache has those layers alone), the embedding where it embeds or its
    head is tied, and the head on the last stage."""
    model: Model
    index: int  # this stage, 0 .. n_stages-1
    n_stages: int
    layers: range  # the whole model's layers it holds

    first = property(lambda self: self.index == 0, doc="Whether this stage embeds the tokens.")
    last = property(lambda self: self.index == self.n_stages - 1, doc="Whether this stage samples.")


def make_stage(model: Model, stage: int, n_stages: int) -> Stage:
    """Cut `model` (the whole model, in place) down to stage `stage` of `n_stages` -> Stage. The other
    stages' blocks are dropped (freed once nothing else holds them); so is the embedding on a stage
    that neither embeds nor (tied) uses it as the head, and the head on every stage but the last."""
    cfg = model.config
    layers = stage_layers(cfg.n_layers, stage, n_stages)
    first, last = stage == 0, stage == n_stages - 1
    blocks = [model.blocks[i] for i in layers]
    for local, block in enumerate(blocks):
        block.attn.layer = local  # the stage's cache holds its layers as 0 .. L/N-1
    model.blocks = nn.ModuleList(blocks)
    if not first and not (last and model.lm_head is None):
        model.embed = nothing_of(model.embed)
    if not last and model.lm_head is not None:
        model.lm_head = nothing_of(model.lm_head)
    types = cfg.layer_types[layers.start:layers.stop] if cfg.layer_types is not None else None
    model.config = dataclasses.replace(cfg, n_layers=len(layers), layer_types=types)
    model.weight_copies = model.weight_copies.emptied()  # copies of the whole model's weights
    return Stage(model, stage, n_stages, layers)


def nothing_of(w: Tensor) -> nn.Parameter:
    """An empty [0, D] parameter in place of w [V, D]: the model keeps its dtype and device, not its numbers."""
    return nn.Parameter(w.new_empty(0, w.shape[-1]), requires_grad=False)


def stage_of(model: Model, n_stages: int) -> Stage:
    """make_stage for this process's rank of torch.distributed's group, which must have n_stages ranks
    (one process alone, without a group, is the whole model as stage 0 of 1)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != n_stages:
        raise ConfigError(f"n_stages={n_stages}, but {world} processes run: start one per stage with "
                          "minigen.parallel.run_ranks (or torchrun)")
    return make_stage(model, dist.get_rank() if dist.is_initialized() else 0, n_stages)


# ---------------------------------------------------------------- what a stage measures
@dataclass
class StageTimes:
    """One stage's clock over a generation, in seconds of time.perf_counter (CLOCK_MONOTONIC on Linux:
    one clock for every process of the machine, so that stages' times compare)."""
    stage: int
    work: list[tuple[int, int, float, float]] = dataclasses.field(default_factory=list)  # (step, micro-batch,
    # start, end) of each piece of work: the embedding, the blocks, the head and sampling; step 0 is the prompt
    wait_s: float = 0.0  # blocked in recv: its input was not there yet (the bubble, and the transfer)
    compute_s: float = 0.0  # the sum of work's durations

    def as_dict(self) -> dict:
        """Numbers and a tensor only, as run_ranks returns a rank's answer."""
        return {"stage": self.stage, "work": torch.tensor(self.work, dtype=torch.float64).reshape(-1, 4),
                "wait_s": self.wait_s, "compute_s": self.compute_s}


def bubble(times: list[dict], rows: int, from_step: int = 1) -> dict:
    """Each stage's busy fraction over the decode steps, from every stage's StageTimes.as_dict():
    the window runs from the first stage's first work of step `from_step` to the last stage's last;
    a stage is busy for the sum of its work there. -> {"busy": [per stage], "window_s", "tok_per_s"}
    (rows x decode steps / window)."""
    works = [t["work"][t["work"][:, 0] >= from_step] for t in times]
    if any(len(w) == 0 for w in works):
        raise ValueError(f"no work of step {from_step} or later to measure: generate at least {from_step + 1} "
                         "new tokens (step 0 is the prompt)")
    start = min(float(w[:, 2].min()) for w in works)
    end = max(float(w[:, 3].max()) for w in works)
    steps = int(works[-1][:, 0].max()) - from_step + 1
    busy = [float((w[:, 3] - w[:, 2]).sum()) / (end - start) for w in works]
    return {"busy": busy, "window_s": end - start, "tok_per_s": rows * steps / (end - start)}


# ---------------------------------------------------------------- the generation
@dataclass
class PipelineOutput:
    tokens: Tensor  # [B, T + n]: the prompt then the new tokens, on every stage alike
    times: StageTimes  # this stage's
    logits: Tensor | None = None  # [B, n, V] the logits each new token was sampled from (the last stage, logits=True)


def check_settings(config: GenerationConfig) -> None:
    """ConfigError naming every setting away from its default that a pipeline does not run."""
    default = GenerationConfig()
    other = [f"{name}={getattr(config, name)!r}" for name in GenerationConfig.field_names()
             if name not in PIPELINE_SETTINGS and getattr(config, name) != getattr(default, name)]
    if other:
        raise ConfigError(f"pipeline_generate runs greedy or sampled decoding ({', '.join(PIPELINE_SETTINGS[:-1])}) "
                          f"and nothing else: drop {', '.join(other)}, or generate in one process")


def pipeline_generate(stage: Stage, input_ids: Tensor, micro_batches: int = 1, config: GenerationConfig | None = None,
                      logits: bool = False, **overrides) -> PipelineOutput:
    """Generate after input_ids [B, T] on this process's `stage` (every stage calls it with the same
    arguments, in a group of stage.n_stages ranks) -> PipelineOutput: the tokens [B, T + n], equal on
    every stage and to one process's generate; this stage's times; with logits=True, on the last stage,
    the logits [B, n, V] of each sampled token. The batch runs as `micro_batches` micro-batches."""
    config = resolve_config(config, overrides)
    check_settings(config)
    model, B, T, n = stage.model, input_ids.shape[0], input_ids.shape[1], config.max_new_tokens
    check_prompt(model, input_ids, n, config)
    device = model.device  # gloo sends CPU tensors, NCCL CUDA ones: every buffer lives beside the weights
    input_ids = input_ids.to(device)
    parts = micro_batch_rows(B, micro_batches)
    caches = [KVCache.for_model(model, p.stop - p.start, T + n) for p in parts]  # this stage's layers only
    stop_list = config.stop_token_ids if config.stop_token_ids is not None else model.config.eos_token_ids
    pad = stop_list[0] if stop_list else 0  # a finished row is fed its stop token, as generate does
    stop_ids = torch.tensor(stop_list, dtype=torch.long, device=device)
    generators = make_generators(config, B, device) if stage.last else None
    new = torch.full((B, n), pad, dtype=torch.long, device=device)  # [B, n] the new tokens (the last stage's)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    kept = torch.zeros(B, n, model.config.vocab_size, device=device) if logits and stage.last else None
    times, pending = StageTimes(stage.index), []  # pending: sends not yet known to be done
    before, after = (stage.index - 1) % stage.n_stages, (stage.index + 1) % stage.n_stages
    if dist.is_initialized():
        dist.barrier()  # every stage starts its clock together
    with torch.inference_mode():
        for i in range(n):  # step 0: the prompt; step i: the token of step i - 1
            input_pos = torch.arange(T, device=device) if i == 0 else torch.tensor([T + i - 1], device=device)
            for j, rows in enumerate(parts):
                b, t0 = rows.stop - rows.start, time.perf_counter()
                if stage.first and i == 0:
                    x = input_ids[rows]  # [b, T] tokens
                elif stage.first and stage.last:  # one stage: its own tokens of the last step
                    x = new[rows, i - 1:i]
                elif stage.first:  # the last stage's tokens of the last step
                    x = received(torch.empty(b, dtype=torch.long, device=device), before, j)[:, None]  # [b, 1]
                else:  # the stage before's activations
                    x = received(torch.empty(b, len(input_pos), model.config.dim, dtype=model.precision.compute,
                                             device=device), before, j)  # [b, T or 1, D]
                t1 = time.perf_counter()
                if stage.first:
                    x = model.embed_tokens(x, input_pos)  # [b, T or 1, D]
                x = model.run_blocks(x, input_pos, caches[j])
                if stage.last:  # the logits of the last position, and each row's next token
                    step_logits = model.logits_of(x[:, -1:])[:, -1]  # [b, V]
                    token = sample(step_logits, config, generators[rows] if generators is not None else None)
                    token = torch.where(finished[rows], pad, token)  # [b]
                    finished[rows] |= torch.isin(token, stop_ids)
                    new[rows, i] = token
                    if kept is not None:
                        kept[rows, i] = step_logits
                t2 = time.perf_counter()
                times.work.append((i, j, t1, t2))
                times.wait_s, times.compute_s = times.wait_s + t1 - t0, times.compute_s + t2 - t1
                if stage.n_stages > 1 and not stage.last:
                    pending.append(dist.isend(x.contiguous(), after, tag=j))
                elif stage.n_stages > 1 and i < n - 1:  # the token goes back to stage 0 for the next step
                    pending.append(dist.isend(token, after, tag=j))
                pending = [w for w in pending if not w.is_completed()]
        for w in pending:
            w.wait()
    if dist.is_initialized():
        dist.broadcast(new, src=stage.n_stages - 1)  # every stage returns the same tokens
    done = steps_until_stopped(new, stop_ids)  # where one process's loop would have ended
    return PipelineOutput(torch.cat((input_ids, new[:, :done]), dim=1), times,
                          kept[:, :done] if kept is not None else None)


def received(buffer: Tensor, source: int, tag: int) -> Tensor:
    """`buffer` filled by the next message from rank `source` with `tag` (blocks until it arrives)."""
    dist.irecv(buffer, source, tag=tag).wait()
    return buffer


def steps_until_stopped(new: Tensor, stop_ids: Tensor) -> int:
    """The steps that generate's loop runs on the new tokens [B, n]: up to the first step after which
    every row has produced a stop token, else all n."""
    stopped = torch.isin(new, stop_ids).cummax(dim=1).values.all(dim=0)  # [n]: every row stopped by step i
    return int(stopped.nonzero()[0, 0]) + 1 if bool(stopped.any()) else new.shape[1]


# ---------------------------------------------------------------- a rank's work, for run_ranks
def pipeline_worker(rank: int, n_stages: int, source, input_ids: Tensor, micro_batches: int = 1,
                    config: GenerationConfig | dict | None = None, logits: bool = False,
                    torch_ops: bool = False) -> dict:
    """What each rank runs: run_ranks(pipeline_worker, N, args=(source, ids, m, config)) (a notebook's
    own function cannot be pickled into a spawned rank; this module's can). `source`: a model name or
    folder for minigen.load, or (ModelConfig, a Hugging Face state dict) for loading.build_model.
    torch_ops: torch's own ops instead of minigen's C kernels (the tests' reference runs them too).
    -> {"tokens" [B, T+n], "times": StageTimes.as_dict(), "logits": [B, n, V] or None, "layers": (first, end)}."""
    with build.enabled(False) if torch_ops else contextlib.nullcontext():
        model = loading.build_model(*source) if isinstance(source, tuple) else loading.load(source)[0]
        stage = make_stage(model, rank, n_stages)
        out = pipeline_generate(stage, input_ids, micro_batches, config, logits=logits)
    return {"tokens": out.tokens, "times": out.times.as_dict(), "logits": out.logits,
            "layers": (stage.layers.start, stage.layers.stop)}
