"""The data behind a chapter's figure, as JSON, so that a test can tell when a committed figure no
longer matches what its chapter's run draws (issue 46: compare the data, not the pixels).

    fingerprint(fig, exact)          -> {"exact", "structure", "values"}: what the figure shows
    first_difference(old, new)       -> "" or where two fingerprints first differ, in words
    check_against(path, fresh, name) -> raises FigureDataError when a committed sidecar disagrees

`save_figure` (plots.py) writes the fingerprint beside each PNG as NAME.json. The fingerprint keeps
two parts apart:
- structure: the axes, their titles and axis labels, legend labels, the tick labels of categorical
  axes, and how many lines and patches (bars) each axes draws. A figure of measurements is compared on
  its panels' axes alone (another CPU may name other kernels or draw a bar more); an exact one whole. Numbers inside
  these texts are masked ("fit: ∝ N^2.01" is "fit: ∝ N^#"), since labels often carry measurements,
  and so is this machine's CPU name ("measured on <cpu>").
- values, compared only for a figure saved with exact=True (its data is deterministic: counts,
  tokens, steps, bytes): every line's x and y, every bar, every text, every collection and image,
  floats rounded to 3 significant digits. Timings vary from run to run, so a figure of timings is
  compared by structure alone. Long arrays are kept as their length and a digest of the rounded values.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MinigenError

NUMBER = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
# Two floats of an exact figure agree within 1%: another CPU's kernels add in another order, and a
# value near a rounding boundary of the 3 digits kept may round the other way (counts stay exact).
REL_TOL = 0.01
LONG = 64  # arrays longer than this are kept as (length, digest), so a sidecar stays a few kB


class FigureDataError(MinigenError, AssertionError):
    """A chapter drew a figure whose data differs from the committed figures/NAME.json."""


def machine_names() -> list[str]:
    """This machine's CPU names as /proc/cpuinfo and platform say them: a title "measured on <CPU>"
    names the machine that drew it, which is no change in the figure."""
    names = [platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names += [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")][:1]
    except OSError:  # not Linux: platform's name only
        pass
    return sorted({n for n in names if len(n) > 3}, key=len, reverse=True)


MACHINE_NAMES = machine_names()


def masked(text: str) -> str:
    """A label with this machine's name replaced by '<cpu>' and its numbers by '#': the part of a
    label that does not depend on the run or the machine."""
    for name in MACHINE_NAMES:
        text = text.replace(name, "<cpu>")
    return NUMBER.sub("#", text)


def rounded(value: Any) -> Any:
    """A float to 3 significant digits (None for NaN, a string for ±inf); ints and strings as they are."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return None
        return str(v) if math.isinf(v) else float(f"{v:.3g}")
    return str(value)


def array_data(values: Any) -> Any:
    """Numbers of an artist, rounded; a long array as its length and the digest of its rounded values."""
    try:
        flat = np.ma.filled(np.ma.asarray(values, dtype=float), np.nan).ravel()
    except (TypeError, ValueError):  # categorical data (strings) or dates: kept as text
        flat = np.asarray(values, dtype=object).ravel()
    data = [rounded(v) for v in flat]
    if len(data) <= LONG:
        return data
    return {"n": len(data), "sha1": hashlib.sha1(json.dumps(data).encode()).hexdigest()}


def categorical(axis) -> bool:
    """An axis whose tick labels name things (bars' names, claim ids) rather than read off a scale."""
    kind = type(axis.get_major_formatter()).__name__
    return kind in ("FixedFormatter", "StrCategoryFormatter")


def tick_labels(axis) -> list[str]:
    return [t.get_text() for t in axis.get_ticklabels()] if categorical(axis) else []


