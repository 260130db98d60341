"""Serving benchmark (chapter 14): one synthetic workload (workload.py) replayed through minigen's
Engine and through transformers' own batched generation on the same weights, side by side.

    StaticBatches(hf_model)          transformers `generate` on static batches, left-padded, in
                                     arrival order: the batch runs until its longest reply is done
    TransformersContinuous(hf_model) transformers' continuous batching (ContinuousBatchingManager,
                                     transformers 5.x), which runs on a CPU but slowly (see below)
    run_serve_bench(...)             -> {"workload", "runs": {name: metrics}, "ratios"}

Both adapters have the Engine's API (add_request, step, run, metrics) and return the Engine's
metrics dict where it applies (serving.summarize), so workload.replay drives all of them the same
way. Greedy decoding with no stop token: every request generates exactly its max_new_tokens, on
every engine. A static batch hands each row's tokens out as they are made (the time of its k-th
token is the batch's k-th step), the kindest reading for it.

transformers' continuous batching runs on this 2-core CPU (transformers 5.24; the default
attention becomes its paged SDPA), and its greedy tokens match `generate`'s. Its speed on a shared
machine swings from run to run more than minigen's (its thread waits in the model's linear layers
when a neighbour holds a core), so compare engines within one run, as the ratios printed here do.
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch

from ..serving.batching import pad_batch
from .bench import prompt_ids
from ..config import GenerationConfig
from ..serving.engine import Engine
from ..loading import load, load_tokenizer, resolve_folder
from .machine import hardware_info
from ..errors import BenchError
from ..paths import check_fits
from ..paths import bar
from ..serving.metrics import summarize
from ..serving.workload import LengthDist, Workload, make_workload, replay, system_prompt_ids


def load_hf(model_name: str = "smollm2-135m", dtype: torch.dtype = torch.float32):
    """transformers' model of minigen's converted checkpoint (the folder `minigen.load` reads), as bench.py does."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_folder(model_name)), dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # every request runs its own max_new_tokens, as in minigen
    hf.generation_config.pad_token_id = 0
    return hf


class _StepTimes:
    """A logits processor that only records when each generation step's logits are ready."""

    def __init__(self, clock):
        self.clock, self.times = clock, []

    def __call__(self, input_ids, scores):
        self.times.append(self.clock())
        return scores


