"""Chapter 16 exercise: one MLP split over two ranks, by columns and rows, and all-reduced.

`sharded_mlp(x, w_gate_up, w_down, rank, world_size) -> out`: x [B, T, D] fp32 and the *whole*
weights of a SwiGLU MLP, as model.py's GatedMLP holds them: w_gate_up [2F, D] (the F gate rows, then
the F up rows) and w_down [D, F]. Rank `rank` of `world_size` (F' = F / world_size) keeps

    gate rows  rank F', ..., (rank+1) F' - 1  of w_gate_up[:F]   and the same rows of up, w_gate_up[F:]
               (column-parallel: this rank's F' hidden units)
    w_down     the same F' columns [D, F']                        (row-parallel)

computes its partial output silu(x gate'^T) * (x up'^T) @ down'^T [B, T, D], sums the partial outputs
of every rank with torch.distributed.all_reduce (op SUM, in place), and returns the sum, which is the
layer's whole output, on every rank. (Gemma's GeGLU is the same split with the tanh GELU as the gate.)

The checker starts two gloo ranks on 127.0.0.1 (minigen.parallel.run_ranks) and runs your function in
each, on random cases of several shapes; every rank's output must agree with the unsharded GatedMLP
within ATOL + RTOL |out| (fp32), and the ranks must agree with each other exactly. A last case fills
the weights outside each rank's slices with NaN, and counts each rank's matmul FLOPs: a rank must
read only its own slices and multiply only them (not compute the whole layer and slice the result).
It fails an answer that calls minigen's own tensor parallelism (minigen.parallel.tensor: gate_up_rows,
kept, shard_model, all_reduce_hook, ...) or this module's worked solution (`forbidding`, inside the
ranks). It names the usual mistakes: no all-reduce (a rank returns its partial sum), the wrong op
(AVG, MAX), the first 2F/N rows of w_gate_up taken as one slice (gate and up mixed), w_down split by
rows, the all-reduce before the down projection, and a collective that not every rank reaches (the
ranks time out instead of hanging: the checker's `timeout`).

How your function reaches the ranks: each rank is a new process ("spawn"), and a function defined in a
notebook cell cannot be pickled into one, so the checker sends its source and the globals it names,
and builds it again inside each rank (remote.py says how; the namespace starts with torch,
torch.distributed as dist, torch.nn.functional as F, math and Tensor). Define the answer with `def`.

`verdicts(answers)` checks several answers in one group (one start of the ranks, ~5 s, for them all)
and returns each one's message ("" where it passes): the chapter shows its planted mistakes that way.
"""

from __future__ import annotations

import math
import types
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ...checkpoints.model_config import ModelConfig
from ...errors import RankError
from ...model import GatedMLP, TorchOps
from ...parallel import tensor
from ...parallel.group import run_ranks
from . import ExerciseFailed, forbidding
from . import remote

RANKS = 2  # the group the checker starts: world_size
TIMEOUT_S = 60.0  # the group's deadline: the ranks' start (~5 s: torch and minigen imported) and the cases
ATOL, RTOL = 1e-5, 1e-4  # fp32: the ranks' partial sums add in another order than one matmul (measured < 1e-6)
FLOP_SLACK = 1.25  # a rank may multiply at most this times its shard's 6 B T D F' FLOPs


# ---------------------------------------------------------------- worked solution
def solution_sharded_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor, rank: int, world_size: int) -> Tensor:
    """This rank's F' gate rows, the same up rows and the same w_down columns; the partial output,
    summed over the ranks: [B, T, D] -> [B, T, D], the whole layer's output on every rank."""
    width = w_down.shape[1]  # F
    part = width // world_size  # F'
    mine = slice(rank * part, (rank + 1) * part)  # this rank's hidden units
    gate = F.linear(x, w_gate_up[:width][mine])  # column-parallel: [B, T, F']
    up = F.linear(x, w_gate_up[width:][mine])  # the up rows of the same units, F rows further on
    partial = F.linear(F.silu(gate) * up, w_down[:, mine])  # row-parallel: [B, T, D], a partial sum
    dist.all_reduce(partial, op=dist.ReduceOp.SUM)  # in place: every rank now holds the sum
    return partial