def legend_labels(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


def axes_title(ax) -> str:
    return " | ".join(t for t in (ax.get_title("left"), ax.get_title(), ax.get_title("right")) if t)


def patch_data(patch) -> Any:
    if hasattr(patch, "get_height") and hasattr(patch, "get_xy"):  # a Rectangle: a bar, a histogram bin
        x, y = patch.get_xy()
        return array_data([x, y, patch.get_width(), patch.get_height()])
    return type(patch).__name__


def collection_data(collection) -> dict:
    data = {"type": type(collection).__name__, "offsets": array_data(collection.get_offsets())}
    if collection.get_array() is not None:  # a scatter's colours, a mesh's cells
        data["array"] = array_data(collection.get_array())
    else:  # broken_barh, fill_between: the extent of each shape
        data["paths"] = array_data([p.get_extents().bounds for p in collection.get_paths()])
    return data


def axes_structure(ax) -> dict:
    return {"title": masked(axes_title(ax)), "xlabel": masked(ax.get_xlabel()), "ylabel": masked(ax.get_ylabel()),
            "xscale": ax.get_xscale(), "yscale": ax.get_yscale(),
            "legend": [masked(t) for t in legend_labels(ax)],
            "xticks": [masked(t) for t in tick_labels(ax.xaxis)], "yticks": [masked(t) for t in tick_labels(ax.yaxis)],
            "lines": len(ax.lines), "patches": len(ax.patches)}


def axes_values(ax) -> dict:
    return {"title": axes_title(ax), "legend": legend_labels(ax),
            "xticks": tick_labels(ax.xaxis), "yticks": tick_labels(ax.yaxis),
            "lines": [{"x": array_data(line.get_xdata()), "y": array_data(line.get_ydata())} for line in ax.lines],
            "patches": [patch_data(p) for p in ax.patches],
            "texts": [t.get_text() for t in ax.texts],
            "collections": [collection_data(c) for c in ax.collections],
            "images": [array_data(im.get_array()) for im in ax.images]}


def fingerprint(fig, exact: bool = False) -> dict:
    """What `fig` shows, as JSON-ready data: structure always compared, values only when `exact`."""
    suptitle = fig.get_suptitle() if hasattr(fig, "get_suptitle") else ""  # matplotlib >= 3.8
    legends = [[t.get_text() for t in legend.get_texts()] for legend in fig.legends]
    return {"exact": exact,
            "structure": {"suptitle": masked(suptitle), "legends": [[masked(t) for t in g] for g in legends],
                          "axes": [axes_structure(ax) for ax in fig.axes]},
            "values": {"suptitle": suptitle, "legends": legends, "texts": [t.get_text() for t in fig.texts],
                       "axes": [axes_values(ax) for ax in fig.axes]}}


def first_difference(old: Any, new: Any, where: str = "") -> str:
    """Where two JSON values first differ, as "axes[1].legend[0]: 'a' -> 'b'"; "" when equal."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in list(old) + [k for k in new if k not in old]:
            if key not in old or key not in new:
                return f"{where}.{key}: {'added' if key not in old else 'removed'}"
            if found := first_difference(old[key], new[key], f"{where}.{key}" if where else key):
                return found
        return ""
    if isinstance(old, list) and isinstance(new, list):
        for i, (a, b) in enumerate(zip(old, new)):
            if found := first_difference(a, b, f"{where}[{i}]"):
                return found
        return "" if len(old) == len(new) else f"{where}: {len(old)} items -> {len(new)}"
    if isinstance(old, float) and isinstance(new, float):  # fp32 sums in another order, on another CPU's kernels
        return "" if math.isclose(old, new, rel_tol=REL_TOL, abs_tol=1e-9) else f"{where}: {old!r} -> {new!r}"
    return "" if old == new else f"{where}: {old!r} -> {new!r}"


# What a figure of measurements must keep on any machine: its panels and what their axes measure. Its
# titles, legends, ticks and artist counts may name this CPU's kernels ("AVX2" against "AVX-512") or
# draw a bar only where a kernel runs, so they are compared only for exact figures, as are the values.
AXES_KEPT = ("xlabel", "ylabel", "xscale", "yscale")


def loose(structure: dict | None) -> list:
    """The part of a figure of measurements that must match on every machine: each panel's axes."""
    return [{k: ax.get(k) for k in AXES_KEPT} for ax in (structure or {}).get("axes", [])]


def compare(committed: dict, fresh: dict) -> str:
    """The first difference that matters: an exact figure's whole structure and values; a figure of
    measurements' panels and axes (loose)."""
    if committed.get("exact") or fresh["exact"]:
        return (first_difference(committed.get("structure"), fresh["structure"], "structure")
                or first_difference(committed.get("values"), fresh["values"], "values"))
    return first_difference(loose(committed.get("structure")), loose(fresh["structure"]), "axes")


def write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def check_against(committed_path: Path, fresh: dict, name: str) -> None:
    """Raise FigureDataError when the committed sidecar exists and differs from `fresh`; a figure
    without a committed sidecar yet passes (`make figures` writes it)."""
    if not committed_path.is_file():
        return
    found = compare(json.loads(committed_path.read_text(encoding="utf-8")), fresh)
    if found:
        raise FigureDataError(f"figure {name!r} no longer matches the committed figures/{name}.png: "
                              f"{found}; run `make figures` to refresh figures/ and commit the PNG and its JSON")
