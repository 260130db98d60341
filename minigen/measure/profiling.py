"""Where a decode step's time goes: torch.profiler over N decode steps, split by what each op does.

    profile(model, config) ─> warm-up steps ─> N timed steps (no profiler) ─> N profiled steps
                          ─> categories per step, a Chrome trace, a memory timeline of a generation

Each function of CATEGORIES runs inside a profiler range named after its category while the
steps are profiled: a call of the model's `ops.linear` is matrix products, the C matvec it runs
included (kernels/cpu.py: a ctypes call in eager mode, the `minigen::matvec` op under torch.compile); a call
of `RMSNorm.forward` is norms; a cache's `prepare` and `update` are the cache update. This
attributes by the code that ran, not by op names: an `aten::mul` is a norm in one place and RoPE in
another. "rest" is the step minus the categories: ops outside every category (the MLP's
activation, residual adds), dispatch and Python. Under torch.compile the fused kernels have no
range: they are "fused (compiled)", and the matrix products inside the graph are found by name.

The categories are compared with the very steps they came from: each profiled step runs in a
`minigen/step` range, "rest" is that range less the categories inside it, and their sum is held to
the wall-clock time of the same profiled steps (tests/test_profiling.py, in one run, next to a busy
loop too). The profiler costs a few microseconds per event it records (SmolLM2's step records
~5,000), so a profiled step is slower than a plain one: both are reported (`profiled_step_s`,
`step_s`). The categories are held to the profiled step, never to a plain step less an estimate
of the profiler's cost: the plain step is timed at another moment, and a busy neighbour slows one
and not the other, so only steps timed in the same run add up.
"""

from __future__ import annotations

import functools
import gc
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile as torch_profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import attention, model
from ..kernels import dispatch
from ..caches import contiguous, h2o, hybrid, offload, paged, quantized, window
from ..config import GenerationConfig
from ..errors import BenchError, ConfigError
from ..generate import check_prompt, stream
from ..stats import GenerationStats
from ..places import check_where
from ..run_plan import make_plan
from ..paths import atomic_path, check_output_path
from ..paths import bar
from ..sampling import sample

CATEGORY_NAMES = ("matrix products", "attention", "norms", "RoPE", "cache update", "sampling", "rest")
FUSED = "fused (compiled)"
LABEL = "minigen/"  # the profiler range of a category is named minigen/<category>
STEP = LABEL + "step"  # the range of one whole profiled decode step: what the categories add up to

# category -> the (owner, attribute) of each function whose calls belong to it
CATEGORIES = {
    # the C kernels that kernels/dispatch.py picks run inside these (a ctypes call, or minigen::matvec)
    "matrix products": [(model.TorchOps, "linear"), (dispatch.KernelOps, "linear")],
    "attention": [(model, "attend"), (model, "layer_mask"), (attention.AttentionPolicy, "attend"),
                  (attention.AttentionPolicy, "mask")]
                 + [(ops, name) for ops in (model.TorchOps, dispatch.KernelOps)
                    for name in ("decode_attention", "attend_blocks", "attend_prompt_blocks")],
    "norms": [(model.RMSNorm, "forward"), (model.LayerNorm, "forward"), (model.GemmaRMSNorm, "forward")],
    "RoPE": [(model, "apply_rope")],
    "cache update": [(cls, name) for cls in (contiguous.KVCache, paged.PagedKVCache, quantized.QuantizedKVCache,
                                             quantized.QuantizedPagedKVCache, window.WindowKVCache,
                                             h2o.HeavyHitterCache, offload.OffloadedKVCache, hybrid.HybridKVCache,
                                             hybrid.HybridPagedKVCache)
                     for name in ("prepare", "update") if name in vars(cls)],
}
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "minigen::matvec",
              "mkldnn::_linear_pointwise")  # the last: a prompt's products (kernels.cpu.linear)


def _ranged(fn, category: str):
    """fn, wrapped in a profiler range named after its category."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(LABEL + category):
            return fn(*args, **kwargs)
    return wrapper


@contextmanager
def labelled():
    """Wrap every function of CATEGORIES in its category's profiler range, for the profiled steps only.

    A hack, admitted: the functions are rebound for the duration and restored after, so that the
    package pays nothing for profiling when it is not profiled. A range costs about a microsecond,
    where tracing every Python call (with_stack=True) added ~20% to SmolLM2's step."""
    originals = [(owner, name, vars(owner)[name]) for targets in CATEGORIES.values() for owner, name in targets]
    try:
        for category, targets in CATEGORIES.items():
            for owner, name in targets:
                setattr(owner, name, _ranged(vars(owner)[name], category))
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def _category(event) -> str | None:
    return event.name[len(LABEL):] if event.name.startswith(LABEL) and event.name != STEP else None