class StaticBatches:
    """transformers `generate` over static batches of up to max_batch_size waiting requests, oldest
    first, with the Engine's API (add_request, step, run, metrics). step() runs one whole batch (prefill
    and every decode step) and returns its request ids. A subclass runs batches on another generator by
    overriding run_batch and default_new_tokens (minigen.course.replay.StaticGenerate)."""

    def __init__(self, hf_model, max_batch_size: int = 8, pad_id: int = 0):
        self.hf, self.max_batch_size, self.pad_id = hf_model, max_batch_size, pad_id
        self.t0 = time.perf_counter()
        self.waiting: deque = deque()  # (id, prompt, max_new_tokens, arrival_s), oldest first
        self.records: list[dict] = []
        self.steps: list[dict] = []
        self.outputs: dict[int, torch.Tensor] = {}
        self.next_id = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def default_new_tokens(self) -> int:
        return self.hf.generation_config.max_new_tokens

    def add_request(self, prompt_ids, *, arrival_s: float | None = None, max_new_tokens: int | None = None) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        n = self.default_new_tokens() if max_new_tokens is None else max_new_tokens
        self.waiting.append((rid, [int(t) for t in prompt_ids], n, self.now() if arrival_s is None else arrival_s))
        return rid

    def run_batch(self, batch: list[tuple], longest: int) -> tuple[list[float], list[torch.Tensor], int]:
        """Generate `longest` tokens for every row of the batch -> (the clock when each of the batch's
        tokens was ready, each row's prompt + its own max_new_tokens, the prompt tokens computed)."""
        padded = pad_batch([b[1] for b in batch], self.pad_id, pad_cap=self.hf.config.max_position_embeddings)
        times = _StepTimes(self.now)
        with torch.inference_mode():
            out = self.hf.generate(padded.tokens, attention_mask=padded.attention_mask, max_new_tokens=longest,
                                   min_new_tokens=longest, do_sample=False, logits_processor=[times])
        L = padded.tokens.shape[1]
        rows = [torch.cat([torch.tensor(prompt), out[row, L:L + n]]) for row, (_, prompt, n, _) in enumerate(batch)]
        return times.times, rows, padded.tokens.numel()

    def step(self) -> list[int]:
        if not self.waiting:
            return []
        batch = [self.waiting.popleft() for _ in range(min(self.max_batch_size, len(self.waiting)))]
        scheduled = self.now()
        times, rows, prefill_tokens = self.run_batch(batch, max(b[2] for b in batch))
        for k, t in enumerate(times):  # one record per iteration of the batch: it starts where the last ended
            start = times[k - 1] if k else scheduled
            self.steps.append({"t_s": start, "step_s": t - start, "batch_size": len(batch), "kv_usage": float("nan"),
                               "prefill_tokens": prefill_tokens if k == 0 else 0, "decode_tokens": len(batch) if k else 0})
        for (rid, prompt, n, arrival), tokens in zip(batch, rows):
            self.outputs[rid] = tokens
            first, finish = times[0], times[n - 1]
            self.records.append({
                "request_id": rid, "prompt_tokens": len(prompt), "output_tokens": n, "cached_tokens": 0,
                "preemptions": 0, "arrival_s": arrival, "first_scheduled_s": scheduled, "first_token_s": first,
                "finish_s": finish, "finish_reason": "length",
                "phases": [["queued", arrival, scheduled], ["prefill", scheduled, first], ["decode", first, finish]]})
        return [b[0] for b in batch]

    def run(self) -> dict[int, torch.Tensor]:
        while self.waiting:
            self.step()
        return dict(self.outputs)

    def metrics(self) -> dict:
        return summarize(self.records, self.steps, max_batch_size=self.max_batch_size)


class TransformersContinuous:
    """transformers' ContinuousBatchingManager behind the Engine's API. The manager steps in its own
    thread: step() only collects finished results (waiting up to 10 ms), run() waits for all."""

    def __init__(self, hf_model, max_batch_size: int = 8, num_blocks: int = 256, block_size: int = 32,
                 max_batch_tokens: int = 256):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=32)
        cb = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=block_size, max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=max_batch_size)
        self.max_batch_size = max_batch_size
        self.manager = hf_model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
        self.t0 = time.perf_counter()
        self.manager.start()
        self.pending: dict[str, tuple] = {}  # the manager's id -> (our id, prompt, max_new_tokens, arrival)
        self.records: list[dict] = []
        self.outputs: dict[int, torch.Tensor] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add_request(self, prompt_ids, *, arrival_s: float | None = None, max_new_tokens: int | None = None) -> int:
        rid = len(self.pending) + len(self.records)
        key = self.manager.add_request(list(prompt_ids), max_new_tokens=max_new_tokens, record_timestamps=True)
        self.pending[key] = (rid, list(prompt_ids), max_new_tokens, self.now() if arrival_s is None else arrival_s)
        return rid

    def step(self, timeout: float = 0.01) -> list[int]:
        done = []
        result = self.manager.get_result(timeout=timeout)
        while result is not None:
            if result.is_finished() and result.request_id in self.pending:
                rid, prompt, n, arrival = self.pending.pop(result.request_id)
                stamps = [t - self.t0 for t in result.timestamps]
                self.outputs[rid] = torch.tensor(prompt + list(result.generated_tokens))
                self.records.append({  # the manager does not say when it scheduled a request, nor what its
                    # prefix sharing (allow_block_sharing) served from cache: both unknown, NaN
                    "request_id": rid, "prompt_tokens": len(prompt), "output_tokens": len(result.generated_tokens),
                    "cached_tokens": float("nan"), "preemptions": 0, "arrival_s": arrival, "first_scheduled_s": float("nan"),
                    "first_token_s": stamps[0], "finish_s": stamps[-1], "finish_reason": "length",
                    "phases": [["queued", arrival, stamps[0]], ["decode", stamps[0], stamps[-1]]]})
                done.append(rid)
            result = self.manager.get_result(timeout=0)
        return done

    def run(self) -> dict[int, torch.Tensor]:
        while self.pending:
            self.step(timeout=1.0)
        self.manager.stop(block=True, timeout=10)
        return dict(self.outputs)

    def metrics(self) -> dict:
        return summarize(self.records, (), max_batch_size=self.max_batch_size)


