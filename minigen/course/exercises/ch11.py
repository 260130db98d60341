"""Chapter 11 exercise: find and remove the host syncs in a decode step.

1. `step_without_syncs(logits, finished, pad_id, stop_ids)`: the same results as `synced_step`
   below, with no value read back to Python. A host sync is any place where Python needs a
   tensor's value: `.item()`, `int(t)`, `float(t)`, `bool(t)`, or an `if` on a tensor. On a GPU
   each one waits for the device to finish; in a compiled step it breaks the graph (fullgraph=True
   refuses it); in a CUDA graph it cannot be recorded at all. The checker counts the syncs of your
   step (a scalar read goes through one op, aten._local_scalar_dense; `.tolist()`, `.numpy()` and
   `.cpu()` copy a whole tensor to the host and are counted too), compiles it with
   torch.compile(fullgraph=True), and compares its outputs with the reference. An answer that
   calls this module's worked solution fails.

`count_host_syncs(fn, *args)` is the counter, for the chapter's own use too.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import ExerciseFailed, forbidding


def synced_step(logits: Tensor, finished: Tensor, pad_id: int, stop_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The greedy tail of a batched decode step, with two host syncs hidden in it.

    logits [B, V] fp32; finished [B] bool (rows that already stopped); stop_ids [K] long ->
    (tokens [B]: pad_id where the row had finished, log-probabilities of those tokens [B]: 0 where
    finished, finished [B]: now also the rows that just produced a stop id).
    """
    top = logits.max().item()  # for a stable log-softmax: subtract the largest logit
    shifted = logits - top
    logprobs = shifted - shifted.exp().sum(dim=-1, keepdim=True).log()  # [B, V]
    tokens = logits.argmax(dim=-1)  # [B]
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]  # [B]
    if finished.any():  # rows that stopped repeat the pad token and score nothing
        tokens = tokens.masked_fill(finished, pad_id)
        chosen = chosen.masked_fill(finished, 0.0)
    return tokens, chosen, finished | torch.isin(tokens, stop_ids)


# ---------------------------------------------------------------- counting syncs
class _SyncCounter(TorchDispatchMode):
    """Counts aten._local_scalar_dense: the one op behind .item(), int(), float(), bool() on a tensor."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _CopyOutCounter(TorchFunctionMode):
    """Counts the calls that copy a whole tensor to the host: .tolist(), .numpy(), .cpu() (on a CPU
    tensor they copy nothing, and dispatch no op the counter above would see; on a GPU each waits)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "numpy", "cpu"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_host_syncs(fn, *args, **kwargs) -> int:
    """How many times fn(*args) reads a tensor's value into Python (run eagerly, once)."""
    with torch.no_grad(), _CopyOutCounter() as copies, _SyncCounter() as counter:
        fn(*args, **kwargs)
    return counter.count + copies.count


# ---------------------------------------------------------------- 1. the step without syncs
def solution_step_without_syncs(logits: Tensor, finished: Tensor, pad_id: int,
                                stop_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every value stays on the device: a per-row max as a tensor, torch.where instead of `if`."""
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # [B, V]; per row, which is also stabler
    logprobs = shifted - shifted.exp().sum(dim=-1, keepdim=True).log()
    tokens = logits.argmax(dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    tokens = torch.where(finished, torch.full_like(tokens, pad_id), tokens)  # no branch: both sides computed
    chosen = torch.where(finished, torch.zeros_like(chosen), chosen)
    return tokens, chosen, finished | torch.isin(tokens, stop_ids)


def _cases() -> list[tuple[str, tuple]]:
    g = torch.Generator().manual_seed(8)
    logits = 4 * torch.randn(4, 50, generator=g)
    stop_ids = logits.argmax(-1)[2:3]  # row 2 produces a stop id
    return [
        ("no row finished", (logits, torch.zeros(4, dtype=torch.bool), 0, stop_ids)),
        ("rows 0 and 3 finished", (logits, torch.tensor([True, False, False, True]), 7, stop_ids)),
        ("every row finished", (logits, torch.ones(4, dtype=torch.bool), 7, stop_ids)),
    ]


SYNC_HINT = ("keep every value on the device: logits.amax(dim=-1, keepdim=True) (a tensor) instead of "
             "logits.max().item(), torch.where(finished, pad, tokens) on every row instead of "
             "`if finished.any():`, and tensors instead of Python numbers or lists (no int(), .tolist())")


def check_step_without_syncs(fn) -> bool:
    """fn(logits, finished, pad_id, stop_ids) -> (tokens, log-probabilities, finished): no host sync,
    compiles with fullgraph=True, and equals the reference (`synced_step`) on every case."""
    cases = _cases()
    wants = [synced_step(*args) for _, args in cases]  # the reference, before the solution is forbidden
    forbidden = [] if fn is solution_step_without_syncs else [solution_step_without_syncs]  # (checked as itself)
    with forbidding(*forbidden):  # the eager run: a call of the solution raises here
        syncs = count_host_syncs(fn, *cases[1][1])
    if syncs:
        raise ExerciseFailed(f"step_without_syncs: your step still reads {syncs} tensor value(s) into Python "
                             f"(.item(), int(), float(), bool(), .tolist() or an `if` on a tensor). Hint: {SYNC_HINT}")
    # backend="eager": dynamo traces the step into one graph, as inductor and CUDA graphs need it, but
    # generates no code, so the check takes a second instead of a C++ compile.
    compiled = torch.compile(fn, fullgraph=True, backend="eager", dynamic=False)
    for (label, args), want in zip(cases, wants):
        try:
            got = compiled(*args)
        except Exception as err:  # dynamo's errors are many classes; the first line names the cause
            raise ExerciseFailed(f"step_without_syncs: torch.compile(fullgraph=True) refused your step for {label}: "
                                 f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}. Hint: a "
                                 "compiled step is one graph of tensor ops, so no print or other Python side "
                                 f"effect, and no Python decision on a tensor's value; {SYNC_HINT}") from None
        if not (isinstance(got, tuple) and len(got) == 3):
            raise ExerciseFailed("step_without_syncs: return (tokens, log-probabilities, finished), like synced_step")
        for name, g_, w in zip(("tokens", "log-probabilities", "finished"), got, want):
            if g_.shape != w.shape or g_.dtype != w.dtype:
                raise ExerciseFailed(f"step_without_syncs: for {label}, {name} should be {w.dtype} {tuple(w.shape)}, "
                                     f"got {g_.dtype} {tuple(g_.shape)}")
            if not torch.allclose(g_.float(), w.float(), rtol=1e-5, atol=1e-5):
                raise ExerciseFailed(f"step_without_syncs: for {label}, {name} differ: expected {w.tolist()}, got "
                                     f"{g_.tolist()}. Hint: finished rows give pad_id and a log-probability of 0; "
                                     "the others their argmax and its log-softmax")
    print(f"✓ step_without_syncs: no host sync, one graph under fullgraph=True, and all {len(cases)} cases "
          "agree with the reference")
    return True
