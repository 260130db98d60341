"""A replayable synthetic serving workload (chapter 14), and a replayer that drives an engine with it.

    make_workload(n, rate_per_s, seed=0, system_prompt=ids)  -> Workload (same seed: same workload)
    replay(engine, workload)                                 -> engine.metrics(), after a replay

The distributions, stated:
- arrivals: a Poisson process of `rate_per_s` requests per second: the gaps between arrivals are
  independent exponentials of mean 1 / rate_per_s, and the first request arrives at t = 0.
- lengths: lognormal, clipped: round(exp(N(ln median, sigma))), then clipped to [low, high]. A
  lognormal is the usual fit of chat prompt and reply lengths (many short, a long tail).
- prompts: the shared `system_prompt` (e.g. SmolLM2's tokens of a system message; prefix caching
  serves it from cached blocks after the first request), then the user's part: a slice of
  `token_pool` (real text's token ids) at a random offset, or uniform random ids in `vocab`.
Everything comes from one numpy Generator seeded with `seed`.

The replayer needs only the Engine's API: `add_request(prompt_ids, arrival_s=..., max_new_tokens=...)`,
`step()`, `run()`, `metrics()`. It adds every request once its arrival time has come on the
engine's clock and steps the engine in between. With `skip_idle=True` a wait with nothing to run
is skipped (the rest of the schedule moves earlier by the gap): an idle server only waits, so its
latencies stay the same and the run takes less wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from ..errors import ConfigError

# A step shorter than this ran no model: the engine had nothing to do (a decode step of a
# 135M-parameter model takes milliseconds even on a GPU).
IDLE_STEP_S = 5e-4


@dataclass(frozen=True)
class LengthDist:
    """Lognormal lengths clipped to [low, high] tokens: round(exp(N(ln median, sigma)))."""
    median: float  # tokens: the distribution's median before clipping
    sigma: float  # spread of ln(length); 0: every length is the median
    low: int  # the shortest length drawn (>= 1)
    high: int  # the longest length drawn

    def __post_init__(self):
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.low <= self.high):
            raise ConfigError(f"LengthDist(median={self.median}, sigma={self.sigma}, low={self.low}, high={self.high}) "
                              "is invalid: use median > 0, sigma >= 0 and 1 <= low <= high")

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        raw = np.exp(rng.normal(np.log(self.median), self.sigma, size=n))
        return [int(x) for x in np.clip(np.rint(raw), self.low, self.high)]


@dataclass(frozen=True)
class WorkloadRequest:
    arrival_s: float  # seconds after the workload's start
    prompt_ids: tuple[int, ...]  # the system prompt, then the user's tokens
    max_new_tokens: int  # the reply length drawn for it


@dataclass
class Workload:
    requests: list[WorkloadRequest]  # in arrival order
    rate_per_s: float
    seed: int
    system_prompt_tokens: int
    description: str = field(default="")

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)


def make_workload(n_requests: int, rate_per_s: float, *, seed: int = 0, system_prompt: Sequence[int] = (),
                  prompt_tokens: LengthDist = LengthDist(48, 0.6, 4, 256),
                  output_tokens: LengthDist = LengthDist(24, 0.5, 2, 128),
                  token_pool: Sequence[int] | None = None, vocab: tuple[int, int] = (100, 49152)) -> Workload:
    """n_requests requests arriving as a Poisson process of rate_per_s per second; `prompt_tokens`
    is the user's part, after the shared `system_prompt`. Same arguments, same workload."""
    if not isinstance(n_requests, int) or n_requests < 1:
        raise ConfigError(f"n_requests={n_requests!r} is invalid: use an integer >= 1")
    if not rate_per_s > 0:
        raise ConfigError(f"rate_per_s={rate_per_s!r} is invalid: use a number > 0 (requests per second)")
    if token_pool is not None and len(token_pool) < prompt_tokens.high:
        raise ConfigError(f"token_pool has {len(token_pool)} tokens, fewer than the longest prompt "
                          f"({prompt_tokens.high}): pass more text or lower prompt_tokens.high")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_per_s, size=n_requests)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    lengths, replies = prompt_tokens.draw(rng, n_requests), output_tokens.draw(rng, n_requests)
    system = tuple(int(t) for t in system_prompt)
    requests = []
    for arrival, n, reply in zip(arrivals, lengths, replies):
        if token_pool is not None:
            start = int(rng.integers(0, len(token_pool) - n + 1))
            user = tuple(int(t) for t in token_pool[start:start + n])
        else:
            user = tuple(int(t) for t in rng.integers(vocab[0], vocab[1], size=n))
        requests.append(WorkloadRequest(float(arrival), system + user, reply))
    text = (f"{n_requests} requests, Poisson arrivals at {rate_per_s:g}/s, seed {seed}; prompt = {len(system)} "
            f"system tokens + lognormal(median {prompt_tokens.median:g}, sigma {prompt_tokens.sigma:g}) clipped to "
            f"[{prompt_tokens.low}, {prompt_tokens.high}]; output lognormal(median {output_tokens.median:g}, sigma "
            f"{output_tokens.sigma:g}) clipped to [{output_tokens.low}, {output_tokens.high}]")
    return Workload(requests, rate_per_s, seed, len(system), text)


def system_prompt_ids(tokenizer, text: str = "You are a helpful assistant. Answer briefly and precisely, "
                      "in plain English, and say so when you do not know.") -> list[int]:
    """The token ids of a system message in the tokenizer's chat template (SmolLM2's), for the
    workload's shared prefix."""
    return list(tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=True,
                                              return_dict=True)["input_ids"])


# ---------------------------------------------------------------- replaying
class ServingEngine(Protocol):
    """What the replayer drives: minigen.Engine, and the transformers baselines in serve_bench.py."""
    def add_request(self, prompt_ids, *, arrival_s: float | None = None, max_new_tokens: int | None = None) -> int: ...
    def step(self): ...
    def run(self) -> dict: ...
    def metrics(self) -> dict: ...


def replay(engine: ServingEngine, workload: Workload, *, clock: Callable[[], float] | None = None,
           skip_idle: bool = True, sleep: Callable[[float], None] = time.sleep) -> dict:
    """Add the workload's requests to `engine` in arrival order as their times come, stepping the
    engine in between; then run it dry and return engine.metrics().

    clock: the engine's clock in seconds (Engine.now: t = 0 at its creation); each request is added with
    arrival_s = its time on that clock. None: the replayer's own clock from its call, and
    requests are added without arrival_s (the engine stamps them when added, at most one step late).
    skip_idle: when the engine has nothing to run, jump to the next arrival instead of sleeping.
    """
    start = time.perf_counter()
    now = clock or (lambda: time.perf_counter() - start)
    offset = now()  # the workload's t = 0 on the engine's clock; moves earlier by every skipped gap
    for request in workload.requests:
        while now() < offset + request.arrival_s:
            t = time.perf_counter()
            engine.step()
            if time.perf_counter() - t < IDLE_STEP_S:  # nothing ran: idle until this arrival
                wait = offset + request.arrival_s - now()
                if skip_idle:
                    offset -= max(wait, 0.0)
                else:
                    sleep(max(min(wait, 0.05), 0.0))
        arrival = {"arrival_s": offset + request.arrival_s} if clock else {}
        engine.add_request(list(request.prompt_ids), max_new_tokens=request.max_new_tokens, **arrival)
    engine.run()
    return engine.metrics()
