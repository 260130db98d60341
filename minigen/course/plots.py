"""The chapters' figures and display helpers (the course's layer: the core never imports this).

    save_figure(fig, "01_step_time")   -> _build/figures/01_step_time.png ($MINIGEN_FIGURES/ if set), and
                                          01_step_time.json, the data behind it, checked against figures/
    fit_power_law(n, seconds)          -> exponent p and coefficient c of seconds ≈ c·n^p
    plot_power_law(ax, n, seconds)     -> the points and their fitted line, p in the legend
    plot_bench(results)                -> the bars of `python -m minigen bench --json`
    show_source(obj, start, stop)      -> print the lines of a package function (chapters show code)
    package_map(minigen)               -> a Markdown table of the package's modules
    plot_timeline(metrics)             -> each request's queued / prefill / decode / preempted bars
    plot_kv_usage(metrics)             -> the KV blocks in use and the batch size at each step
    plot_latencies(metrics)            -> the TTFT and TPOT distributions with p50 and p99
    plot_dashboard(metrics)            -> the four above in one figure (an Engine's metrics() dict)
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
from pathlib import Path
from types import ModuleType

import numpy as np

from ..serving.metrics import request_latencies
from .figure_data import check_against, fingerprint, write


# ---------------------------------------------------------------- files
def figures_dir() -> Path:
    """Where `save_figure` writes: $MINIGEN_FIGURES when set (`make figures` sets it to figures/,
    the images committed with the course), else _build/figures/ beside book.toml (./_build/figures
    outside a checkout). _build/ is ignored by git, so running a chapter or `make test` never
    rewrites a tracked file; refreshing the committed figures is a deliberate `make figures`."""
    chosen = os.environ.get("MINIGEN_FIGURES")
    if chosen:  # relative to the working directory (a chapter runs in notebooks/): give an absolute path
        folder = Path(chosen).expanduser().resolve()
    else:
        root = Path(__file__).resolve().parents[2]
        folder = (root if (root / "book.toml").exists() else Path.cwd()) / "_build" / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# The figures committed with the course (`make figures` writes them), in a checkout
COMMITTED_FIGURES = Path(__file__).resolve().parents[2] / "figures"


def save_figure(fig, name: str, dpi: int = 110, exact: bool = False) -> Path:
    """Write `fig` to figures_dir()/<name>.png and return the path; name starts with the chapter: "01_...".
    Beside it goes <name>.json, the data the figure shows (figure_data.fingerprint). A run that writes
    anywhere but the committed figures/ (make test, a chapter run) raises FigureDataError when the
    figure no longer matches figures/<name>.json: its axes, labels and number of lines and bars, and,
    for `exact=True` (a figure of counts, tokens or steps, the same on every run), every value."""
    folder = figures_dir()
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")  # drawn first: tick labels exist only once drawn
    data = fingerprint(fig, exact)
    write(path.with_suffix(".json"), data)
    if folder != COMMITTED_FIGURES.resolve():
        check_against(COMMITTED_FIGURES / f"{name}.json", data, name)
    return path


# ---------------------------------------------------------------- measurements
def fit_power_law(x, y) -> tuple[float, float]:
    """Least squares on log y = log c + p log x -> (p, c). x and y positive, at least 2 points."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or (x <= 0).any() or (y <= 0).any():
        raise ValueError("fit_power_law needs at least 2 points, all positive")
    p, log_c = np.polyfit(np.log(x), np.log(y), 1)
    return float(p), float(np.exp(log_c))


def plot_power_law(ax, x, y, label: str, color=None, marker: str = "o"):
    """Draw the measured points and the fitted c·x^p on log-log axes; returns (p, c)."""
    p, c = fit_power_law(x, y)
    x = np.asarray(x, dtype=float)
    ax.loglog(x, y, marker, color=color, ms=4, alpha=0.7, label=f"{label} (measured)")
    ax.loglog(x, c * x ** p, "-", color=ax.lines[-1].get_color(), lw=1.5, label=f"fit: ∝ N^{p:.2f}")
    return p, c


def plot_reference_slopes(ax, x, anchor_y: float, slopes=(1, 2, 3)) -> None:
    """Grey guide lines ∝ x^k through (x[0], anchor_y), for reading exponents off a log-log plot."""
    x = np.asarray(x, dtype=float)
    for k, style in zip(slopes, (":", "--", "-.")):
        ax.loglog(x, anchor_y * (x / x[0]) ** k, style, color="grey", lw=0.8, label=f"∝ N^{k}")


