"""Compiling and capturing the decode step (chapter 11): `compile=True` and `cuda_graphs=True`.

Shapes: B batch, V vocabulary.

At batch 1 a decode step of a small model launches hundreds of small ops, and each costs its
dispatch (Python, the dispatcher, a kernel launch) more than its arithmetic. Two ways remove that:

- torch.compile traces the step once into a graph, fuses the small ops into a few generated
  kernels (inductor: C++ on a CPU, Triton on a GPU), and replays the graph while its guards hold.
  `compiled(step, model)` compiles once per model, with fullgraph=True, so a host sync or a
  Python list in the step is an error, not a silent graph break.
- A CUDA graph records the kernels one step launches, with their addresses, and replays them with
  one launch. It needs static shapes, static addresses (inputs copied into fixed buffers) and no
  host sync, so sampling happens inside the graph: the exponential race (sampling.sample) draws
  the next token with tensor ops only. One graph per batch size. CUDA only.

Under a graph the GPU's part of a small model's token is tens of microseconds, so anything the host
does per token (sampling, a stop check read back, a position tensor built, Python bookkeeping)
becomes the step's time. The graph therefore holds the whole loop body: the step, sampling, the
stop check (a finished row repeats its stop token), the token's place in a chunk buffer and the
position's advance, all in fixed device buffers (CudaGraphDecoder). The host replays the graph
STOP_CHECK_EVERY times, then reads one small status tensor (tokens emitted, every row finished):
one host read per STOP_CHECK_EVERY tokens, none between (tests/test_host_work.py counts them).
The tokens are the eager loop's, cut where it would stop; up to STOP_CHECK_EVERY - 1 replays past
the last row's stop run and are discarded.

The article's "enable graphs" names a torch function that does not exist; these are the real
mechanisms (torch.compile(mode="reduce-overhead") is torch.compile plus CUDA graphs).
"""

from __future__ import annotations

import time
import types
import weakref
from typing import Callable, Iterator

import torch
from torch import Tensor

from ..errors import ConfigError
from .eager import EagerStep, decode_step

_compiled: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def compiled(step: Callable, model) -> Callable:
    """`step` (eager.decode_step) compiled for `model`, made once and reused by every call: no
    recompile while the shapes stay (the same batch size, kind of cache and policy)."""
    per_model = _compiled.setdefault(model, {})
    if step not in per_model:
        # dynamo keeps its graphs on the function's code object, at most 8 (recompile_limit), and
        # with fullgraph=True a ninth is a hard error. A process that compiles the step for several
        # models (fp32, bf16, int8, int4; caches in two dtypes) would share those 8 slots: give
        # each model a copy of the step's code, so that each has its own.
        own = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__,
                                 step.__defaults__, step.__closure__)
        own.__kwdefaults__, own.__doc__ = step.__kwdefaults__, step.__doc__
        per_model[step] = torch.compile(own, fullgraph=True, dynamic=False)
    return per_model[step]


# Decode steps the device runs between two host reads of its stop flags: the host reads once per
# STOP_CHECK_EVERY tokens, and runs at most STOP_CHECK_EVERY - 1 steps past the last row's stop.
STOP_CHECK_EVERY = 16


def require_cuda(model) -> None:
    """Raise ConfigError unless `model` sits on a CUDA device (a CUDA graph records CUDA kernels only)."""
    if model.device.type != "cuda":
        raise ConfigError(f"cuda_graphs=True needs the model on a CUDA device, not {model.device}: "
                          "model.to('cuda'), or compile=True on a CPU")


def capture(graph: "torch.cuda.CUDAGraph", fn: Callable[[], None]) -> None:
    """Record the kernels `fn` launches into `graph` (they do not run now; each replay runs them)."""
    with torch.cuda.graph(graph):
        fn()


