"""Speculative decoding (chapter 15): propose k tokens, verify them in one forward, keep what the
target agrees with.

Oracles: plain greedy decoding (the same config without speculative_method), token for token, on
every cache the combination table applies speculation to; each row of a batch generated alone.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import drafts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return minigen.from_hf(tiny_hf("llama"))


def repeating(n: int, seed: int, vocab: int = 97) -> torch.Tensor:
    """A prompt [1, 2.5 n] that says n random tokens twice and starts a third time: prompt lookup
    finds n-grams to propose from."""
    base = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([base, base, base[:n // 2]])[None]


# ---------------------------------------------------------------- regressions
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_draft_cache_counted_its_unfed_last_proposal(tiny, k):
    # The draft feeds itself all of its k proposals but the last (the target checks that one), yet
    # DraftProposer.accepted counted every accepted proposal as cached: when all k were accepted its
    # cache skipped a position, and its next proposals read a stale key there. The target as its own
    # draft agrees with every greedy proposal, so its acceptance rate is exactly 1 (it was 0.73 to
    # 0.86 here), in a batch too.
    prompt = repeating(7, seed=0)
    kw = dict(max_new_tokens=20, stop_token_ids=[], speculative_method="draft", num_speculative_tokens=k,
              draft_model=tiny)
    alone = minigen.generate(tiny, prompt, **kw).stats
    assert alone.draft_tokens > 0 and alone.acceptance_rate == 1.0, (alone.draft_tokens, alone.accepted_tokens)
    rows = minigen.generate(tiny, [prompt[0], prompt[0, :5]], **kw).stats
    assert rows.draft_tokens > 0 and rows.acceptance_rate == 1.0, (rows.draft_tokens, rows.accepted_tokens)