# ---------------------------------------------------------------- the benchmark
def plot_bench(results: dict, ax=None):
    """Bars of decode tokens/s per engine from `python -m minigen bench --json`, with the roofline
    (memory bandwidth / bytes read per token) as a horizontal line and the hardware in the title.
    Returns the Axes."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    engines = results["engines"]
    names = list(engines)
    rates = [engines[n]["decode_tokens_per_s"] for n in names]
    bars = ax.bar(names, rates, color=[f"C{i}" for i in range(len(names))])
    ax.bar_label(bars, labels=[f"{r:.1f}" for r in rates], padding=2)
    roof = results["roofline_tokens_per_s"]
    hw = results["hardware"]
    ax.axhline(roof, color="black", ls="--", lw=1.2,
               label=f"roofline {roof:.1f} tok/s = {hw['memory_read_gb_s']:.1f} GB/s ÷ "
                     f"{results['bytes_per_token'] / 1e6:.0f} MB per token")
    ax.set_ylim(0, max(rates + [roof]) * 1.25)
    ax.set_ylabel("decode tokens/s (one sequence)")
    device = hw["gpu"] or f"{hw['cpu']}, {hw['threads']} threads"
    ax.set_title(f"{results['model']}: prompt {results['prompt_len']}, {results['new_tokens']} new tokens\n"
                 f"measured on {device}, torch {hw['torch']}", fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    return ax


# ---------------------------------------------------------------- showing the package
def show_source(obj, start: str | None = None, stop: str | None = None) -> None:
    """Print the source of a package function or class, optionally only from the first line that
    contains `start` to the first later line that contains `stop` (inclusive). A `start` or `stop`
    that the source does not hold raises ValueError, rather than printing some other excerpt."""
    lines = inspect.getsource(obj).splitlines()
    first = next((i for i, s in enumerate(lines) if start in s), None) if start else 0
    if first is None:
        raise ValueError(f"{start!r} is not in the source of {obj.__qualname__}")
    last = next((i for i in range(first + 1, len(lines)) if stop in lines[i]), None) if stop else len(lines) - 1
    if last is None:
        after = f" after the line with {start!r}" if start else " after its first line"
        raise ValueError(f"{stop!r} is not in the source of {obj.__qualname__}{after}")
    file = Path(inspect.getsourcefile(obj)).name
    line0 = inspect.getsourcelines(obj)[1] + first
    print(f"# {file}, line {line0}")
    print("\n".join(lines[first:last + 1]))


def package_map(package: ModuleType) -> str:
    """A Markdown table: each module of `package`, the first line of its docstring, and the public
    classes and functions it defines (read from the package itself, so it cannot go stale)."""
    rows = ["| module | what it holds | defines |", "|---|---|---|"]
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{package.__name__}.{info.name}")
        doc = (mod.__doc__ or "").strip().splitlines()
        names = [n for n, v in vars(mod).items() if not n.startswith("_")
                 and (inspect.isclass(v) or inspect.isfunction(v)) and v.__module__ == mod.__name__]
        shown = ", ".join(f"`{n}`" for n in names[:6]) + (f" (+{len(names) - 6})" if len(names) > 6 else "")
        kind = "package" if info.ispkg else "module"
        rows.append(f"| `{info.name}` ({kind}) | {doc[0] if doc else ''} | {shown} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- chapter 17: profile, roofline, C7, GPU reports
def plot_categories(profile, ax=None):
    """Bars of ms per decode step by category, from `minigen.measure.profiling.profile`."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    names = list(profile.categories)
    ms = [profile.categories[n] * 1e3 for n in names]
    bars = ax.barh(names[::-1], ms[::-1], color="C0")
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in ms[::-1]], padding=2, fontsize=8)
    ax.set_xlim(0, max(ms) * 1.2)
    ax.set_xlabel(f"ms per profiled decode step ({profile.profiled_step_s * 1e3:.1f} ms; "
                  f"{profile.step_s * 1e3:.1f} ms without the profiler)")
    return ax