def run_serve_bench(workload: Workload, engines: dict, skip_idle: bool = True) -> dict:
    """Replay `workload` through each of `engines` ({name: a zero-argument factory of an object with
    the Engine's API and its clock `now()`}), one after the other in one process -> each run's metrics,
    and output tokens/s and p50/p99 TTFT of every run against the first one's."""
    runs = {}
    for name, make in bar(engines.items(), desc="serve-bench", unit="engine"):
        engine = make()
        runs[name] = replay(engine, workload, clock=engine.now, skip_idle=skip_idle)
    first = next(iter(runs))
    ratios = {}
    for name, m in runs.items():
        if name != first:
            base = runs[first]
            ratios[f"{first} / {name}"] = {
                "output_tokens_per_s": base["output_tokens_per_s"] / m["output_tokens_per_s"],
                "ttft_p50": base["ttft_s"]["p50"] / m["ttft_s"]["p50"],
                "ttft_p99": base["ttft_s"]["p99"] / m["ttft_s"]["p99"]}
    return {"workload": workload.description, "runs": runs, "ratios": ratios}


class Models:
    """The two models of one checkpoint, each loaded once, on first use: minigen's and transformers'."""

    def __init__(self, model_name: str = "smollm2-135m"):
        self.name, self._minigen, self._hf = model_name, None, None

    def minigen(self):
        self._minigen = self._minigen or load(self.name)[0]
        return self._minigen

    def hf(self):
        self._hf = self._hf or load_hf(self.name)
        return self._hf


def pool_blocks(workload: Workload, max_batch_size: int, block_size: int = 16) -> int:
    """Blocks for max_batch_size of the workload's longest requests at once (prompt + reply)."""
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in workload.requests)
    return max_batch_size * math.ceil(longest / block_size)


# name -> (models, workload, max batch size) -> an engine with the Engine's API
ENGINES = {
    "minigen": lambda m, w, b: Engine(m.minigen(), GenerationConfig(stop_token_ids=[]), max_batch_size=b,
                                      num_blocks=pool_blocks(w, b)),  # no stop token: each its own length
    "transformers-continuous": lambda m, w, b: TransformersContinuous(m.hf(), b),
    "transformers-static": lambda m, w, b: StaticBatches(m.hf(), b),
}
DEFAULT_ENGINES = ["minigen", "transformers-continuous"]


# The least host memory one request of a workload takes: numpy's draws (arrival, gap, prompt and
# reply lengths: 8 bytes each, one copy more for the cumulative sum), the WorkloadRequest (~150 bytes)
# and its prompt tuple of at least 4 tokens (~90 bytes), before any engine runs it
WORKLOAD_REQUEST_BYTES = 280


def serve_bench_cli(model_name: str, engines: list[str], n_requests: int = 16, rate_per_s: float = 2.0,
                    seed: int = 0, max_batch_size: int = 8, prompt_median: float = 32,
                    output_median: float = 24) -> dict:
    """`python -m minigen serve-bench`: build the workload on the model's tokenizer (a system prompt
    in its chat template, user prompts cut from the benchmark's English text) and run the engines,
    each on a fresh engine, in the order given."""
    # a workload no machine here could hold is refused before numpy draws its arrays, which would
    # answer --requests 10**12 with numpy's _ArrayMemoryError instead of the fix
    check_fits(n_requests * WORKLOAD_REQUEST_BYTES, f"--requests {n_requests:,} (at least "
               f"{WORKLOAD_REQUEST_BYTES} bytes each)", "Fix: lower --requests", BenchError)
    tokenizer = load_tokenizer(resolve_folder(model_name))
    workload = make_workload(n_requests, rate_per_s, seed=seed, system_prompt=system_prompt_ids(tokenizer),
                             prompt_tokens=LengthDist(prompt_median, 0.6, 4, 256),
                             output_tokens=LengthDist(output_median, 0.5, 2, 128),
                             token_pool=prompt_ids(tokenizer, 1024)[0].tolist())
    models = Models(model_name)
    factories = {name: (lambda name=name: ENGINES[name](models, workload, max_batch_size)) for name in engines}
    result = run_serve_bench(workload, factories)
    hw = hardware_info()
    result["hardware"] = f"{hw['cpu']}, {hw['threads']} threads, torch {hw['torch']}, GPU: {hw['gpu'] or 'none'}"
    return result