def _counted(event) -> bool:
    """A range of a category, or an operator (aten::mm, minigen::matvec, ...)."""
    return _category(event) is not None or "::" in event.name


def _events_under(event) -> int:
    """Events the profiler recorded for `event`: itself and everything it called."""
    return 1 + sum(_events_under(child) for child in event.cpu_children)


def _outermost(event) -> bool:
    """Whether no counted event (a category's range, an operator) encloses `event`."""
    parent = event.cpu_parent
    while parent is not None:
        if _counted(parent):
            return False
        parent = parent.cpu_parent
    return True


def calls_by_category(events) -> dict[str, int]:
    """category -> the outermost ranges of it the profiler recorded: one per call of a function of
    CATEGORIES. A check on the attribution: 30 layers attend 30 times a step, whatever the clock says."""
    out: dict[str, int] = {}
    for e in events:
        category = _category(e)
        if category is not None and _outermost(e):
            out[category] = out.get(category, 0) + 1
    return out


def split_by_category(events, compiled: bool) -> dict[tuple[str, str], tuple[float, int]]:
    """(name, category) -> (microseconds, events recorded) over the outermost category ranges and the
    operators outside them (by name: a matrix product; in a compiled step, fused; else rest). A range
    counts whole, the C kernel that `ops.linear` runs by ctypes included; nothing inside a counted event
    counts again."""
    out: dict[tuple[str, str], tuple[float, int]] = {}
    for e in events:
        if not _counted(e) or not _outermost(e):
            continue
        category = _category(e)
        if category is None:
            category = "matrix products" if e.name.startswith(MATMUL_OPS) else FUSED if compiled else "rest"
        us, n = out.get((e.name, category), (0.0, 0))
        out[(e.name, category)] = (us + e.cpu_time_total, n + _events_under(e))
    return out


