"""Chapter 0 exercise: generation by hand from the package's three steps, with a stop rule.

`greedy_until(model, input_ids, n, stop_ids)`: return input_ids [1, T] followed by greedy tokens,
[1, T + k]: at most n of them, ending with the first token that is in `stop_ids` (kept, as
`generate` keeps it), or n tokens when none comes. Use only `make_cache`, `prefill`, `decode_step`
and `sample` (and a GenerationConfig). Decode steps feed one token [1, 1] at its position, a tensor
[1]. The chapter's section 7 runs four greedy steps by hand; the stop rule is yours. The checker
runs your function with minigen's own loops (`generate`, `stream`, `parallel_sample`, `run_steps`)
patched to raise: the exercise is to write the loop, not to call it.
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


def solution_greedy_until(model: Model, input_ids: torch.Tensor, n: int, stop_ids=()) -> torch.Tensor:
    """prefill the prompt, then one decode step per token kept, until a stop token or n tokens."""
    config = GenerationConfig(max_new_tokens=n)  # greedy: do_sample=False
    T = input_ids.shape[1]
    tokens = [input_ids]
    with torch.inference_mode():
        cache = make_cache(model, config, batch=1, max_len=T + n)
        logits = prefill(model, input_ids, cache)  # [1, V]
        for i in range(n):
            token = sample(logits, config)  # [1]
            tokens.append(token[:, None])
            if int(token) in stop_ids or i == n - 1:  # the stop token is kept; no step after it
                break
            logits = decode_step(model, token[:, None], torch.tensor([T + i]), cache)
    return torch.cat(tokens, dim=1)  # [1, T + k], k <= n


def _cases(model: Model, input_ids: torch.Tensor, n: int) -> list[tuple[str, tuple]]:
    """Stop sets drawn from the greedy continuation itself: none, the first token, a middle one, the last."""
    full = generate(model, input_ids, max_new_tokens=n, stop_token_ids=[]).tokens[0, input_ids.shape[1]:]
    never = next(t for t in range(model.config.vocab_size) if t not in set(full.tolist()))
    return [("no stop token", ()), (f"stop on new token 0 ({int(full[0])})", (int(full[0]),)),
            (f"stop on new token {n // 2} ({int(full[n // 2])})", (int(full[n // 2]), never)),
            (f"stop on the last token ({int(full[-1])})", (int(full[-1]),)),
            (f"a stop id that never comes ({never})", (never,))]


def check_greedy_until(fn, model: Model, input_ids: torch.Tensor, n: int = 8) -> bool:
    """fn(model, input_ids, n, stop_ids) -> [1, T + k], token-identical to minigen.generate with
    stop_token_ids=stop_ids, for several stop sets."""
    T, cases = input_ids.shape[1], _cases(model, input_ids, n)
    wants = [generate(model, input_ids, max_new_tokens=n, stop_token_ids=list(stop)).tokens for _, stop in cases]
    loops = (generate, stream, parallel_sample, run_steps) + (() if fn is solution_greedy_until
                                                             else (solution_greedy_until,))
    for (label, stop), want in zip(cases, wants):
        with forbidding(*loops):  # the package's loops raise while your answer runs
            got = fn(model, input_ids, n, stop)
        if not isinstance(got, torch.Tensor) or got.dim() != 2 or got.shape[0] != 1:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ExerciseFailed(f"greedy_until: for {label} expected a tensor [1, T + k], got {shape}")
        if not torch.equal(got[:, :T], input_ids):
            raise ExerciseFailed("greedy_until: return the prompt first, then the new tokens")
        k, k_want = got.shape[1] - T, want.shape[1] - T
        diff = (got[0, T:T + min(k, k_want)] != want[0, T:T + min(k, k_want)]).nonzero()
        if len(diff):
            i = int(diff[0])
            hint = (" Hint: decode step i feeds the token sampled last at position T + i, not T + i + 1."
                    if i > 0 else " Hint: the first token comes from the prefill's logits.")
            raise ExerciseFailed(f"greedy_until: for {label} new token {i} is {int(got[0, T + i])}, "
                                 f"generate gives {int(want[0, T + i])}.{hint}")
        if k != k_want:
            hint = (" Hint: keep the stop token, and stop right after it" if stop and k == k_want - 1 or k > k_want
                    else " Hint: at most n new tokens, and only a token in stop_ids ends early")
            raise ExerciseFailed(f"greedy_until: for {label} you returned {k} new tokens, generate returns "
                                 f"{k_want}.{hint}")
    print(f"✓ greedy_until: all {len(cases)} stop sets give generate's tokens")
    return True