# ---------------------------------------------------------------- the cases and the checker's own math
def _cases() -> list[tuple[str, Tensor, Tensor, Tensor]]:
    """(label, x [B, T, D], w_gate_up [2F, D], w_down [D, F]): random fp32, F' never equal to D."""
    g = torch.Generator().manual_seed(17)
    cases = []
    for B, T, D, width in ((1, 1, 8, 24), (2, 3, 16, 48), (3, 5, 12, 40), (2, 4, 32, 80)):
        x = torch.randn(B, T, D, generator=g)
        w_gate_up = torch.randn(2 * width, D, generator=g) / math.sqrt(D)
        w_down = torch.randn(D, width, generator=g) / math.sqrt(width)
        cases.append((f"B={B}, T={T}, D={D}, F={width}", x, w_gate_up, w_down))
    return cases


def unsharded(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """The layer itself: model.py's GatedMLP (SwiGLU, as Llama's) holding the whole weights."""
    D, width = w_down.shape
    cfg = ModelConfig(arch="llama", vocab_size=1, dim=D, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=D,
                      hidden_dim=width, max_seq_len=1)
    mlp = GatedMLP(cfg)
    mlp.w_gate_up.data, mlp.w_down.data = w_gate_up, w_down
    with torch.no_grad():
        return mlp(x, TorchOps())


def _slices(width: int, rank: int, world_size: int) -> tuple[Tensor, Tensor]:
    """(the rows of w_gate_up, the columns of w_down) that `rank` keeps."""
    part = width // world_size
    cols = torch.arange(rank * part, (rank + 1) * part)
    return torch.cat((cols, cols + width)), cols


def _partial(x: Tensor, w_gate_up: Tensor, w_down: Tensor, rows: Tensor, cols: Tensor,
             reduce_hidden: Tensor | None = None) -> Tensor:
    """One rank's partial output from the given rows and columns (reduce_hidden: the hidden units
    summed over the ranks are used instead of its own, for the 'all-reduce before down' mistake)."""
    gate, up = F.linear(x, w_gate_up[rows]).chunk(2, dim=-1)
    hidden = F.silu(gate) * up if reduce_hidden is None else reduce_hidden
    return F.linear(hidden, w_down[:, cols])


_EARLY = ("the all-reduce came before the down projection: it summed the hidden units [B, T, F'] of different "
          "ranks, which are different units. Project each rank's own hidden units with its w_down columns, then "
          "all-reduce the partial output [B, T, D]")


def _mistakes(x: Tensor, w_gate_up: Tensor, w_down: Tensor, rank: int, world_size: int) -> list[tuple[Tensor, str]]:
    """(what a usual mistake returns on `rank`, its hint)."""
    width = w_down.shape[1]
    part = width // world_size
    own = [_slices(width, r, world_size) for r in range(world_size)]
    partials = [_partial(x, w_gate_up, w_down, *own[r]) for r in range(world_size)]
    whole = sum(partials)
    # the classic: rank r takes rows r 2F', ..., (r+1) 2F' - 1 of w_gate_up and halves them
    mixed = sum(_partial(x, w_gate_up, w_down, torch.arange(r * 2 * part, (r + 1) * 2 * part), own[r][1])
                for r in range(world_size))
    hidden = sum(F.silu(g) * u for g, u in (F.linear(x, w_gate_up[own[r][0]]).chunk(2, dim=-1)
                                           for r in range(world_size)))
    early = _partial(x, w_gate_up, w_down, *own[rank], reduce_hidden=hidden)
    return [
        (partials[rank], "no all-reduce: each rank returned its own partial sum, a part of the output. "
                         "dist.all_reduce(partial, op=dist.ReduceOp.SUM) adds every rank's into each"),
        (whole / world_size, "the partial outputs were averaged: they are parts of a sum, so all-reduce "
                             "them with op=dist.ReduceOp.SUM, not AVG (nor divide by world_size)"),
        (torch.maximum(*partials) if world_size == 2 else whole * math.nan,
         "all-reduce with op=MAX keeps the larger partial, elementwise: the output is their SUM"),
        (mixed, "gate and up are mixed: the first 2F/N rows of w_gate_up are not this rank's gate and up. "
                "Its gate rows are w_gate_up[:F][r F', (r+1) F'] and its up rows the same rows of "
                "w_gate_up[F:], F rows further on (GatedMLP splits the product in two halves)"),
        (early, _EARLY),
        (whole * world_size, "every rank computed the whole layer and the all-reduce added N copies: "
                             "keep only this rank's slices"),
    ]


def _close(got: Tensor, want: Tensor) -> bool:
    return got.shape == want.shape and bool(torch.allclose(got, want, atol=ATOL, rtol=RTOL))


def _hint(case: tuple, rank: int, got: Tensor, reduces: list[tuple[str, list[int]]]) -> str:
    """The usual mistake that explains `got` on `rank`, or ""."""
    _, x, w_gate_up, w_down = case
    width = w_down.shape[1]
    for op, shape in reduces:
        if op != "SUM":
            return (f"all_reduce with op={op}: the ranks' partial outputs add up to the layer's output, so "
                    "op=dist.ReduceOp.SUM (the default)")
        if shape and shape[-1] == width // RANKS:
            return _EARLY
    for wrong, hint in _mistakes(x, w_gate_up, w_down, rank, RANKS):
        if _close(got, wrong):
            return hint
    return ""


# ---------------------------------------------------------------- inside each rank
class _Recorder:
    """Stands in for torch.distributed.all_reduce inside a rank: notes each call's op and shape (and a
    copy of what this rank put in), then runs the real one; `failed` when the collective itself raised."""

    def __init__(self, real: Callable):
        self.real, self.calls, self.failed = real, [], False

    def __call__(self, tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        self.calls.append((name, list(tensor.shape) if isinstance(tensor, Tensor) else [],
                           tensor.detach().clone() if isinstance(tensor, Tensor) else None))
        try:
            return self.real(tensor, op, *args, **kwargs)
        except BaseException:
            self.failed = True
            raise


def _poisoned(w_gate_up: Tensor, w_down: Tensor, rank: int, world_size: int) -> tuple[Tensor, Tensor]:
    """The weights with every row and column that `rank` does not keep set to NaN."""
    rows, cols = _slices(w_down.shape[1], rank, world_size)
    wgu, wd = torch.full_like(w_gate_up, math.nan), torch.full_like(w_down, math.nan)
    wgu[rows], wd[:, cols] = w_gate_up[rows], w_down[:, cols]
    return wgu, wd


def _matmul_flops(fn: Callable, *args) -> tuple[object, int]:
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        out = fn(*args)
    return out, counter.get_total_flops()


def _answer(rank: int, world_size: int, payload: dict, recorder: _Recorder, own: list) -> dict:
    """Build one answer and run it on every case (then the poisoned one), with minigen's own tensor
    parallelism forbidden -> what it returned, its all-reduces, its FLOPs, or what went wrong."""
    report = {"outputs": [], "reduces": [], "flops": [], "failed": None, "error": None, "case": None,
              "collective_failed": False}
    recorder.failed = False
    try:
        fn = remote.unpack(payload)
        cases = [(x, wgu, wd) for _, x, wgu, wd in _cases()]
        _, x, wgu, wd = _cases()[1]
        cases.append((x, *_poisoned(wgu, wd, rank, world_size)))
        for i, (x, wgu, wd) in enumerate(cases):
            report["case"] = i
            recorder.calls = []
            with forbidding(*own, solution_sharded_mlp):
                out, flops = _matmul_flops(fn, x.clone(), wgu.clone(), wd.clone(), rank, world_size)
            report["outputs"].append(out.detach().clone() if isinstance(out, Tensor) else type(out).__name__)
            report["reduces"].append([(op, shape) for op, shape, _ in recorder.calls])
            report["flops"].append(flops)
        report["poisoned_inputs"] = [sent for _, _, sent in recorder.calls if sent is not None]
    except ExerciseFailed as e:
        report["failed"] = str(e)
    except Exception as e:
        report["collective_failed"] = recorder.failed
        report["error"] = remote.said(e, payload)
    return report


def _rank(rank: int, world_size: int, payloads: list[dict]) -> list[dict]:
    """One rank: each answer's report, in order. Between two answers the ranks meet on a group of the
    checker's own (the answers' all-reduces use the default group): an answer after which the ranks are
    out of step (one waits in an all-reduce the other never calls) stops the group there."""
    recorder = _Recorder(dist.all_reduce)
    dist.all_reduce = recorder  # this process is the rank's own: nothing else runs in it
    own = [f for f in vars(tensor).values()
           if isinstance(f, types.FunctionType) and f.__module__ == tensor.__name__ and not f.__closure__]
    between = dist.new_group(backend="gloo") if len(payloads) > 1 else None
    reports = []
    for payload in payloads:
        reports.append(_answer(rank, world_size, payload, recorder, own))
        if reports[-1]["collective_failed"]:
            break
        if between is not None:
            dist.barrier(group=between)
    return reports


# ---------------------------------------------------------------- the checker
_HANG = ("every rank must reach the same collectives in the same order: an all_reduce that only some ranks "
         "call waits for the others until the group's timeout. Call dist.all_reduce once, on every rank")


def check_sharded_mlp(fn: Callable, timeout: float = TIMEOUT_S) -> bool:
    """Runs fn(x, w_gate_up, w_down, rank, world_size) in 2 gloo ranks against the unsharded GatedMLP.
    timeout: seconds the whole group may take (its start included) before the checker gives up."""
    verdict = verdicts([fn], timeout)[0]
    if verdict:
        raise ExerciseFailed(verdict)
    print(f"✓ {fn.__name__}: {len(_cases())} cases on {RANKS} gloo ranks agree with the unsharded GatedMLP "
          f"(within {ATOL:g} + {RTOL:g} |out|), and each rank read and multiplied only its own slices")
    return True


def verdicts(fns: list[Callable], timeout: float = TIMEOUT_S) -> list[str]:
    """check_sharded_mlp for several answers in one group (one start of the ranks for them all) -> for
    each, "" where it passes, else the message its ExerciseFailed would say. Where the group itself
    fails (an answer's ranks stop meeting), each answer is checked again in a group of its own."""
    said: list[str | None] = [None] * len(fns)
    payloads = {}
    for i, fn in enumerate(fns):
        try:
            payloads[i] = remote.pack(fn)
        except ExerciseFailed as e:
            said[i] = str(e)
    if not payloads:
        return said
    try:
        reports = run_ranks(_rank, RANKS, args=(list(payloads.values()),), timeout=timeout)
    except RankError as e:
        if len(payloads) > 1:
            return [s if s is not None else verdicts([fn], timeout)[0] for s, fn in zip(said, fns)]
        first = str(e).splitlines()[0]
        return [s if s is not None else f"{fns[i].__name__}: the ranks did not finish ({first}). Hint: {_HANG}"
                for i, s in enumerate(said)]
    done = min(len(r) for r in reports)
    if len(payloads) > 1 and (done < len(payloads) or any(r[k]["collective_failed"] for r in reports
                                                           for k in range(done))):
        return [s if s is not None else verdicts([fn], timeout)[0] for s, fn in zip(said, fns)]
    for k, (i, payload) in enumerate(payloads.items()):
        try:
            _judge(payload, [r[k] for r in reports])
            said[i] = ""
        except ExerciseFailed as e:
            said[i] = str(e)
    return said


def _judge(payload: dict, reports: list[dict]) -> None:
    """ExerciseFailed unless every rank's report of one answer agrees with the unsharded layer."""
    name = payload["name"]
    for report in reports:
        if report["failed"]:
            raise ExerciseFailed(report["failed"])
    if any(report["collective_failed"] for report in reports):
        errors = "; ".join(f"rank {r}: {reports[r]['error'] or 'returned, without the others'}" for r in range(RANKS))
        raise ExerciseFailed(f"{name}: an all-reduce failed, the ranks did not meet in it ({errors}). Hint: {_HANG}")
    cases = _cases()
    for rank, report in enumerate(reports):
        if report["error"]:
            case = report["case"]
            label = ("building it from its source" if case is None else cases[case][0] if case < len(cases)
                     else "the case with NaN outside each rank's slices")
            hint = ""
            if "cannot be multiplied" in report["error"] or "size of tensor" in report["error"]:
                hint = (". Hint: w_gate_up [2F, D] is split by rows (this rank's gate rows and the same up rows), "
                        "w_down [D, F] by columns (w_down[:, r F' : (r+1) F']), the ones that meet this rank's "
                        "F' hidden units; its rows are the output's D features, which every rank produces")
            elif report["error"].startswith("NameError"):
                left = "; ".join(f"{k} ({why})" for k, why in payload["skipped"].items())
                hint = (". Hint: your function runs again in each rank, from its source, with the globals it names"
                        + (f"; these could not be sent: {left}" if left else "") +
                        ". Import what it needs inside the function, or use module-level values that pickle")
            raise ExerciseFailed(f"{name}, {label}, rank {rank} of {RANKS}: your function raised {report['error']}"
                                 + hint)
    for i, case in enumerate(cases):
        label, x, w_gate_up, w_down = case
        want = unsharded(x, w_gate_up, w_down)
        for rank, report in enumerate(reports):
            got = report["outputs"][i]
            if not isinstance(got, Tensor):
                raise ExerciseFailed(f"{name}, {label}, rank {rank}: returned {got}, expected a tensor "
                                     f"{tuple(want.shape)}, the layer's whole output")
            if got.shape != want.shape:
                raise ExerciseFailed(f"{name}, {label}, rank {rank}: shape {tuple(got.shape)}, expected "
                                     f"{tuple(want.shape)} [B, T, D]: every rank returns the whole output")
            got = got.float()
            if not _close(got, want):
                hint = _hint(case, rank, got, report["reduces"][i])
                raise ExerciseFailed(f"{name}, {label}, rank {rank} of {RANKS}: differs from the unsharded "
                                     f"GatedMLP by up to {float((got - want).abs().nan_to_num(math.inf).max()):.3g} "
                                     f"(allowed {ATOL:g} + {RTOL:g} |out|)" + (f". Hint: {hint}" if hint else ""))
        if not torch.equal(reports[0]["outputs"][i], reports[1]["outputs"][i]):
            raise ExerciseFailed(f"{name}, {label}: the ranks returned different tensors; after the all-reduce "
                                 "every rank holds the same sum, so return it as it is")
    _only_own_slices(name, cases[1], reports)


def _only_own_slices(name: str, case: tuple, reports: list[dict]) -> None:
    """The last case gave each rank weights that are NaN outside its slices, and counted its FLOPs."""
    label, x, w_gate_up, w_down = case
    B, T, D = x.shape
    shard = 6 * B * T * D * (w_down.shape[1] // RANKS)  # 2 B T D 2F' (gate and up) + 2 B T F' D (down)
    for rank, report in enumerate(reports):
        got, flops = report["outputs"][-1], report["flops"][-1]
        sent = report.get("poisoned_inputs") or []
        read = (isinstance(got, Tensor) and bool(torch.isnan(got).any())) or any(torch.isnan(t).any() for t in sent)
        if read:
            who = [r for r, rep in enumerate(reports) if any(torch.isnan(t).any() for t in rep.get("poisoned_inputs") or [])]
            raise ExerciseFailed(
                f"{name}, {label}, with the weights outside each rank's slices set to NaN: the output came out NaN"
                + (f" (rank {', '.join(map(str, who))} sent NaN to the all-reduce)" if who else "") +
                ". Hint: a rank must read only its F' gate rows (w_gate_up[:F][r F' : (r+1) F']), the same "
                "rows of up (w_gate_up[F:]) and the same columns of w_down, not the whole weights")
        if flops > FLOP_SLACK * shard:
            raise ExerciseFailed(
                f"{name}, {label}, rank {rank}: {flops:,} matmul FLOPs where its shard needs {shard:,} "
                f"(6 B T D F'). Hint: slice the weights before the matmuls: a rank that multiplies the whole "
                "weights and slices the products does the whole layer's work")