def plot_roofline(ceilings, points, reference, ax=None):
    """Log-log roofline: each ceiling's min(peak, bandwidth x intensity), and each (model, Point) drawn
    at its intensity on the `reference` ceiling's roof (o prefill, x decode; colour by model)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 5.5))
    x = np.logspace(-1, 5, 400)
    for i, c in enumerate(ceilings):
        ax.loglog(x, [c.attainable(v) for v in x], color=f"C{i}", lw=1.8 if c is reference else 1.1,
                  label=f"{c.name}: " + (f"{c.peak_flops / 1e12:,.0f} TFLOP/s" if c.peak_flops >= 1e12 else
                                           f"{c.peak_flops / 1e9:,.1f} GFLOP/s") +
                        f" {c.precision}, {c.bandwidth / 1e9:,.1f} GB/s (ridge {c.ridge:,.1f})")
    models = list(dict.fromkeys(name for name, _ in points))
    for name, p in points:
        color = f"C{len(ceilings) + models.index(name)}"
        ax.loglog(p.intensity, reference.attainable(p.intensity), "o" if p.label.startswith("prefill") else "x",
                  color=color, ms=7, mew=2)
    for text, x in point_labels([p for _, p in points]):  # one label per cluster: coincident points stacked theirs
        ax.annotate(text, (x, reference.attainable(x)), fontsize=6, xytext=(3, -9), textcoords="offset points")
    for i, name in enumerate(models):
        ax.plot([], [], "s", color=f"C{len(ceilings) + i}", label=f"{name} (o prefill, x decode)")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved from memory)")
    ax.set_ylabel("attainable FLOP/s")
    ax.legend(fontsize=7, loc="lower right")
    return ax


def point_labels(points, min_ratio: float = 1.5) -> list[tuple[str, float]]:
    """(text, intensity) of one label per cluster of roofline points: points whose intensities lie within
    `min_ratio` of the cluster's first share a label naming each batch once ("B=1" for three models'
    decode at batch 1, not "B=1B=1B=1"), placed at the cluster's geometric mean."""
    clusters: list[list] = []
    for p in sorted(points, key=lambda p: p.intensity):
        if clusters and p.intensity < clusters[-1][0].intensity * min_ratio:
            clusters[-1].append(p)
        else:
            clusters.append([p])
    return [(", ".join(dict.fromkeys(p.label.split()[-1] for p in c)),
             float(np.exp(np.mean([np.log(p.intensity) for p in c])))) for c in clusters]


