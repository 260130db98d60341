"""The committed GPU report as the chapters' tables and figures (the course's layer).

`scripts/gpu_check.py` runs on a CUDA machine and writes one JSON; the course commits it under
figures/gpu/ and every chapter that shows GPU numbers reads it through this module, so each table and
figure says where and when it was measured from the file itself (GPU, date, commit, torch).

    load(path=None)                 -> Report (figures/gpu/NVIDIA_H200.json by default); GPUReportError,
                                       one line, when the file is missing or is not a gpu_check report
    decode_rows / decode_table / plot_decode       chapter 11: eager, compile, CUDA graphs, reduce-overhead
    fixed_ms_per_token / decode_findings           the time a token takes whatever the model's size
    kernel_rows / kernel_table / plot_kernel / kernel_findings       chapter 12: the Triton decode kernel
    roofline_rows / roofline_table / plot_roofline                   chapter 17: measured points on the roofline
    prefill_rows / prefill_table / plot_prefill / prefill_findings   FlashAttention: the Triton prefill kernel
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ..measure.roofline import GPUS, Ceiling

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "figures" / "gpu" / "NVIDIA_H200.json"
MODES = ("eager", "compile", "cuda_graphs", "reduce-overhead")  # gpu_check's decode modes, in its order
# What each check must hold for the functions below (a report may lack a check: its functions say so).
NEEDS = {"decode": ("bandwidth_gb_s", "models"), "kernel": ("layer", "copy_bandwidth_gb_s", "runs"),
         "prefill": ("layer", "runs")}


class GPUReportError(ValueError):
    """The GPU report is missing or is not what scripts/gpu_check.py writes (always a one-line message)."""


@dataclass(frozen=True)
class Report:
    path: Path
    data: dict
    gpu: str
    torch: str
    date: str  # read from the report's `runs` line, as are commit and runs
    commit: str
    runs: str

    @property
    def where_when(self) -> str:
        """One line naming the GPU, the date, the commit and torch, all read from the JSON."""
        return f"measured on one {self.gpu} on {self.date} at commit {self.commit}, torch {self.torch}"

    @property
    def source(self) -> str:
        """The file and how it was run (its `runs` field), for a table's caption."""
        return f"{self.path.name}: {self.runs}"

    def check(self, name: str) -> dict:
        """The report's `name` check, or a one-line GPUReportError saying how to record it."""
        if name not in self.data["checks"]:
            raise GPUReportError(f"{self.path.name} holds no {name!r} check "
                                 f"(record it with: python scripts/gpu_check.py --only {name})")
        return self.data["checks"][name]


def _fail(path: Path, why: str) -> GPUReportError:  # one line, naming the file
    return GPUReportError(f"{path}: not a scripts/gpu_check.py report: {why}")


def _require(d: object, keys: tuple[str, ...], where: str, path: Path) -> None:
    if not isinstance(d, dict):
        raise _fail(path, f"{where} is {type(d).__name__}, not an object")
    missing = [k for k in keys if k not in d]
    if missing:
        raise _fail(path, f"{where} lacks {', '.join(missing)}")


