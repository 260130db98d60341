"""No host work per token under cuda_graphs (steps/graphs.py's device loop), checked on the CPU.

The CUDA calls the graphed step makes are replaced by CPU stand-ins: a "graph" that records the
function it is given and runs it at every replay, streams that do nothing, and a device check
that passes. What runs is the real loop: generate -> run_steps -> GraphedStep.decode_loop ->
CudaGraphDecoder (the step, sampling, the stop check and the position's advance, all through
fixed buffers). Every host read of a tensor (.item, .tolist, .cpu, .numpy, int, bool, float,
index) is counted, and so is every replay.

Oracles: (1) the event sequence: after the capture, N = STOP_CHECK_EVERY replays with no host read
among them, then exactly one read, and so on, the last chunk cut short; (2) an injected .item() in
sampling is caught; (3) the tokens equal the eager loop's, greedy and seeded sampling, with stops
that end rows mid-chunk, at a chunk's end, and all rows before max_new_tokens.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen.caches import contiguous, window
from minigen.sampling import sample
from minigen.steps import graphs

pytestmark = [pytest.mark.usefixtures("one_thread")]
N = graphs.STOP_CHECK_EVERY
SYNCS = ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__")
generate_module = importlib.import_module("minigen.run_plan")  # where the plan chooses its step


@pytest.fixture(scope="module")
def tiny():
    return minigen.from_hf(tiny_hf("llama"))


def prompts(B: int = 2, T: int = 6) -> torch.Tensor:
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(0))


class FakeGraph:
    """torch.cuda.CUDAGraph on the CPU: `capture` hands it the step function; replay runs it."""

    def __init__(self, events: list):
        self.fn, self.events = None, events

    def register_generator_state(self, generator) -> None:
        pass  # the function draws from the generators itself at each replay, as eager does

    def replay(self) -> None:
        self.events.append("replay")
        self.fn()


class FakeStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def graphed(monkeypatch):
    """Run generate's decode through GraphedStep on the CPU; returns the events list, where each
    replay appends "replay" and each host read its method's name (only while `events` is armed:
    it is armed once the graph is captured)."""
    events: list = []
    armed = [False]
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeGraph(events))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(graphs, "require_cuda", lambda model: None)
    # caches/contract.check_fits reads positions that sit in host memory, and returns at once for
    # positions on a GPU: the stand-in device is the CPU, so give the caches the GPU's answer.
    for module in (contiguous, window):
        monkeypatch.setattr(module, "check_fits", lambda input_pos, capacity: None)

    def fake_capture(graph, fn):  # a capture records the kernels and runs none of them
        graph.fn = fn
        armed[0] = True

    monkeypatch.setattr(graphs, "capture", fake_capture)
    for name in SYNCS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            if armed[0]:
                events.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    sampler = [sample]

    def choose(model, config, batch, observers, sample_fn, generators, **kwargs):
        return graphs.GraphedStep(lambda *a: sampler[0](*a), config, generators)

    monkeypatch.setattr(generate_module, "choose_step", choose)
    return events, sampler


def chunks_of(events: list) -> list[tuple[int, list[str]]]:
    """The events after the capture as (replays, host reads after them) pairs."""
    out: list[tuple[int, list[str]]] = []
    replays, reads = 0, []
    for e in events:
        if e == "replay":
            if reads:
                out.append((replays, reads))
                replays, reads = 0, []
            replays += 1
        else:
            reads.append(e)
    out.append((replays, reads))
    return out


def test_no_host_read_between_stop_checks(tiny, graphed):
    """max_new_tokens = 1 + 2N + 5 with no stop: the first token, two full chunks and one of 5,
    each followed by exactly one host read (the status), and no read inside a chunk."""
    events, _ = graphed
    out = minigen.generate(tiny, prompts(), max_new_tokens=1 + 2 * N + 5, stop_token_ids=[])
    assert out.tokens.shape[1] == 6 + 1 + 2 * N + 5
    assert chunks_of(events) == [(N, ["tolist"]), (N, ["tolist"]), (5, ["tolist"])]
    s = out.stats
    assert s.new_tokens == 1 + 2 * N + 5 and len(s.token_latencies_s) == s.new_tokens
    assert s.decode_tokens_per_s > 0 and s.step == "graphed"


def test_an_injected_item_is_caught(tiny, graphed):
    """The count can fail: a sampler that reads one value per token shows one read per replay."""
    events, sampler = graphed
    sampler[0] = lambda logits, config, gens: (logits[0, 0].item(), sample(logits, config, gens))[1]
    minigen.generate(tiny, prompts(), max_new_tokens=1 + N, stop_token_ids=[])
    assert chunks_of(events) != [(N, ["tolist"])]
    assert events.count("item") == N


def stop_where(eager: torch.Tensor, T: int, picks: list[tuple[int, int]]) -> list[int]:
    """The tokens eager produced at (row, new-token index) picks: stop ids that end those rows there."""
    return sorted({int(eager[r, T + i]) for r, i in picks})


@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.9, "top_k": 30, "top_p": 0.9, "seed": 5}],
                         ids=["greedy", "seeded sampling"])
@pytest.mark.parametrize("picks", [[(0, 5)], [(0, N)], [(0, 3), (1, N + 2)], [(1, 0)]],
                         ids=["one row mid-chunk", "chunk end", "both rows", "first token"])
def test_tokens_equal_the_eager_loop(tiny, graphed, sampling, picks):
    """Stops that end rows mid-chunk, at a chunk's last token, every row early, and at the first
    token: the output is the eager loop's, cut where it stops, finished rows padded with their stop."""
    events, _ = graphed
    ids, n = prompts(), 3 * N
    graphed_gen = generate_module.choose_step
    with pytest.MonkeyPatch.context() as mp:  # the eager loop, to pick stop tokens and to compare
        mp.setattr(generate_module, "choose_step", graphs_free_choose)
        free = minigen.generate(tiny, ids, max_new_tokens=n, stop_token_ids=[], **sampling).tokens
        stops = stop_where(free, ids.shape[1], picks)
        eager = minigen.generate(tiny, ids, max_new_tokens=n, stop_token_ids=stops, **sampling)
    assert generate_module.choose_step is graphed_gen
    out = minigen.generate(tiny, ids, max_new_tokens=n, stop_token_ids=stops, **sampling)
    assert torch.equal(out.tokens, eager.tokens)
    assert out.stats.new_tokens == eager.stats.new_tokens


REAL_CHOOSE = generate_module.choose_step


def graphs_free_choose(*args, **kwargs):
    return REAL_CHOOSE(*args, **kwargs)


def test_ring_buffer_window_equals_eager_with_no_read_between_checks(tiny, graphed):
    """The windowed ring cache (its slots wrap) through the device loop: eager's tokens, the same
    one read per chunk."""
    events, _ = graphed
    kw = dict(max_new_tokens=1 + N + 3, stop_token_ids=[], window_size=5, sink_tokens=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generate_module, "choose_step", graphs_free_choose)
        eager = minigen.generate(tiny, prompts(), **kw).tokens
    assert torch.equal(minigen.generate(tiny, prompts(), **kw).tokens, eager)
    assert chunks_of(events) == [(N, ["tolist"]), (3, ["tolist"])]
