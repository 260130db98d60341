"""Chapter 2's exercise, the learner's KV cache: the worked solution passes; each usual mistake
(positions off by one, a missing layer index, writing in storage order) fails with its own name;
an answer that hands its work to minigen's KVCache fails, naming it."""

from __future__ import annotations

import pytest
import torch

from minigen.caches.contiguous import KVCache
from minigen.caches.contract import key_positions
from minigen.course.distributions import tiny_llama
from minigen.course.exercises import ExerciseFailed, ch02


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=32, n_layers=3)


PROMPT = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


class Right(ch02.ContiguousShell):
    """The answer written out here (the checker forbids the worked solution's own methods)."""

    def prepare(self, input_pos):
        self.input_pos = input_pos
        return key_positions(torch.arange(self.max_len))

    def update(self, layer, k, v):
        self.k[layer][:, :, self.input_pos] = k
        self.v[layer][:, :, self.input_pos] = v
        return self.k[layer], self.v[layer]


class ShiftedWrite(Right):
    def update(self, layer, k, v):  # the slot after the position: the "next slot" habit
        self.k[layer][:, :, self.input_pos + 1] = k
        self.v[layer][:, :, self.input_pos + 1] = v
        return self.k[layer], self.v[layer]


class ShiftedPositions(Right):
    def prepare(self, input_pos):  # slot s said to hold position s + 1
        self.input_pos = input_pos
        return key_positions(torch.arange(self.max_len) + 1)


class OneBuffer(Right):
    def update(self, layer, k, v):  # no layer index: every layer writes layer 0's storage
        self.k[0][:, :, self.input_pos] = k
        self.v[0][:, :, self.input_pos] = v
        return self.k[0], self.v[0]


class StorageOrder(Right):
    """Appends after the last slot written, a counter instead of input_pos: right for one sequence."""

    def __init__(self, *args, **kwargs):
        Right.__init__(self, *args, **kwargs)
        self.written = 0

    def prepare(self, input_pos):
        self.slots = torch.arange(self.written, self.written + len(input_pos))
        self.written += len(input_pos)
        return key_positions(torch.arange(self.max_len))

    def update(self, layer, k, v):
        self.k[layer][:, :, self.slots] = k
        self.v[layer][:, :, self.slots] = v
        return self.k[layer], self.v[layer]


class Delegating(ch02.ContiguousShell):
    """Hands its work to minigen's own cache."""

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, *rest):
        ch02.ContiguousShell.__init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, *rest)
        self.inner = KVCache(n_layers, batch, n_kv_heads, max_len, head_dim, *rest)

    def prepare(self, input_pos):
        return self.inner.prepare(input_pos)

    def update(self, layer, k, v):
        return self.inner.update(layer, k, v)


def test_the_worked_solution_and_a_written_answer_pass(model):
    assert ch02.check_kv_cache(ch02.SolutionKVCache, model, PROMPT)
    assert ch02.check_kv_cache(Right, model, PROMPT)


@pytest.mark.parametrize("answer, name", [
    (ShiftedWrite, "positions off by one"),
    (ShiftedPositions, "positions off by one"),
    (OneBuffer, "a missing layer index"),
    (StorageOrder, "writing in storage order instead of at input_pos"),
])
def test_each_usual_mistake_fails_with_its_name(model, answer, name):
    with pytest.raises(ExerciseFailed, match=name):
        ch02.check_kv_cache(answer, model, PROMPT)


def test_the_storage_order_mistake_also_changes_tokens_of_a_reused_cache(model):
    # the probe names it; without the probe, generation alone catches it too: the second prompt starts at 0
    prompts = [PROMPT, PROMPT[:, :4].flip(1)]
    want = ch02.greedy_tokens(model, prompts, 6, KVCache.for_model(model, 1, 14))
    with pytest.raises(Exception):  # slots run out, or the second prompt reads the first one's keys
        got = ch02.greedy_tokens(model, prompts, 6, StorageOrder(3, 1, 2, 14, 8))
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_an_answer_that_delegates_to_minigens_kvcache_fails(model):
    with pytest.raises(ExerciseFailed, match="minigen's own KVCache"):
        ch02.check_kv_cache(Delegating, model, PROMPT)


def test_an_answer_that_inherits_minigens_update_fails(model):
    class Inherits(KVCache):
        pass
    with pytest.raises(ExerciseFailed, match="minigen's own KVCache"):
        ch02.check_kv_cache(Inherits, model, PROMPT)


def test_an_unwritten_answer_fails_naming_what_prepare_returns(model):
    class Blank(ch02.ContiguousShell):
        def prepare(self, input_pos):
            return None

        def update(self, layer, k, v):
            return None
    with pytest.raises(ExerciseFailed, match="prepare returned NoneType"):
        ch02.check_kv_cache(Blank, model, PROMPT)
