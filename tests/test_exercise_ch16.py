"""Chapter 16's exercise (issue 45): one MLP sharded by columns and rows and all-reduced, checked on two
gloo ranks (127.0.0.1) against the unsharded GatedMLP. The worked solution passes, from its module and
from a notebook cell (its source only in linecache); each usual mistake fails with its hint; an answer
that calls minigen's own tensor parallelism fails; an answer whose ranks do not meet in the all-reduce
fails within the checker's timeout. Each check starts two ranks (~5 s)."""

from __future__ import annotations

import linecache
import pickle
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minigen.course.exercises import ExerciseFailed, ch16


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def notebook(cells: list[str]) -> dict:
    """Run `cells` as IPython does: each compiled under a file name that does not exist, its text kept in
    linecache only (ipykernel's /tmp/ipykernel_<pid>/<hash>.py), in one namespace whose module is __main__."""
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(cells):
        name = f"/tmp/ipykernel_0/notebook-cell-{i}-{time.monotonic_ns()}.py"
        linecache.cache[name] = (len(cell), None, cell.splitlines(True), name)
        exec(compile(cell, name, "exec"), namespace)
    return namespace


# ---------------------------------------------------------------- the usual mistakes, as a reader writes them
def no_all_reduce(x, w_gate_up, w_down, rank, world_size):
    width = w_down.shape[1]
    mine = slice(rank * width // world_size, (rank + 1) * width // world_size)
    h = F.silu(x @ w_gate_up[:width][mine].T) * (x @ w_gate_up[width:][mine].T)
    return h @ w_down[:, mine].T  # a partial sum


def averaged(x, w_gate_up, w_down, rank, world_size):
    width = w_down.shape[1]
    mine = slice(rank * width // world_size, (rank + 1) * width // world_size)
    out = (F.silu(x @ w_gate_up[:width][mine].T) * (x @ w_gate_up[width:][mine].T)) @ w_down[:, mine].T
    dist.all_reduce(out, op=dist.ReduceOp.AVG)
    return out


def maxed(x, w_gate_up, w_down, rank, world_size):
    width = w_down.shape[1]
    mine = slice(rank * width // world_size, (rank + 1) * width // world_size)
    out = (F.silu(x @ w_gate_up[:width][mine].T) * (x @ w_gate_up[width:][mine].T)) @ w_down[:, mine].T
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def gate_up_mixed(x, w_gate_up, w_down, rank, world_size):
    width, rows = w_down.shape[1], w_gate_up.shape[0] // world_size
    gate, up = (x @ w_gate_up[rank * rows:(rank + 1) * rows].T).chunk(2, dim=-1)  # the first 2F/N rows
    mine = slice(rank * width // world_size, (rank + 1) * width // world_size)
    out = (F.silu(gate) * up) @ w_down[:, mine].T
    dist.all_reduce(out)
    return out


def down_by_rows(x, w_gate_up, w_down, rank, world_size):
    width, D = w_down.shape[1], w_down.shape[0]
    mine = slice(rank * width // world_size, (rank + 1) * width // world_size)
    h = F.silu(x @ w_gate_up[:width][mine].T) * (x @ w_gate_up[width:][mine].T)
    out = h @ w_down[rank * D // world_size:(rank + 1) * D // world_size].T
    dist.all_reduce(out)
    return out


def reduce_before_down(x, w_gate_up, w_down, rank, world_size):
    width = w_down.shape[1]
    mine = slice(rank * width // world_size, (rank + 1) * width // world_size)
    h = F.silu(x @ w_gate_up[:width][mine].T) * (x @ w_gate_up[width:][mine].T)
    dist.all_reduce(h)  # [B, T, F']: different hidden units on each rank
    return h @ w_down[:, mine].T


def whole_layer(x, w_gate_up, w_down, rank, world_size):
    gate, up = (x @ w_gate_up.T).chunk(2, dim=-1)  # every rank computes the whole layer: right, but unsharded
    return (F.silu(gate) * up) @ w_down.T


def sliced_after(x, w_gate_up, w_down, rank, world_size):
    width = w_down.shape[1]
    mine = slice(rank * width // world_size, (rank + 1) * width // world_size)
    gate, up = (x @ w_gate_up.T).chunk(2, dim=-1)  # the whole products, then this rank's units
    out = (F.silu(gate[..., mine]) * up[..., mine]) @ w_down[:, mine].T
    dist.all_reduce(out)
    return out


def readers_own(x, w_gate_up, w_down, rank, world_size):
    """A right answer written otherwise than the worked solution (einsum, index_select, default op)."""
    width = w_down.shape[1]
    units = torch.arange(rank * width // world_size, (rank + 1) * width // world_size)
    gate_up = torch.einsum("btd,fd->btf", x, w_gate_up.index_select(0, torch.cat((units, units + width))))
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.einsum("btf,df->btd", torch.nn.functional.silu(gate) * up, w_down.index_select(1, units))
    dist.all_reduce(out)
    return out


def calls_minigens_own(x, w_gate_up, w_down, rank, world_size):
    from minigen.checkpoints.model_config import ModelConfig
    from minigen.parallel.tensor import gate_up_rows
    cfg = ModelConfig(arch="llama", vocab_size=1, dim=x.shape[-1], n_layers=1, n_heads=1, n_kv_heads=1,
                      head_dim=x.shape[-1], hidden_dim=w_down.shape[1], max_seq_len=1)
    return gate_up_rows(cfg, rank, world_size)  # refused inside the ranks


def calls_the_worked_solution(x, w_gate_up, w_down, rank, world_size):
    return ch16.solution_sharded_mlp(x, w_gate_up, w_down, rank, world_size)


MISTAKES = [
    (no_all_reduce, "no all-reduce: each rank returned its own partial sum"),
    (averaged, "all_reduce with op=AVG"),
    (maxed, "all_reduce with op=MAX"),
    (gate_up_mixed, "gate and up are mixed: the first 2F/N rows"),
    (down_by_rows, r"cannot be multiplied.*w_down \[D, F\] by columns"),
    (reduce_before_down, "the all-reduce came before the down projection"),
    (whole_layer, "with the weights outside each rank's slices set to NaN: the output came out NaN"),
    (sliced_after, "matmul FLOPs where its shard needs .* slice the weights before the matmuls"),
    (calls_minigens_own, "calls minigen's own gate_up_rows"),
    (calls_the_worked_solution, "calls minigen's own solution_sharded_mlp"),
    (lambda x, w_gate_up, w_down, rank, world_size: x, "a lambda has none of its own: define the answer with def"),
]
# a notebook answer whose global cannot travel to the ranks: the NameError there names it
LOCKED = notebook(["import threading\nLOCK = threading.Lock()\n", """\
def locked(x, w_gate_up, w_down, rank, world_size):
    with LOCK:
        return x
"""])["locked"]
MISTAKES.append((LOCKED, "NameError: name 'LOCK' is not defined.*could not be sent: LOCK \\(lock, TypeError"))


@pytest.fixture(scope="module")
def batch():
    """Every answer below checked in one group of two ranks (one start for them all), with a right one."""
    answers = [readers_own] + [wrong for wrong, _ in MISTAKES]
    start = time.monotonic()
    said = ch16.verdicts(answers, timeout=50)
    return dict(zip(answers, said)), time.monotonic() - start


@pytest.mark.parametrize("wrong,hint", MISTAKES, ids=[f.__name__ for f, _ in MISTAKES])
def test_each_usual_mistake_fails_with_its_hint(batch, wrong, hint):
    said, _ = batch
    assert said[wrong] and re.search(hint, said[wrong]), said[wrong]


def test_a_right_answer_of_the_readers_passes_among_wrong_ones_in_one_group(batch):
    said, seconds = batch
    assert said[readers_own] == ""
    assert seconds < 40  # one group for them all, not one each


# ---------------------------------------------------------------- the right answer, from a module and a notebook
def test_the_worked_solution_passes_in_two_gloo_ranks(capsys):
    assert ch16.check_sharded_mlp(ch16.solution_sharded_mlp, timeout=40)
    assert "agree with the unsharded GatedMLP" in capsys.readouterr().out


CELL_1 = """\
import torch.distributed as tdist
from torch.nn import functional as nnf
SUM = tdist.ReduceOp.SUM

def my_slice(width, rank, world_size):
    part = width // world_size
    return slice(rank * part, (rank + 1) * part)
"""

CELL_2 = """\
def sharded_mlp(x, w_gate_up, w_down, rank, world_size, op=SUM):
    width = w_down.shape[1]
    mine = my_slice(width, rank, world_size)
    gate = nnf.linear(x, w_gate_up[:width][mine])
    up = nnf.linear(x, w_gate_up[width:][mine])
    out = nnf.linear(nnf.silu(gate) * up, w_down[:, mine])
    tdist.all_reduce(out, op=op)
    return out
"""


def test_a_notebook_answer_reaches_the_ranks_by_its_source():
    namespace = notebook([CELL_1, CELL_2])
    answer = namespace["sharded_mlp"]
    with pytest.raises((pickle.PicklingError, AttributeError)):  # the pitfall: it cannot be pickled into a rank
        pickle.loads(pickle.dumps(answer))
    assert ch16.check_sharded_mlp(answer, timeout=40)  # its alias modules, helper and default travel with it


# ---------------------------------------------------------------- ranks that never meet
def test_ranks_that_do_not_meet_in_the_all_reduce_fail_within_the_timeout():
    namespace = notebook(["import time\n", CELL_1, """\
def stuck(x, w_gate_up, w_down, rank, world_size):
    width = w_down.shape[1]
    mine = my_slice(width, rank, world_size)
    out = nnf.linear(nnf.silu(x @ w_gate_up[:width][mine].T) * (x @ w_gate_up[width:][mine].T), w_down[:, mine])
    if rank == 0:
        tdist.all_reduce(out)  # rank 1 never comes
    else:
        time.sleep(600)
    return out
"""])
    start = time.monotonic()
    with pytest.raises(ExerciseFailed, match="every rank must reach the same collectives"):
        ch16.check_sharded_mlp(namespace["stuck"], timeout=12)
    assert time.monotonic() - start < 12 + 5  # the timeout, then the ranks stopped (SIGTERM, SIGKILL after 2 s)
