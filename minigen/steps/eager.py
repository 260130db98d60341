"""The steps that drive the model: a prompt's forward (prefill) and a decode step, as free functions,
and the step objects that generate's one loop runs (chapters 1-2).

Shapes: B batch, T prompt tokens, V vocabulary.

A step object says how each forward of a generation runs; the loop (generate.py) picks one per
generation (steps/choose.py) and never branches on the kind again:

    NaiveStep    use_cache=False: every step runs the whole sequence so far (chapter 1)
    EagerStep    the cached loop: the prompt once, then one token per step (chapter 2)
    CompiledStep compile=True: the decode step compiled by torch.compile (graphs.py, chapter 11)
    GraphedStep  cuda_graphs=True: the decode step captured in a CUDA graph, sampling inside (graphs.py)
    FusedStep    fused_decode: every layer of a decode token in one C call (fused.py, chapter 10)
    SpeculativeStep  speculative_method: propose k tokens, verify them in one forward (speculative.py, chapter 13)

Each has `prefill(model, ids, input_pos, cache, policy, ops=None) -> logits [B, V]` (the last position)
and `decode(model, tokens [B, 1], input_pos, cache, policy, ops=None) -> logits [B, V]`, a `name` for
reports, and `compile_s`, the seconds its first step spent compiling or capturing (0 for most). `ops`
are the ops the model's forward runs (Model.forward): the plan's, configured with the prompt format
and the attention backend (run_plan.py); None: model.ops. Before each forward a step calls
`cache.reserve(input_pos)` (the blocks it writes, contract.py), unless its caller owns the blocks
(`reserves = False`: the serving engine's scheduler reserves them).
"""

from __future__ import annotations

import torch
from torch import Tensor


def forward(model, tokens: Tensor, input_pos: Tensor, cache, policy=None, last_only: bool = False,
            reserve: bool = True, ops=None) -> Tensor:
    """One forward at input_pos ([T], or [B, T] per row) -> logits [B, T, V] ([B, 1, V] with last_only).
    The cache first reserves the blocks this forward writes (contract.py), unless reserve=False: its
    owner reserved them already (the serving engine's scheduler). ops: Model.forward's (None: model.ops)."""
    if reserve and cache is not None:
        cache.reserve(input_pos)
    return model(tokens, input_pos, cache, last_only=last_only, policy=policy, ops=ops)


def prefill(model, input_ids: Tensor, cache, policy=None, ops=None) -> Tensor:
    """Run the prompt [B, T] at positions 0..T-1 -> logits of the last position [B, V]."""
    input_pos = torch.arange(input_ids.shape[1], device=input_ids.device)
    return forward(model, input_ids, input_pos, cache, policy, last_only=True, ops=ops)[:, -1]


def decode_step(model, tokens: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
    """Feed the newest tokens [B, 1] at position input_pos [1] (or [B, 1], per row) -> next-token logits [B, V]."""
    return forward(model, tokens, input_pos, cache, policy, ops=ops)[:, -1]


class EagerStep:
    """The cached loop as torch runs it, op by op: the default wherever no faster exact step applies."""
    name = "eager"
    samples_inside = False  # decode returns logits; the loop samples (GraphedStep samples in its graph)
    loops_on_device = False  # GraphedStep: its decode_loop runs every token after the first (graphs.py)
    compile_s = 0.0
    prefill_chunk_size: int | None = None  # GenerationConfig.prefill_chunk_size (steps/choose.py sets it)
    reserves = True  # the step reserves the cache's blocks before each forward; False: its caller does (the engine)
    # each row's penalties, bias and mask (decoding/logits.py), set by the loop for a step that samples
    # inside (speculative decoding); None: the raw logits
    processing = None

    def grad_mode(self):
        """inference_mode: the fastest eager mode (CompiledStep wants no_grad)."""
        return torch.inference_mode()

    def prefill(self, model, input_ids: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
        """input_pos [T], or [B, T] per row (-1: padding) -> the last position's logits [B, V].

        With prefill_chunk_size C the prompt runs C tokens per forward: each piece writes its keys
        and values into the cache, and the next piece's queries read them there, so the result is
        the whole prompt's, while the activations alive at once scale with C instead of T (chapter 3)."""
        C = self.prefill_chunk_size or input_ids.shape[1]
        for start in range(0, input_ids.shape[1], C):
            logits = forward(model, input_ids[:, start:start + C], input_pos[..., start:start + C], cache, policy,
                             last_only=True, reserve=self.reserves, ops=ops)
        return logits[:, -1]

    def decode(self, model, tokens: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
        """One token per row [B, 1] at input_pos [1] (or [B, 1] per row) -> next-token logits [B, V]."""
        return forward(model, tokens, input_pos, cache, policy, reserve=self.reserves, ops=ops)[:, -1]

    def takes_decodes_with_prompts(self, ops) -> bool:
        """Whether `prefill` under the prompt ops `ops` runs decode rows (a chunk of one token) with the
        arithmetic of `decode`, so that the serving engine may run a step's decodes in its prompts' forward
        (FusedStep's paged prompts in C; here a prompt's products may take another format)."""
        return False

    def verify(self, model, tokens: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
        """Several tokens per row [B, T] at input_pos [T] (or [B, T], -1: padding) -> the logits of
        every position [B, T, V]: speculative decoding's check of k proposals (speculative.py)."""
        return forward(model, tokens, input_pos, cache, policy, reserve=self.reserves, ops=ops)

    def report(self, stats) -> None:
        """Fill what this step knows of a finished generation into GenerationStats."""
        stats.compile_s = self.compile_s


class NaiveStep(EagerStep):
    """use_cache=False: no cache; every step runs the model over the whole sequence so far (chapter 1).
    The sequence is this object's own state: one NaiveStep per generation."""
    name = "naive"

    def __init__(self):
        self.seq: Tensor | None = None  # [B, T + i]: the prompt and every token so far

    def prefill(self, model, input_ids: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
        self.seq = input_ids
        return super().prefill(model, input_ids, input_pos, None, policy, ops)

    def decode(self, model, tokens: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
        self.seq = torch.cat([self.seq, tokens], dim=1)
        pos = torch.arange(self.seq.shape[1], device=self.seq.device)
        return model(self.seq, pos, None, last_only=True, policy=policy, ops=ops)[:, -1]
