"""Compiling and capturing the decode step (chapter 8): `compile=True` and `cuda_graphs=True`.

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

The article's "enable graphs" names a torch function that does not exist; these are the real
mechanisms (torch.compile(mode="reduce-overhead") is torch.compile plus CUDA graphs).
"""

from __future__ import annotations

import time
import types
import weakref
from typing import Callable

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


class CudaGraphDecoder:
    """Replays a captured decode step + sampling for one batch size: tokens [B] -> next tokens [B].

    The step reads its token and position from fixed buffers and writes the next token into a
    fixed buffer; a call copies into the inputs, replays, and returns the output buffer (read it
    before the next call). The cache must be the contiguous cache or the ring buffer (static
    addresses, no host sync), which GenerationConfig ensures.
    """

    def __init__(self, step: Callable, sample: Callable, model, cache, policy, config, batch: int,
                 position: int, generators: list[torch.Generator] | None, ops=None):
        """step: eager.decode_step; sample: sampling.sample (passed in, so that this module
        stays below generate.py); generators: one per row (sampling.make_generators), None: greedy;
        ops: the ops the captured step runs (None: model.ops)."""
        if model.device.type != "cuda":
            raise ConfigError(f"cuda_graphs=True needs the model on a CUDA device, not {model.device}: "
                              "model.to('cuda'), or compile=True on a CPU")
        device = model.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1]
        self.pos = torch.tensor([position], device=device)  # [1]
        self.graph = torch.cuda.CUDAGraph()
        states = [g.get_state() for g in generators or ()]

        def one_step() -> Tensor:
            logits = step(model, self.tokens, self.pos, cache, policy, ops)
            return sample(logits, config, generators)  # [B]: row b's clocks from generator b

        # Warm up on a side stream (allocator pools, lazy inits), at the first real position: its
        # writes are rewritten by the first replay, so the cache ends as eager would leave it.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                one_step()
        torch.cuda.current_stream(device).wait_stream(side)
        # The warm-up drew noise: start the replays where eager would. Each row's generator is
        # registered with the graph, which then advances its offset at every replay, so a row
        # replays the draws it makes in eager mode, whatever the other rows draw.
        for g, state in zip(generators or (), states):
            g.set_state(state)
            self.graph.register_generator_state(g)
        with torch.cuda.graph(self.graph):
            self.next = one_step()

    def __call__(self, tokens: Tensor, position: int) -> Tensor:
        self.tokens.copy_(tokens[:, None])
        self.pos.fill_(position)
        self.graph.replay()
        return self.next


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
        if not self.first:
            return self.step(model, tokens, input_pos, cache, policy, ops)
        before, began = graphs_compiled(), time.perf_counter()
        logits = self.step(model, tokens, input_pos, cache, policy, ops)
        self.compile_s = time.perf_counter() - began if graphs_compiled() > before else 0.0
        self.first = False
        return logits


class GraphedStep(EagerStep):
    """cuda_graphs=True: the first decode step captures decode + sampling in a CUDA graph
    (CudaGraphDecoder), every later one replays it; `decode` then returns the sampled tokens [B]."""
    name = "graphed"
    samples_inside = True

    def __init__(self, sample: Callable, config, generators: list[torch.Generator] | None):
        self.sample, self.config, self.generators = sample, config, generators
        self.replay: CudaGraphDecoder | None = None
        self.compile_s = 0.0

    def decode(self, model, tokens: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
        position = int(input_pos[0])
        if self.replay is None:
            began = time.perf_counter()
            self.replay = CudaGraphDecoder(decode_step, self.sample, model, cache, policy, self.config,
                                           tokens.shape[0], position, self.generators, ops)
            self.compile_s = time.perf_counter() - began
        return self.replay(tokens[:, 0], position)