def plot_c7(splits, ax=None):
    """Stacked ms of a 175B decode step (weights, KV, compute shown beside) for each batch and context."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4))
    labels = [f"B={s.batch}\nN={s.context}" for s in splits]
    w = [s.weights_s * 1e3 for s in splits]
    kv = [s.kv_s * 1e3 for s in splits]
    pos = np.arange(len(splits))
    ax.bar(pos - 0.2, w, 0.4, color="C0", label="read the weights (fp16)")
    ax.bar(pos - 0.2, kv, 0.4, bottom=w, color="C1", label="read the KV cache (fp16)")
    ax.bar(pos + 0.2, [s.compute_s * 1e3 for s in splits], 0.4, color="C2", label="compute at peak")
    for p, s in zip(pos, splits):
        ax.text(p, (s.weights_s + s.kv_s) * 1e3 * 1.05, f"{s.speedups['all three']:.1f}x" +
                ("" if s.fits else f"\n{s.gpus_needed} GPUs"), ha="center", fontsize=7)
    ax.set_xticks(pos, labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=8, loc="upper left")
    return ax


def plot_gpu_profiles(reports: dict, ax=None):
    """Decode tok/s per model and mode from scripts/gpu_check.py reports (figures/gpu/*.json)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    bars = [(f"{r['hardware']['gpu']}\n{m}", mode, v["decode_tokens_per_s"])
            for r in reports.values() for m, row in r["checks"].get("decode", {}).get("models", {}).items()
            for mode, v in row["modes"].items()]
    modes = list(dict.fromkeys(b[1] for b in bars))
    groups = list(dict.fromkeys(b[0] for b in bars))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs = [groups.index(g) + width * (i - (len(modes) - 1) / 2) for g, m, _ in bars if m == mode]
        ax.bar(xs, [v for _, m, v in bars if m == mode], width, label=mode)
    ax.set_xticks(range(len(groups)), groups, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s, batch 1 (measured by scripts/gpu_check.py)")
    ax.legend(fontsize=8)
    return ax


# ---------------------------------------------------------------- serving (chapter 14): the metrics dict
PHASE_COLORS = {"queued": "0.8", "prefill": "C1", "decode": "C0", "preempted": "C3"}


def _axes(ax, size=(6, 3.5)):
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=size)[1] if ax is None else ax


def plot_timeline(metrics: dict, ax=None, title: str = ""):
    """One row per request (id on the y axis), its phases as bars over time: queued (grey), prefill,
    decode, preempted (metrics["requests"][i]["phases"] = [[phase, start_s, end_s], ...])."""
    ax = _axes(ax)
    for r in metrics["requests"]:
        for phase, start, end in r["phases"]:
            if end > start:
                ax.broken_barh([(start, end - start)], (r["request_id"] - 0.4, 0.8), color=PHASE_COLORS[phase])
    from matplotlib.patches import Patch
    spans = [(start, end) for r in metrics["requests"] for _, start, end in r["phases"]]
    if spans:  # the same span as plot_kv_usage's, so that the two panels of one run line up
        ax.set_xlim(min(a for a, _ in spans), max(b for _, b in spans))
    ax.set_xlabel("time (s)")
    ax.set_ylabel("request id")
    ax.invert_yaxis()
    ax.legend(handles=[Patch(color=c, label=p) for p, c in PHASE_COLORS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.2), fontsize=7, ncol=4)  # below the axes: bars reach every corner
    ax.set_title(title or "requests over time", fontsize=9)
    return ax


def plot_kv_usage(metrics: dict, ax=None):
    """The fraction of KV blocks in use at each step (left axis) and the batch size (right axis)."""
    ax = _axes(ax)
    # A step's usage is counted when it ends (its finished requests' blocks given back) and holds until the
    # next step ends; its batch size holds while it runs. The last values reach the run's end (the last step's
    # end or request's finish), so the panel spans the whole timeline, as plot_timeline's does.
    steps = metrics["steps"]
    t = [s["t_s"] for s in steps]
    done = [s["t_s"] + s["step_s"] for s in steps]
    ends = done + [b for r in metrics["requests"] for _, _, b in r["phases"]]
    starts = t + [a for r in metrics["requests"] for _, a, _ in r["phases"]]
    usage, batch = list(metrics["kv_usage"]), list(metrics["batch_size"])
    if steps:
        done, t = done + [max(ends)], t + [max(ends)]
        usage, batch = usage + usage[-1:], batch + batch[-1:]
    ax.step(done, [100 * u for u in usage], where="post", color="C2", label="KV blocks in use")
    if starts:
        ax.set_xlim(min(starts), max(ends))
    if not any(u == u for u in metrics["kv_usage"]):  # all NaN: the engine has no block pool to report
        ax.text(0.5, 0.5, "KV usage not recorded\n(no block pool)", transform=ax.transAxes, ha="center", fontsize=8)
    ax.set_ylim(0, 105)
    ax.set_ylabel("KV blocks in use (%)", color="C2")
    ax.set_xlabel("time (s)")
    right = ax.twinx()
    right.step(t, batch, where="post", color="C0", lw=0.8, alpha=0.7)
    right.set_ylabel("batch size (sequences)", color="C0")
    right.set_ylim(0, max(metrics["batch_size"], default=1) + 1)
    ax.set_title(f"KV usage and batch size per step ({metrics.get('num_blocks', '?')} blocks)", fontsize=9)
    return ax


def plot_latencies(metrics: dict, axes=None):
    """Histograms of TTFT and TPOT over the finished requests, with their p50 and p99 marked."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(8, 3))
    values = request_latencies(metrics["requests"])
    for ax, name, scale, unit in zip(axes, ("ttft_s", "tpot_s"), (1, 1000), ("s", "ms")):
        v = np.asarray(values[name], dtype=float) * scale
        ax.hist(v, bins=max(5, min(30, len(v))), color="C0", alpha=0.7)
        for p, style in (("p50", "-"), ("p99", "--")):
            x = metrics[name][p] * scale
            ax.axvline(x, color="black", ls=style, lw=1, label=f"{p} {x:.3g} {unit}")
        ax.set_xlabel(f"{name.removesuffix('_s').upper()} ({unit})")
        ax.set_ylabel("requests")
        ax.legend(fontsize=7)
    return axes


def plot_dashboard(metrics: dict, title: str = ""):
    """The serving dashboard of one run: timeline, KV usage and batch size, TTFT and TPOT -> Figure."""
    import matplotlib.pyplot as plt
    fig = plt.figure(figsize=(11, 6.5))
    grid = fig.add_gridspec(2, 3)
    plot_timeline(metrics, fig.add_subplot(grid[0, :2]))
    plot_kv_usage(metrics, fig.add_subplot(grid[0, 2]))
    plot_latencies(metrics, [fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])])
    text = fig.add_subplot(grid[1, 2])
    text.axis("off")
    text.text(0, 1, "\n".join([
        f"output: {metrics['output_tokens_per_s']:.1f} tok/s",
        f"TTFT p50 / p99: {metrics['ttft_s']['p50']:.2f} / {metrics['ttft_s']['p99']:.2f} s",
        f"TPOT p50 / p99: {metrics['tpot_s']['p50'] * 1000:.0f} / {metrics['tpot_s']['p99'] * 1000:.0f} ms",
        f"queue p50: {metrics['queue_time_s']['p50']:.2f} s",
        f"prefix cache hit rate: {metrics['prefix_cache_hit_rate']:.0%}",
        f"preemptions: {metrics['preemptions']}",
        f"requests: {len(metrics['requests'])}"]), va="top", family="monospace", fontsize=9)
    fig.suptitle(title or "serving metrics", fontsize=10)
    fig.tight_layout()
    return fig
