"""The panels open on a view that teaches (issue 26, 6a): chapter 07's window panel opens on a head
whose window and sinks both show, chosen by measuring (widgets.teaching_head), on a log colour scale
whose floor is stated, and the book's static snapshot of the panel shows the same numbers."""

from __future__ import annotations

import re

import pytest
import torch
from ipywidgets.embed import dependency_state

from minigen.course.widgets import (LOG_FLOOR, SATURATED, map_structure, snapshot_html, teaching_head,
                                    window_numbers, window_panel)

pytestmark = pytest.mark.usefixtures("one_thread")

N_MAP = 96  # the tokens chapter 07's panel shows
ENTROPY_FLOOR = 1.0  # nats: a head reading only token 0 has ~0; reading 36 keys evenly, log 36 = 3.6
STRUCTURE_FLOOR = 0.15  # share of pixels neither black nor saturated; the window band is ~30% of the map


def test_map_structure_counts_pixels_neither_black_nor_saturated():
    one_token = torch.zeros(4, 4)
    one_token[:, 0] = 1.0  # a head that reads only token 0: one saturated column, the rest black
    assert map_structure(one_token) == 0.0
    even = torch.tril(torch.ones(4, 4))
    even = even / even.sum(-1, keepdim=True)  # reads every visible key evenly: 1, 1/2, 1/3, 1/4
    assert map_structure(even) == 9 / 16  # the 9 entries below SATURATED and above the floor
    assert LOG_FLOOR < 1 / 64 and SATURATED < 1  # a window of up to 64 keys read evenly shows


def test_window_panel_opens_on_a_head_that_shows_its_window_and_sinks(smollm2, english_text_ids):
    model, _ = smollm2
    ids = english_text_ids[:N_MAP]
    layer, head = teaching_head(model, ids)
    shown = window_numbers(model, ids, 32, 4, layer, head)  # the panel's default window and sinks
    assert shown["entropy"].mean() > ENTROPY_FLOOR, (layer, head, shown["entropy"].mean())
    assert shown["structure"] >= STRUCTURE_FLOOR, (layer, head, shown["structure"])
    assert 0.1 <= shown["probs"][32:, :4].sum(-1).mean() <= 0.9  # the sinks get a visible share
    # The view the issue found: layer 18, head 8 reads only token 0 (a black map, entropy 0.00 nats).
    sink_only = window_numbers(model, ids, 32, 4, 18, 8)
    assert sink_only["entropy"].mean() < 0.01 and sink_only["structure"] < STRUCTURE_FLOOR

    panel = window_panel(model, ids)  # no layer or head: it measures them
    assert (panel.children[1].children[0].value, panel.children[1].children[1].value) == (layer, head)
    live = panel.children[2].value
    snapshot = snapshot_html(dependency_state(panel, drop_defaults=False), panel.model_id)  # as the book saves it
    assert live in snapshot
    entropy = float(re.search(rf"layer {layer}, head {head}: ([\d.]+) nats", snapshot).group(1))
    assert entropy > ENTROPY_FLOOR, snapshot