def format_serve_bench(result: dict) -> str:
    """The side-by-side table of run_serve_bench's result."""
    lines = [f"workload: {result['workload']}", f"hardware: {result.get('hardware', 'not recorded')}",
             f"{'engine':<26}{'output tok/s':>14}{'TTFT p50 s':>12}{'TTFT p99 s':>12}{'TPOT p50 ms':>13}{'requests':>10}"]
    for name, m in result["runs"].items():
        lines.append(f"{name:<26}{m['output_tokens_per_s']:>14.1f}{m['ttft_s']['p50']:>12.2f}{m['ttft_s']['p99']:>12.2f}"
                     f"{m['tpot_s']['p50'] * 1000:>13.1f}{len(m['requests']):>10}")
    for pair, r in result["ratios"].items():
        lines.append(f"{pair}: output tok/s {r['output_tokens_per_s']:.2f}x; TTFT p50 {r['ttft_p50']:.2f}x, "
                     f"p99 {r['ttft_p99']:.2f}x (TTFT ratios < 1: the first engine answers sooner)")
    return "\n".join(lines)


# ---------------------------------------------------------------- chunked prefill (chapter 14)
def mixed_prefill(model, text_ids: torch.Tensor, budget: int | None, *, short: int = 4, new: int = 48,
                  n_long: int = 2, long: int = 512, gap_s: float = 0.5) -> dict:
    """Long prompts arrive while short requests decode, on a fresh Engine with
    max_num_batched_tokens=budget (None: every prompt in one step): the workload of chapter 14 and
    scripts/chunked_prefill.py. `short` requests (32-token prompts from text_ids, `new` greedy tokens
    each, no stop token) start together; `n_long` requests of `long` prompt tokens arrive `gap_s`
    apart while they decode, each wanting 4 tokens.

    -> {"budget", "decode_step_p50_s" / "_p99_s" / "_max_s" (the steps that decode: a decoding
    request waits one of them per token, so these are its times between tokens), "tpot_mean_s" (the
    short requests' mean), "long_ttft_s" (each long request's, from its arrival), "max_step_tokens",
    "tokens" ({request id: its tokens}), "metrics" (engine.metrics())}."""
    engine = Engine(model, GenerationConfig(stop_token_ids=[]), max_batch_size=short + n_long,
                    max_num_batched_tokens=budget)
    for i in range(short):
        engine.add_request(text_ids[1000 + 40 * i:1032 + 40 * i], max_new_tokens=new, arrival_s=0.0)
    for j in range(n_long):
        engine.add_request(text_ids[j * long:(j + 1) * long], max_new_tokens=4, arrival_s=gap_s * (j + 1))
    tokens = engine.run()
    m = engine.metrics()
    done = m["requests"]
    tpot = [(r["finish_s"] - r["first_token_s"]) / max(1, r["output_tokens"] - 1) for r in done[:short]]
    steps = torch.tensor([s["step_s"] for s in m["steps"] if s["decode_tokens"] > 0])
    return {"budget": budget, "tpot_mean_s": sum(tpot) / len(tpot),
            "decode_step_p50_s": float(steps.quantile(0.5)), "decode_step_p99_s": float(steps.quantile(0.99)),
            "decode_step_max_s": float(steps.max()),
            "long_ttft_s": [r["first_token_s"] - r["arrival_s"] for r in done[short:]],
            "max_step_tokens": max(m["tokens_per_step"]), "tokens": tokens, "metrics": m}