@dataclass
class Profile:
    step_s: float  # median seconds per decode step, timed without the profiler
    profiled_step_s: float  # mean seconds per decode step under the profiler, its cost included (wall clock)
    categories: dict[str, float]  # category -> seconds per profiled step, as the profiler timed them
    events_per_step: int  # events the profiler recorded per step (each costs it a few microseconds)
    steps: int  # decode steps profiled
    context: int  # positions in the cache when profiling started
    trace: str | None = None  # the Chrome trace file (chrome://tracing, ui.perfetto.dev)
    memory_timeline: list[dict] = field(default_factory=list)  # per new token: t_s, kv_cache_bytes
    top_ops: list[dict] = field(default_factory=list)  # the slowest ops: name, category, s per step
    calls: dict[str, float] = field(default_factory=dict)  # category -> its ranges per step (calls_by_category)
    config: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def check_profile_config(config: GenerationConfig, steps: int) -> None:
    """Refuse what cannot be profiled, from the config alone: `python -m minigen profile` calls this
    before it loads the model, profile() before any step."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"steps={steps!r} is invalid: use an integer >= 1 (decode steps to profile)")
    check_where(config, "profile")  # the profiler's row of the rule table (places.WHERE_REFUSED)


def profile(model_, input_ids: torch.Tensor, config: GenerationConfig | None = None, steps: int = 8,
            warmup: int = 3, trace: str | Path | None = None) -> Profile:
    """Profile `steps` decode steps of `model_` after `input_ids` [1, T] under `config`.

    Refused before any work when the config cannot run here (ConfigError, PromptError), or when
    `trace` cannot be written (BenchError); the trace is written whole or not at all."""
    config = config or GenerationConfig()
    check_profile_config(config, steps)
    trace = None if trace is None else check_output_path(trace, "trace=", BenchError)  # before, not after, the run
    T = input_ids.shape[1]
    total = warmup + 2 * steps
    run = config.replace(max_new_tokens=total)
    check_prompt(model_, input_ids, total, run)  # the prompt and every step must fit the context
    # the plan profiles the eager step on fused_decode="auto": the categories are torch's ops, which the
    # fused step runs in one C call (the table refuses fused_decode=True here)
    plan = make_plan(model_, run, input_ids.shape[0], "profile", max_len=T + total)
    step = plan.step
    cache = plan.make_cache(model_)
    with step.grad_mode():
        policy = plan.make_policy(cache)
        # the prompt's products (and attention) in their format (chapter 3)
        logits = step.prefill(model_, input_ids, torch.arange(T, device=input_ids.device), cache, policy,
                              ops=plan.prompt_ops)
        pos, decode_ops = T, plan.decode_ops

        def one_step():
            nonlocal logits, pos
            with record_function(LABEL + "sampling"):
                token = sample(logits, run)
            logits = step.decode(model_, token[:, None], torch.tensor([pos], device=input_ids.device), cache, policy,
                                 ops=decode_ops)
            pos += 1

        progress = bar(total=total, desc="profile", unit="step")  # drawn on a terminal only (paths.bar)
        for _ in range(warmup):  # compiles, fills buffers, warms the allocator
            one_step()
            progress.update(1)
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            one_step()
            times.append(time.perf_counter() - began)
            progress.update(1)
        context = pos
        # a compiled step was traced without the ranges; rebinding now would compile it again
        with nullcontext() if config.compile else labelled(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            began = time.perf_counter()
            for _ in range(steps):
                with record_function(STEP):
                    one_step()
                progress.update(1)  # outside the step's range; a redraw (on a terminal) is ~0.1 ms of its wall time
            profiled_step = (time.perf_counter() - began) / steps  # the wall clock, not the profiler's
        progress.close()
    events = prof.events()
    step_ranges = sum(e.cpu_time_total for e in events if e.name == STEP) / 1e6 / steps
    per_step = {name: 0.0 for name in CATEGORY_NAMES}
    ops, n_events = {}, 0
    for key, (us, n) in split_by_category(events, config.compile).items():
        n_events += n
        ops[key] = us / 1e6 / steps
        per_step[key[1]] = per_step.get(key[1], 0.0) + ops[key]
    # rest: dispatch and Python, the step minus its categories. Not clamped: an op counted twice
    # would make it negative, which tests/test_profiling.py refuses.
    per_step["rest"] += step_ranges - sum(per_step.values())
    if trace is not None:  # whole or not at all, and a full disk says so (paths.atomic_path)
        with atomic_path(trace, "trace=", BenchError) as tmp:
            prof.export_chrome_trace(str(tmp))
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:12]
    return Profile(step_s=sorted(times)[len(times) // 2], profiled_step_s=profiled_step, categories=per_step,
                   events_per_step=n_events // steps, steps=steps, context=context, trace=str(trace) if trace is not None else None,
                   memory_timeline=memory_timeline(model_, input_ids,
                                                   config.replace(max_new_tokens=steps, stop_token_ids=[])),
                   top_ops=[{"name": n, "category": c, "s_per_step": s} for (n, c), s in top],
                   calls={k: n / steps for k, n in calls_by_category(events).items()},
                   config=config.to_dict())


def memory_timeline(model_, input_ids: torch.Tensor, config: GenerationConfig) -> list[dict]:
    """One row per new token of a generation (no stop token): seconds since the call, the KV cache's bytes
    and their peak."""
    stats, rows = GenerationStats(), []
    began = time.perf_counter()
    for i, _ in enumerate(stream(model_, input_ids, config, stats=stats)):
        rows.append({"token": i, "t_s": time.perf_counter() - began, "kv_cache_bytes": stats.kv_cache_bytes,
                     "peak_kv_cache_bytes": stats.peak_kv_cache_bytes})
    return rows


def format_profile(p: Profile) -> str:
    """The categories as a table: ms per profiled step and share of it, and the step with and without the profiler."""
    lines = [f"decode step: {p.profiled_step_s * 1e3:.2f} ms under the profiler, {p.step_s * 1e3:.2f} ms without it "
             f"({p.profiled_step_s / p.step_s - 1:+.0%}: the profiler's cost, {p.events_per_step} events a step; "
             f"{p.steps} steps at context {p.context})", f"{'category':<18} {'ms/step':>8} {'share':>6}"]
    total = sum(p.categories.values())
    for name, s in p.categories.items():
        lines.append(f"{name:<18} {s * 1e3:8.3f} {s / p.profiled_step_s:6.1%}")
    lines.append(f"{'sum':<18} {total * 1e3:8.3f} ({total / p.profiled_step_s - 1:+.1%} against the profiled step)")
    return "\n".join(lines)


# ---------------------------------------------------------------- what a run allocates (on a CPU too)
class _LiveTensors(TorchDispatchMode):
    """Counts the bytes of the tensor storages that torch ops create while it is on, and their peak:
    the CPU's analogue of torch.cuda.max_memory_allocated. A storage counts from the op that made
    it until it is freed; what a kernel allocates inside itself (scratch) is not seen."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                if n and key not in self.seen:
                    self.seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, n)
        return out

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)


def peak_tensor_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """(the peak bytes of tensors `fn` allocated and held at once, fn's result): what a generation
    really allocates, cache included, to hold activation_bytes + kv_cache_bytes against."""
    gc.collect()
    with _LiveTensors() as live:
        result = fn()
    return live.peak, result
