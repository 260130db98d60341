"""The article's batching (minigen/batching.py): grouping by length loses nothing, the queue keeps
FIFO order and refuses or blocks when full without dropping, padding is what a plain count says."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minigen import ConfigError, PromptError, QueueFullError
from minigen.serving.batching import PAD_CAP, RequestQueue, group_by_length, pad_batch, padding_waste

lengths_st = st.lists(st.integers(1, 600), min_size=1, max_size=40)


# ---------------------------------------------------------------- grouping and padding
@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 9))
def test_grouping_loses_nothing_and_caps_padding(lengths, max_batch_size):
    batches = group_by_length(lengths, max_batch_size)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # every request once: none lost, none doubled
    for b in batches:
        assert 1 <= len(b) <= max_batch_size
        if max(lengths[i] for i in b) > PAD_CAP:
            assert len(b) == 1  # a prompt past the cap runs alone, unpadded (never truncated)
    short = [i for i in flat if lengths[i] <= PAD_CAP]
    assert [lengths[i] for i in short] == sorted(lengths[i] for i in short)  # grouped by length
    for a, b in zip(short, short[1:]):  # equal lengths keep their arrival order
        if lengths[a] == lengths[b]:
            assert a < b


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 9), st.integers(0, 4096))
def test_waste_formula_against_a_plain_count(lengths, max_batch_size, kv_per_token):
    """Build each padded batch for real and count its pad slots one by one."""
    lengths = [min(n, 40) for n in lengths]  # small tensors; the cap is covered above
    batches = group_by_length(lengths, max_batch_size)
    pads = slots = 0
    for b in batches:
        padded = pad_batch([[7] * lengths[i] for i in b], pad_id=0)
        for row in padded.tokens.tolist():
            for token in row:
                slots += 1
                pads += token == 0
    waste = padding_waste(lengths, batches, kv_bytes_per_token=kv_per_token)
    assert (waste.pad_slots, waste.total_slots, waste.kv_bytes) == (pads, slots, pads * kv_per_token)
    assert waste.fraction == pytest.approx(pads / slots)
    # Not asserted: that sorting always pads less than arrival order. It does not: lengths [1, 2, 2, 1]
    # in batches of 3 pad 2 slots sorted ([1, 1, 2], [2]) and 1 in arrival order ([1, 2, 2], [1]).


def test_pad_batch_left_pads_to_the_longest():
    batch = pad_batch([torch.tensor([5, 6, 7]), [9]], pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.lengths == [3, 1] and batch.pad_tokens == 2


def test_a_prompt_past_the_cap_runs_alone_and_whole():
    long = list(range(1, 301))
    assert pad_batch([long]).tokens.tolist() == [long]  # alone: whole, unpadded
    assert group_by_length([300, 10, 12], 8) == [[1, 2], [0]]
    with pytest.raises(PromptError, match="longer than the padding cap of 256"):
        pad_batch([long, [1, 2]])


def test_padding_waste_counts_kv_bytes_of_a_model():
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x K and V x 4 bytes = 46,080 bytes a token
    waste = padding_waste([10, 4, 1], kv_bytes_per_token=2 * 30 * 3 * 64 * 4)
    assert (waste.pad_slots, waste.total_slots) == (6 + 9, 30)
    assert waste.kv_bytes == 15 * 46_080 and waste.fraction == 0.5


# ---------------------------------------------------------------- the ring buffer
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.lists(st.one_of(st.just("get"), st.integers(1, 4)), max_size=60))
def test_queue_is_fifo_and_drops_nothing(capacity, ops):
    """Random puts (a refused one is retried later) and gets of 1-4: what comes out is exactly
    what went in, in order, and the ring never holds more than its capacity."""
    queue, model = RequestQueue(capacity), []
    pending, taken, next_id = [], [], 0
    for op in ops:
        if op == "get":
            got = queue.get(2)
            assert got == model[:2]
            taken += got
            model = model[2:]
        else:
            pending += list(range(next_id, next_id + op))
            next_id += op
            while pending:
                try:
                    queue.put(pending[0])
                except QueueFullError:
                    assert len(queue) == capacity == len(model)
                    break
                model.append(pending.pop(0))
        assert queue.peek() == model and len(queue) <= capacity
    while pending or len(queue):  # drain: every request comes out, once, in order
        taken += queue.get(capacity)
        while pending and not queue.full():
            queue.put(pending.pop(0))
    assert taken == list(range(next_id))


def test_full_queue_refuses_with_the_numbers():
    queue = RequestQueue(3)
    for i in range(3):
        queue.put(i)
    with pytest.raises(QueueFullError, match="3 of 3 slots wait; nothing was dropped"):
        queue.put(3)
    assert queue.get(5) == [0, 1, 2]


def test_blocking_put_waits_for_a_slot():
    queue = RequestQueue(1)
    queue.put("first")
    taker = threading.Timer(0.05, queue.get)
    taker.start()
    start = time.monotonic()
    queue.put("second", block=True, timeout=10)  # returns once the timer took "first"
    assert time.monotonic() - start >= 0.04 and queue.peek() == ["second"]
    taker.join()


def test_blocking_put_times_out_without_dropping():
    queue = RequestQueue(1)
    queue.put("first")
    with pytest.raises(QueueFullError, match="stayed full for 0.02 s"):
        queue.put("second", block=True, timeout=0.02)
    assert queue.peek() == ["first"]


@pytest.mark.parametrize("call, fragment", [
    (lambda: RequestQueue(True), "use an integer >= 1"),
    (lambda: RequestQueue(2).put(1, timeout=1.0), "needs block=True"),
    (lambda: RequestQueue(2).get(0), "integer >= 1"),
    (lambda: group_by_length([3], 0), "must both be >= 1"),
])
def test_bad_settings_are_config_errors(call, fragment):
    with pytest.raises(ConfigError, match=fragment):
        call()