def load(path: str | Path | None = None) -> Report:
    """Read and check a gpu_check report: hardware, checks, and a `runs` line naming the commit and date."""
    path = Path(path) if path is not None else DEFAULT_PATH
    if not path.is_file():
        raise GPUReportError(f"no GPU report at {path} (scripts/gpu_check.py on a CUDA machine writes one; "
                             "the course commits figures/gpu/NVIDIA_H200.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise _fail(path, f"invalid JSON ({err.msg} at line {err.lineno})") from None
    _require(data, ("hardware", "checks", "runs"), "the report", path)
    _require(data["hardware"], ("gpu", "torch"), "hardware", path)
    _require(data["checks"], (), "checks", path)
    if data.get("smoke") or not data["hardware"]["gpu"]:
        raise _fail(path, "a smoke run on the CPU (no GPU named)")
    for name, keys in NEEDS.items():
        if name in data["checks"]:
            _require(data["checks"][name], keys, f"checks.{name}", path)
    runs = str(data["runs"])
    commit, date = re.search(r"\bat ([0-9a-f]{7,40})\b", runs), re.search(r"\b(\d{4}-\d{2}-\d{2})\b", runs)
    if not (commit and date):
        raise _fail(path, "its runs field names no commit ('at <hash>') and date (YYYY-MM-DD)")
    return Report(path, data, data["hardware"]["gpu"], data["hardware"]["torch"], date.group(1), commit.group(1), runs)


def spec_sheet(report: Report) -> Ceiling | None:
    """The spec-sheet ceiling (minigen.measure.roofline.GPUS) whose model the report's GPU name contains."""
    for ceiling in GPUS:
        if ceiling.name.split()[0].split("-")[0] in report.gpu:
            return ceiling
    return None


def table(report: Report, rows: list[dict], columns: list[tuple[str, str, str]], title: str) -> str:
    """Markdown: a bold title with where and when, then rows under (header, key, format) columns."""
    def cell(row: dict, key: str, fmt: str) -> str:
        value = row.get(key)
        if value is None:
            return "skipped"
        return ("yes" if value else "no") if isinstance(value, bool) else format(value, fmt)

    lines = [f"**{title}**, {report.where_when} ({report.source})", "",
             "| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, k, f) for _, k, f in columns) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- chapter 11: decode, compiled, graphed
def decode_rows(report: Report) -> list[dict]:
    """One row per model shape and mode (and transformers where the report measured it): tok/s, ms a
    token, the share of the roofline at the report's measured copy bandwidth and at the spec sheet's."""
    decode = report.check("decode")
    bandwidth = decode["bandwidth_gb_s"] * 1e9
    spec = spec_sheet(report)
    rows = []
    for model, entry in decode["models"].items():
        measured = dict(entry["modes"])
        if "decode_tokens_per_s" in entry.get("transformers", {}):
            measured["transformers"] = entry["transformers"]
        for mode, m in measured.items():
            rate = m.get("decode_tokens_per_s")
            floor_ms = 1e3 * entry["bytes_per_token"] / bandwidth  # reading the bytes at the measured bandwidth
            rows.append({
                "model": model, "mode": mode, "tok_s": rate, "ms_per_token": 1e3 / rate if rate else None,
                "roofline_share": rate * entry["bytes_per_token"] / bandwidth if rate else None,
                "spec_share": rate * entry["bytes_per_token"] / spec.bandwidth if rate and spec else None,
                "beyond_roofline_ms": 1e3 / rate - floor_ms if rate else None,
                "tokens_equal_eager": m.get("tokens_equal_eager"), "compile_s": m.get("compile_s"),
                "bytes_per_token": entry["bytes_per_token"]})
    return rows


def decode_table(report: Report) -> str:
    decode, spec = report.check("decode"), spec_sheet(report)
    columns = [("model shape (random bf16 weights)", "model", ""), ("mode", "mode", ""),
               ("decode tok/s", "tok_s", ".0f"), ("ms a token", "ms_per_token", ".2f"),
               (f"share of the roofline at the measured {decode['bandwidth_gb_s']:,.0f} GB/s", "roofline_share", ".1%")]
    if spec:
        columns.append((f"at the spec sheet's {spec.bandwidth / 1e9:,.0f} GB/s ({spec.name})", "spec_share", ".1%"))
    columns += [("ms a token beyond reading the bytes", "beyond_roofline_ms", ".2f"),
                ("tokens equal eager's", "tokens_equal_eager", "")]
    title = (f"Decode at batch 1, prompt {decode['prompt_len']}, {decode['new_tokens']} new tokens "
             "(scripts/gpu_check.py's decode check)")
    return table(report, decode_rows(report), columns, title)


def fixed_ms_per_token(report: Report, mode: str = "cuda_graphs") -> tuple[float, float]:
    """Least squares of ms a token against GB read a token over the model shapes, in one mode ->
    (intercept ms: the time a token takes whatever the model's size, slope ms per GB)."""
    rows = [r for r in decode_rows(report) if r["mode"] == mode and r["tok_s"]]
    if len(rows) < 2:
        raise GPUReportError(f"{report.path.name}: fewer than two model shapes measured {mode!r}: no line to fit")
    slope, intercept = np.polyfit([r["bytes_per_token"] / 1e9 for r in rows], [r["ms_per_token"] for r in rows], 1)
    return float(intercept), float(slope)


def decode_findings(report: Report, model: str = "Llama-3.2-1B") -> str:
    """What the decode check shows, in sentences whose every number is read from the report."""
    rows = decode_rows(report)
    shapes = len({r["model"] for r in rows})
    same = {mode: sum(bool(r["tokens_equal_eager"]) for r in rows if r["mode"] == mode) for mode in MODES[1:]}
    mine = {r["mode"]: r for r in rows if r["model"] == model}
    intercept, slope = fixed_ms_per_token(report)
    graphs = mine["cuda_graphs"]
    text = (f"Decode, {report.where_when}: "
            + "; ".join(f"{mode} gave the eager step's tokens on {n} of {shapes} shapes" for mode, n in same.items()) + ". "
            f"On the {model} shape, eager decoded {mine['eager']['tok_s']:.0f} tok/s and CUDA graphs "
            f"{graphs['tok_s']:.0f} tok/s, {graphs['roofline_share']:.0%} of the bandwidth roofline: of its "
            f"{graphs['ms_per_token']:.2f} ms a token, {graphs['beyond_roofline_ms']:.2f} ms is not spent reading "
            f"the bytes. A line through the {shapes} shapes' ms a token against GB read a token under CUDA graphs "
            f"meets zero bytes at {intercept:.2f} ms (slope {slope:.2f} ms a GB): about that much of every token "
            "goes to per-token work that does not grow with the model, the host's share of the loop.")
    hf = mine.get("transformers")
    return text + (f" transformers' static-cache generate decoded {hf['tok_s']:.0f} tok/s on the same shape."
                   if hf else " This report holds no transformers row.")


def plot_decode(report: Report) -> Figure:
    """Decode tok/s per shape and mode (log scale), each bar labelled with its share of the roofline."""
    rows = [r for r in decode_rows(report) if r["tok_s"]]
    models = list(dict.fromkeys(r["model"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        mine = [next((r for r in rows if r["model"] == m and r["mode"] == mode), None) for m in models]
        xs = [j + width * (i - (len(modes) - 1) / 2) for j, r in enumerate(mine) if r]
        bars = ax.bar(xs, [r["tok_s"] for r in mine if r], width, label=mode)
        ax.bar_label(bars, labels=[f"{r['roofline_share']:.0%}" for r in mine if r], fontsize=7)
    ax.set_xticks(range(len(models)), models)
    ax.set(yscale="log", ylabel="decode tokens/s, batch 1, bf16")
    ax.set_title(f"{report.where_when}\nbar label: share of the roofline at the measured "
                 f"{report.check('decode')['bandwidth_gb_s']:,.0f} GB/s", fontsize=9)
    ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------- chapter 12: the Triton decode-attention kernel
def kernel_rows(report: Report) -> list[dict]:
    """One row per context and cache format: the kernel's ms against gather + SDPA's on the same blocks."""
    kernel = report.check("kernel")
    return [{"context": r["context"], "format": r["format"], "kernel_ms": r["kernel_ms"],
             "gather_sdpa_ms": r["gather_sdpa_ms"], "speedup": r["speedup"], "kernel_gb_s": r["kernel_gb_s"],
             "bandwidth_share": r["kernel_gb_s"] / kernel["copy_bandwidth_gb_s"], "max_abs_diff": r["max_abs_diff"],
             "bytes_read": r["bytes_read"]} for r in kernel["runs"].values()]


def kernel_table(report: Report) -> str:
    k = report.check("kernel")
    layer = k["layer"]
    columns = [("context", "context", ","), ("cache", "format", ""), ("Triton kernel ms", "kernel_ms", ".3f"),
               ("gather + SDPA ms", "gather_sdpa_ms", ".3f"), ("kernel speed / gather + SDPA's", "speedup", ".2f"),
               ("kernel GB/s", "kernel_gb_s", ".0f"),
               (f"share of the measured {k['copy_bandwidth_gb_s']:,.0f} GB/s", "bandwidth_share", ".1%"),
               ("largest difference", "max_abs_diff", ".1e")]
    title = (f"Decode attention, one layer of {layer['n_heads']} query heads on {layer['n_kv_heads']} key/value "
             f"heads of {layer['head_dim']}, batch {k['batch']}, paged blocks of {k['block_size']}")
    return table(report, kernel_rows(report), columns, title)


def kernel_findings(report: Report) -> str:
    """Per cache format, the kernel's speed over gather + SDPA's at each context, read from the report."""
    rows = kernel_rows(report)
    parts = []
    for fmt in dict.fromkeys(r["format"] for r in rows):
        mine = [r for r in rows if r["format"] == fmt]
        parts.append(f"{fmt}: " + ", ".join(f"{r['speedup']:.2f}x at {r['context']:,}" for r in mine))
    bf16 = [r for r in rows if r["format"] == "bf16"]
    slower = ""
    if bf16 and all(r["speedup"] < 1 for r in bf16):
        slower = (f" In bf16 the kernel was slower than gather + SDPA at every context, taking "
                  f"{min(1 / r['speedup'] for r in bf16):.1f} to {max(1 / r['speedup'] for r in bf16):.1f} times as long.")
    return (f"The Triton kernel's speed over gather + SDPA's ({report.where_when}; above 1: the kernel is faster): "
            + "; ".join(parts) + "." + slower)


def plot_kernel(report: Report) -> Figure:
    """Left: ms per call in each format at each context, kernel solid, gather + SDPA dashed.
    Right: the kernel's speed over gather + SDPA's, with the line where they tie."""
    rows, (fig, (left, right)) = kernel_rows(report), plt.subplots(1, 2, figsize=(11, 4))
    formats, contexts = list(dict.fromkeys(r["format"] for r in rows)), sorted({r["context"] for r in rows})
    for i, fmt in enumerate(formats):
        mine = sorted((r for r in rows if r["format"] == fmt), key=lambda r: r["context"])
        x = [r["context"] for r in mine]
        left.plot(x, [r["kernel_ms"] for r in mine], "o-", color=f"C{i}", label=f"Triton kernel, {fmt}")
        left.plot(x, [r["gather_sdpa_ms"] for r in mine], "s--", color=f"C{i}", label=f"gather + SDPA, {fmt}")
        right.bar([contexts.index(c) + 0.8 / len(formats) * (i - (len(formats) - 1) / 2) for c in x],
                  [r["speedup"] for r in mine], 0.8 / len(formats), color=f"C{i}", label=fmt)
    left.set(xscale="log", yscale="log", xlabel="cached tokens", ylabel="ms per call (one layer)")
    left.legend(fontsize=7)
    right.axhline(1, color="k", lw=0.8)
    right.set_xticks(range(len(contexts)), [f"{c:,}" for c in contexts])
    right.set(xlabel="cached tokens", ylabel="kernel speed / gather + SDPA's")
    right.legend(fontsize=8, title="above 1: kernel faster", title_fontsize=7)
    fig.suptitle(f"Triton decode attention against gather + SDPA, {report.where_when}", fontsize=9)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- FlashAttention: the Triton prefill kernel
def prefill_flops(layer: dict, prompt: int) -> float:
    """FLOPs of one layer's causal attention over a prompt from position 0 (gpu_check's count): q.k and
    p.v over the causal half, 2 FLOPs a multiply-add."""
    return 4 * layer["n_heads"] * layer["head_dim"] * prompt * (prompt + 1) / 2


def prefill_rows(report: Report) -> list[dict]:
    """One row per prompt and kernel: SDPA's flash kernel on contiguous keys, and the Triton kernel on
    paged blocks (bf16, 4-bit codes, and the tile sizes tried at one prompt length)."""
    rows = []
    for name, r in report.check("prefill")["runs"].items():
        sdpa = name.startswith("sdpa")
        tile = f", tile {r['block_m']} x {r['block_n']}" if r.get("block_m") else ""
        rows.append({"prompt": r["prompt"], "kernel": f"SDPA ({r['path']})" if sdpa else f"Triton, {r['format']}{tile}",
                     "format": "bf16" if sdpa else r["format"], "sdpa": sdpa, "default_tile": not tile,
                     "tile": tile.removeprefix(", ") or "the default tile",
                     "ms": r["ms"], "tflop_s": r["tflop_s"], "vs_sdpa": 1.0 if sdpa else r["vs_sdpa"],
                     "max_abs_diff": None if sdpa else r["max_abs_diff_vs_sdpa"],
                     "close": True if sdpa else r["close_to_sdpa"]})
    return rows


def prefill_table(report: Report) -> str:
    p = report.check("prefill")
    layer = p["layer"]
    columns = [("prompt", "prompt", ","), ("kernel", "kernel", ""), ("ms", "ms", ".3f"), ("TFLOP/s", "tflop_s", ".0f"),
               ("speed / SDPA's", "vs_sdpa", ".2f"), ("largest difference from SDPA", "max_abs_diff", ".1e")]
    title = (f"Prompt attention (FlashAttention), one layer of {layer['n_heads']} query heads on "
             f"{layer['n_kv_heads']} key/value heads of {layer['head_dim']}, causal, from position 0")
    rows = [dict(r, max_abs_diff=r["max_abs_diff"] if r["max_abs_diff"] is not None else 0.0) for r in prefill_rows(report)]
    return table(report, rows, columns, title).replace("| 0.0e+00 |", "| (the reference) |")


def prefill_findings(report: Report) -> str:
    rows = prefill_rows(report)
    bf16 = [r for r in rows if r["format"] == "bf16" and not r["sdpa"] and r["default_tile"]]
    int4 = [r for r in rows if r["format"] == "int4"]
    sdpa = [r for r in rows if r["sdpa"]]
    tiled = [r for r in rows if not r["sdpa"] and r["format"] == "bf16"]
    by_prompt = {p: max((r for r in tiled if r["prompt"] == p), key=lambda r: r["tflop_s"])
                 for p in {r["prompt"] for r in tiled if not r["default_tile"]}}
    text = (f"The Triton FlashAttention kernel reading paged bf16 blocks ran at "
            + ", ".join(f"{r['vs_sdpa']:.2f}x SDPA's speed at {r['prompt']:,}" for r in bf16)
            + f" ({report.where_when}); SDPA's flash kernel reached up to {max(r['tflop_s'] for r in sdpa):.0f} TFLOP/s. "
            f"On 4-bit codes it ran at " + ", ".join(f"{r['vs_sdpa']:.2f}x" for r in int4) + " of SDPA's speed. "
            f"Every output was within the report's tolerance of SDPA's: {all(r['close'] for r in rows)}.")
    for p, best in sorted(by_prompt.items()):
        text += f" Of the tiles tried at {p:,}, the fastest was {best['tile']}."
    return text


def plot_prefill(report: Report) -> Figure:
    """TFLOP/s against the prompt's length: SDPA's flash kernel, the Triton kernel in bf16 and int4."""
    rows = prefill_rows(report)
    fig, ax = plt.subplots(figsize=(8, 4))
    series = {"SDPA flash (contiguous keys)": [r for r in rows if r["sdpa"]],
              "Triton, paged bf16": [r for r in rows if not r["sdpa"] and r["format"] == "bf16" and r["default_tile"]],
              "Triton, paged int4": [r for r in rows if r["format"] == "int4"]}
    for i, (label, mine) in enumerate(series.items()):
        mine = sorted(mine, key=lambda r: r["prompt"])
        ax.plot([r["prompt"] for r in mine], [r["tflop_s"] for r in mine], "o-", color=f"C{i}", label=label)
    spec = spec_sheet(report)
    if spec:
        ax.axhline(spec.peak_flops / 1e12, color="k", ls=":", lw=1, label=f"{spec.name} dense bf16 peak (spec sheet)")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TFLOP/s (causal half of the scores)")
    ax.set_title(f"Prompt attention, one Llama-3.1-8B-shaped layer\n{report.where_when}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------- chapter 17: measured points on the roofline
def roofline_rows(report: Report) -> list[dict]:
    """Each measured step as a roofline point: FLOP/byte and FLOP/s achieved. Decode steps count 2 FLOPs
    per bf16 weight (1 per byte; attention over the short context adds well under 1%); the attention
    kernels count gpu_check's FLOPs over the bytes each must read (prefill: q, k, v and the output)."""
    rows = []
    if "decode" in report.data["checks"]:
        weights = {m: e["weights_bytes"] for m, e in report.check("decode")["models"].items()}
        for r in decode_rows(report):
            if r["tok_s"] and r["mode"] in MODES:
                flops = weights[r["model"]]  # 2 FLOPs x (bytes / 2) parameters
                rows.append({"label": f"{r['model']} decode, {r['mode']}", "kind": "decode step",
                             "intensity": flops / r["bytes_per_token"], "flop_s": flops * r["tok_s"]})
    if "kernel" in report.data["checks"]:
        layer = report.check("kernel")["layer"]
        for r in kernel_rows(report):
            flops = 4 * layer["n_heads"] * layer["head_dim"] * r["context"] * report.check("kernel")["batch"]
            rows.append({"label": f"decode attention {r['format']} {r['context']:,}", "kind": "Triton decode attention",
                         "intensity": flops / r["bytes_read"], "flop_s": flops / (r["kernel_ms"] / 1e3)})
    if "prefill" in report.data["checks"]:
        layer = report.check("prefill")["layer"]
        for r in prefill_rows(report):
            if r["format"] == "bf16" and r["default_tile"]:
                T = r["prompt"]
                nbytes = 2 * T * layer["head_dim"] * (2 * layer["n_heads"] + 2 * layer["n_kv_heads"])
                rows.append({"label": f"prompt attention, {r['kernel']} {T:,}", "kind": "prompt attention "
                             + ("(SDPA)" if r["sdpa"] else "(Triton)"), "intensity": prefill_flops(layer, T) / nbytes,
                             "flop_s": r["tflop_s"] * 1e12})
    return rows


def gpu_ceiling(report: Report) -> Ceiling | None:
    """The roof to draw: the spec sheet's dense bf16 peak with the report's measured copy bandwidth
    (gpu_check measures no FLOP/s ceiling); None when no spec sheet matches the GPU."""
    spec = spec_sheet(report)
    checks = report.data["checks"]
    bw = (checks.get("decode") or {}).get("bandwidth_gb_s") or (checks.get("kernel") or {}).get("copy_bandwidth_gb_s")
    if spec is None or bw is None:
        return None
    return Ceiling(report.gpu, spec.peak_flops, bw * 1e9, spec.memory_bytes, "bf16",
                   f"peak: {spec.name} spec sheet; bandwidth: measured by a 1 GiB device copy")


def roofline_table(report: Report) -> str:
    ceiling = gpu_ceiling(report)
    rows = [dict(r, tflop_s=r["flop_s"] / 1e12,
                 share=r["flop_s"] / ceiling.attainable(r["intensity"]) if ceiling else None)
            for r in roofline_rows(report)]
    columns = [("step", "label", ""), ("FLOP/byte", "intensity", ".1f"), ("TFLOP/s", "tflop_s", ".2f"),
               ("share of the roofline there", "share", ".1%")]
    roof = f" under {ceiling.source}" if ceiling else ""
    return table(report, rows, columns, f"Measured steps as roofline points{roof}")


def plot_roofline(report: Report) -> Figure:
    """Log-log roofline of the report's GPU with its measured steps as points, one marker per kind."""
    rows, ceiling = roofline_rows(report), gpu_ceiling(report)
    fig, ax = plt.subplots(figsize=(9, 5))
    xs = np.logspace(-1, 4.5, 200)
    if ceiling:
        ax.plot(xs, [ceiling.attainable(x) / 1e12 for x in xs], "k-", lw=1.2,
                label=f"roofline ({ceiling.source}); ridge at {ceiling.ridge:.0f} FLOP/byte")
    for i, (kind, marker) in enumerate(zip(dict.fromkeys(r["kind"] for r in rows), "o^sDv")):
        mine = [r for r in rows if r["kind"] == kind]
        ax.scatter([r["intensity"] for r in mine], [r["flop_s"] / 1e12 for r in mine], marker=marker,
                   color=f"C{i}", label=kind, zorder=3)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="TFLOP/s achieved")
    ax.set_title(f"Measured steps on the {report.gpu}'s roofline\n{report.where_when}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    return fig
