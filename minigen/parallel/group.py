"""A process group on this machine: N ranks started, supervised, answered, and always stopped.

    results = run_ranks(work, 2, args=(prompt,), timeout=60)   # work(rank, tp_size, prompt) in each rank

Each rank is a fresh process (the "spawn" start method: no state forked from a parent that may hold
threads) that joins a gloo group over torch.distributed. The rendezvous is a FileStore in a fresh
temporary folder, and gloo's connections bind the loopback interface, so nothing listens beyond
127.0.0.1. Collectives wait at most `timeout` seconds (torch.distributed's own timeout), and the
parent waits at most `timeout` seconds for every answer.

A rank that raises, or dies (a signal, the out-of-memory killer), leaves its peers blocked in an
all-reduce that can no longer complete. gloo notices the closed connections and raises in them; the
parent gives them `grace` seconds to say so, stops whatever is still running, and raises one
RankError naming the rank that failed first, how, and what the others said. No rank outlives
run_ranks, whatever happens: a failure, a timeout, or an interrupt of the parent.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import ConfigError, MinigenError, RankError

GRACE_S = 10.0  # seconds the other ranks get to report their own error once one has failed
POLL_S = 0.1  # how often the parent looks at its ranks while it waits


def loopback_interface() -> str:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS), which gloo binds."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def join_group(rank: int, tp_size: int, store_file: str, timeout: float, backend: str = "gloo") -> None:
    """Join the group of `tp_size` ranks that meet at `store_file` (a FileStore), as `rank`; collectives
    raise after `timeout` seconds without their peers. backend "nccl": rank r runs on GPU r."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())  # connections on 127.0.0.1 only
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())  # NCCL's bootstrap too
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=tp_size,
                            timeout=timedelta(seconds=timeout))


def packed(value) -> bytes:
    """A rank's answer as bytes (torch.save): tensors travel by value, not as shared memory that would
    vanish with the rank."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpacked(data: bytes):
    """packed's inverse: tensors, numbers, strings and their lists, tuples and dicts only (weights_only)."""
    return torch.load(io.BytesIO(data), weights_only=True)


def rank_main(rank: int, tp_size: int, store_file: str, timeout: float, env: dict[str, str], threads: int,
              fn: Callable, args: tuple, answers, backend: str = "gloo") -> None:
    """One rank's process: join the group, run fn(rank, tp_size, *args), put (rank, ok, answer) on
    `answers` (the result packed, or the error in words), and leave."""
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        join_group(rank, tp_size, store_file, timeout, backend)
        answer = (rank, True, packed(fn(rank, tp_size, *args)))
    except BaseException as e:  # reported, never swallowed: the parent raises it as a RankError
        if not isinstance(e, MinigenError):  # a bug, not a refusal: its whole trace in this rank's stderr
            traceback.print_exc()
        answer = (rank, False, f"{type(e).__name__}: {e}")
    answers.put(answer)
    answers.close()
    answers.join_thread()  # the answer is in the pipe before the process ends
    if answer[1] and dist.is_initialized():
        dist.destroy_process_group()  # every rank got here: nobody waits on a peer
    # after a failure the peers may be blocked in a collective: leave without waiting for them
    os._exit(0 if answer[1] else 1)


def died(exitcode: int) -> str:
    """A process's exit code in words: "killed by SIGKILL", "exited with status 3"."""
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


def run_ranks(fn: Callable, tp_size: int, args: tuple = (), timeout: float = 120.0, env: dict[str, str] | None = None,
              threads: int = 1, grace: float = GRACE_S, backend: str = "gloo") -> list:
    """Run fn(rank, tp_size, *args) in `tp_size` new processes that form a gloo group on 127.0.0.1
    -> [rank 0's result, ..., rank N-1's]. `fn` and `args` must pickle (a module-level function);
    each result is packed by torch.save (tensors, numbers, strings, and their containers).

    env: variables set in each rank before `fn` runs (after the imports its unpickling needs);
    threads: torch's intra-op threads per rank. backend: "gloo" (CPUs) or "nccl" (rank r on GPU r: the same
    code through NVIDIA's collectives). RankError when a rank raises, dies, or the group runs past
    `timeout` seconds; every rank is stopped before run_ranks returns or raises."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"tp_size={tp_size!r} is invalid: the number of ranks, a positive int")
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend={backend!r} is invalid: use \"gloo\" (CPUs) or \"nccl\" (one GPU a rank)")
    if backend == "nccl" and torch.cuda.device_count() < tp_size:
        raise ConfigError(f"backend='nccl' runs one GPU a rank, and this machine has {torch.cuda.device_count()} for "
                          f"{tp_size} ranks: use backend='gloo', or tp_size <= {torch.cuda.device_count()}")
    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="minigen-tp-") as folder:
        store_file = os.path.join(folder, "store")
        procs = [ctx.Process(target=rank_main, args=(rank, tp_size, store_file, timeout, env or {}, threads, fn,
                                                     args, answers, backend), name=f"minigen-rank-{rank}", daemon=True)
                 for rank in range(tp_size)]
        try:
            for p in procs:
                p.start()
            results, failures = collect(procs, answers, timeout, grace)
        finally:
            stop(procs)
            answers.close()
    if failures:
        first, *others = failures
        rank, why = first  # one line each, as every minigen error: the rank's own traceback stays in its stderr
        said = "; ".join(f"rank {r}: {w.splitlines()[0]}" for r, w in others)
        raise RankError(f"rank {rank} of {tp_size} failed: {why.splitlines()[0]}" +
                        (f"; the other ranks then said: {said}" if said else "") +
                        "; every rank of the group was stopped")
    return [unpacked(results[rank]) for rank in range(tp_size)]


def collect(procs: list, answers, timeout: float, grace: float) -> tuple[dict[int, bytes], list[tuple[int, str]]]:
    """Wait for every rank's answer -> ({rank: packed result}, [(rank, why)] in the order they failed).
    After the first failure the others have `grace` seconds; past `timeout` every rank still silent fails."""
    results: dict[int, bytes] = {}
    failures: dict[int, str] = {}
    silent: set[int] = set()  # ranks that ended without an answer: killed, the likeliest first cause
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < len(procs):
        try:
            rank, ok, answer = answers.get(timeout=POLL_S)
            if ok:
                results[rank] = answer
            else:
                failures[rank] = answer  # its own words win over "exited with status 1"
            continue
        except queue.Empty:
            pass
        for rank, p in enumerate(procs):  # a rank that ended without an answer (killed): say how
            if p.exitcode not in (None, 0) and rank not in results and rank not in failures:
                time.sleep(POLL_S)  # an answer put just before the exit may still be in the pipe
                if answers.empty():
                    failures[rank] = f"the process {died(p.exitcode)} without an answer"
                    silent.add(rank)
        now = time.monotonic()
        if failures and deadline > now + grace:
            deadline = now + grace  # the others are blocked on it: they have `grace` seconds to say so
        if now > deadline:
            for rank in range(len(procs)):
                if rank not in results and rank not in failures:
                    failures[rank] = (f"no answer within {timeout:g} s (the group's timeout)" if not failures
                                      else f"no answer within {grace:g} s of the first failure")
    # a killed rank is noticed by polling, maybe after its peers' errors about it: it goes first
    return results, sorted(failures.items(), key=lambda item: item[0] not in silent)


def stop(procs: list) -> None:
    """End every rank still running (SIGTERM, then SIGKILL after 2 s) and reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2)
        if p.is_alive():
            p.kill()
            p.join(2)
