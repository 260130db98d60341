"""Chapter 0 exercise: generation by hand from the package's three steps.

`greedy_by_hand(model, input_ids, n)`: return input_ids [1, T] followed by n greedy tokens,
[1, T + n], using only `make_cache`, `prefill`, `decode_step` and `sample` from minigen.generate
(and a GenerationConfig). Decode steps feed one token [1, 1] at its position, a tensor [1].
The checker runs your function with minigen's own loops (`generate`, `stream`, `parallel_sample`,
`run_steps`) patched to raise: the exercise is to write the loop, not to call it.
"""

from __future__ import annotations

import torch

from ...config import GenerationConfig
from ...caches.make import make_cache
from ...generate import generate, parallel_sample, run_steps, stream
from ...sampling import sample
from ...steps.eager import decode_step, prefill
from ...model import Model
from . import ExerciseFailed, forbidding


def solution_greedy_by_hand(model: Model, input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """prefill the prompt, then n - 1 decode steps, each fed the token just sampled."""
    config = GenerationConfig(max_new_tokens=n)  # greedy: do_sample=False
    T = input_ids.shape[1]
    tokens = [input_ids]
    with torch.inference_mode():
        cache = make_cache(model, config, batch=1, max_len=T + n)
        logits = prefill(model, input_ids, cache)  # [1, V]
        for i in range(n):
            token = sample(logits, config)  # [1]
            tokens.append(token[:, None])
            if i < n - 1:
                logits = decode_step(model, token[:, None], torch.tensor([T + i]), cache)
    return torch.cat(tokens, dim=1)  # [1, T + n]


def check_greedy_by_hand(fn, model: Model, input_ids: torch.Tensor, n: int = 8) -> bool:
    """fn(model, input_ids, n) -> [1, T + n], token-identical to minigen.generate (greedy, no stop)."""
    want = generate(model, input_ids, max_new_tokens=n, stop_token_ids=[]).tokens
    loops = (generate, stream, parallel_sample, run_steps) + (() if fn is solution_greedy_by_hand
                                                             else (solution_greedy_by_hand,))
    with forbidding(*loops):  # the package's loops raise while your answer runs
        got = fn(model, input_ids, n)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ExerciseFailed(f"greedy_by_hand: expected a tensor of shape {tuple(want.shape)} "
                             f"(the prompt followed by {n} tokens), got {shape}")
    T = input_ids.shape[1]
    if not torch.equal(got[:, :T], input_ids):
        raise ExerciseFailed("greedy_by_hand: return the prompt first, then the new tokens")
    diff = (got[0, T:] != want[0, T:]).nonzero()
    if len(diff):
        i = int(diff[0])
        hint = (" Hint: decode step i feeds the token sampled last at position T + i, not T + i + 1."
                if i > 0 else " Hint: the first token comes from the prefill's logits.")
        raise ExerciseFailed(f"greedy_by_hand: new token {i} is {int(got[0, T + i])}, "
                             f"generate gives {int(want[0, T + i])}.{hint}")
    print(f"✓ greedy_by_hand: {n} tokens identical to minigen.generate")
    return True