class CudaGraphDecoder:
    """One captured decode step for one batch size, with everything the loop does per token inside
    the graph: the step, sampling, the stop check and the position's advance. No host sync.

    Every replay reads and writes fixed buffers only (a replay runs the kernels at the addresses
    they were captured with):

        tokens [B, 1]    the token each row feeds; the replay writes the next one here
        pos [1]          its position, advanced by 1 by each replay (rows in lockstep)
        finished [B]     rows that have produced a stop token; their later tokens are `pad`
        out [B, N]       the tokens of the current chunk, column `slot` written by each replay
        slot [1]         the column of `out` the next replay writes, mod N (N = STOP_CHECK_EVERY)
        status [2]       [tokens emitted since `start`, counted while some row was unfinished
                          before it; 1 when every row has finished]: the one tensor the host reads
        next [B]         the newest token (what `GraphedStep.decode` returns)

    The cache must be the contiguous cache or the ring buffer (static addresses, no host sync),
    which GenerationConfig ensures. Row b samples from generator b, registered with the graph,
    which advances its offset at every replay: a row replays the draws it makes in eager mode.
    """

    def __init__(self, step: Callable, sample: Callable, model, cache, policy, config, batch: int,
                 generators: list[torch.Generator] | None, stop_ids: Tensor, pad: int, first: tuple, ops=None):
        """step: eager.decode_step; sample: sampling.sample (passed in, so that this module stays
        below generate.py); generators: one per row (sampling.make_generators), None: greedy;
        first: (tokens [B], position [1], finished [B]) of the first replay, where warm-up runs;
        ops: the ops the captured step runs (None: model.ops)."""
        require_cuda(model)
        device, N = model.device, STOP_CHECK_EVERY
        long = dict(dtype=torch.long, device=device)
        self.tokens, self.pos = torch.zeros(batch, 1, **long), torch.zeros(1, **long)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.out, self.slot = torch.zeros(batch, N, **long), torch.zeros(1, **long)
        self.status, self.next = torch.zeros(2, **long), torch.zeros(batch, **long)
        self.graph = torch.cuda.CUDAGraph()
        states = [g.get_state() for g in generators or ()]

        def one_step() -> None:
            logits = step(model, self.tokens, self.pos, cache, policy, ops)
            token = sample(logits, config, generators)  # [B]: row b's clocks from generator b
            token = torch.where(self.finished, pad, token)  # a finished row repeats its stop token
            self.status[0].add_((~self.finished).any().long())  # emitted while some row was live
            self.finished.logical_or_((token[:, None] == stop_ids).any(dim=-1))  # elementwise: no size-based branch
            self.status[1].copy_(self.finished.all())
            self.out.index_copy_(1, self.slot, token[:, None])
            self.slot.add_(1).remainder_(N)
            self.tokens.copy_(token[:, None])
            self.next.copy_(token)
            self.pos.add_(1)

        # Warm up on a side stream (allocator pools, lazy inits), twice at the first real position:
        # its writes are rewritten by the first replay, so the cache ends as eager would leave it.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.start(*first)
                one_step()
        torch.cuda.current_stream(device).wait_stream(side)
        # The warm-up drew noise: start the replays where eager would.
        for g, state in zip(generators or (), states):
            g.set_state(state)
            self.graph.register_generator_state(g)
        capture(self.graph, one_step)

    def start(self, tokens: Tensor, position: Tensor, finished: Tensor | None = None) -> None:
        """Set the buffers for the next replay: tokens [B] at position [1] (a device tensor: no
        sync), finished [B] (None: no row has finished); the chunk and the status start at 0."""
        self.tokens.copy_(tokens[:, None])
        self.pos.copy_(position.reshape(1))
        if finished is None:
            self.finished.zero_()
        else:
            self.finished.copy_(finished)
        self.slot.zero_()
        self.status.zero_()

    def run(self, steps: int) -> Iterator[list[Tensor]]:
        """Replay up to `steps` decode steps after `start`, yielding each chunk's tokens [B] (device
        tensors) once the host has read its status: the only host read, one per STOP_CHECK_EVERY
        replays. Stops after the token at which every row has finished, as the eager loop does:
        a chunk is cut there, and the replays after it are discarded."""
        emitted = done = 0
        while done < steps:
            k = min(STOP_CHECK_EVERY, steps - done)
            for _ in range(k):
                self.graph.replay()
            done += k
            chunk = self.out[:, :k].clone()  # the next chunk's replays write `out` again
            total, all_finished = self.status.tolist()  # the one host read of these k steps
            new, emitted = total - emitted, total
            yield list(chunk[:, :new].unbind(1))
            if all_finished or new < k:
                return


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process (dynamo's own counter)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


class CompiledStep(EagerStep):
    """compile=True: the prompt runs eagerly, each decode step through `compiled(decode_step, model)`.
    compile_s: the seconds the first step spent compiling (0 when an earlier generation compiled it)."""
    name = "compiled"

    def __init__(self, model):
        self.step = compiled(decode_step, model)
        self.compile_s, self.first = 0.0, True

    def grad_mode(self):
        # under inference_mode inductor copied every layer's cache each step; under no_grad it writes in place
        return torch.no_grad()

    def decode(self, model, tokens: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
        # the model's own ops go in as None, as a direct call of the compiled step passes them: one guard, one graph
        ops = None if ops is model.ops else ops
        if not self.first:
            return self.step(model, tokens, input_pos, cache, policy, ops)
        before, began = graphs_compiled(), time.perf_counter()
        logits = self.step(model, tokens, input_pos, cache, policy, ops)
        self.compile_s = time.perf_counter() - began if graphs_compiled() > before else 0.0
        self.first = False
        return logits


class GraphedStep(EagerStep):
    """cuda_graphs=True: decode + sampling + stop checks captured in one CUDA graph (CudaGraphDecoder).
    `decode_loop` runs every token after the first on the device, with no host sync between two
    stop checks; `decode` replays one step and returns the sampled tokens [B]."""
    name = "graphed"
    samples_inside = True
    loops_on_device = True

    def __init__(self, sample: Callable, config, generators: list[torch.Generator] | None):
        self.sample, self.config, self.generators = sample, config, generators
        self.replay: CudaGraphDecoder | None = None
        self.compile_s = 0.0

    def _capture(self, model, cache, policy, stop_ids: Tensor, pad: int, first: tuple, ops=None) -> CudaGraphDecoder:
        if self.replay is None:
            began = time.perf_counter()
            self.replay = CudaGraphDecoder(decode_step, self.sample, model, cache, policy, self.config,
                                           first[0].shape[0], self.generators, stop_ids, pad, first, ops)
            self.compile_s = time.perf_counter() - began
        return self.replay

    def decode_loop(self, model, tokens: Tensor, position: Tensor, finished: Tensor, cache, policy,
                    steps: int, stop_ids: Tensor, pad: int, ops=None) -> Iterator[list[Tensor]]:
        """The decode after the first token: tokens [B] (the first, a finished row's already `pad`)
        at position [1], rows in lockstep (each replay advances it by 1). Yields lists of next tokens
        [B], one list per stop check (STOP_CHECK_EVERY tokens, the last list cut after the token at
        which every row has finished): first an empty list once the graph is captured, so that a
        caller timing the chunks leaves the capture out. Tokens equal the eager loop's."""
        replay = self._capture(model, cache, policy, stop_ids, pad, (tokens, position, finished), ops)
        replay.start(tokens, position, finished)
        yield []
        yield from replay.run(steps)

    def decode(self, model, tokens: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
        no_stop = torch.zeros(0, dtype=torch.long, device=tokens.device)
        replay = self._capture(model, cache, policy, no_stop, 0, (tokens[:, 0], input_pos, None), ops)
        replay.start(tokens[:, 0], input_pos)
        replay.graph.replay()
        return replay.next
