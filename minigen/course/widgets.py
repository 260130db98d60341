"""The chapters' interactive panels (ipywidgets; the course's layer: the core never imports this).

    quant_panel(keys, values, cfg)   -> sliders for bits, group size and full-precision window,
                                        showing the cache's memory and the round-trip error live
    window_panel(model, ids)         -> sliders for window and sinks (layer, head), showing the
                                        head's attention map, its entropy and the perplexity live;
                                        it opens on the head teaching_head(model, ids) measures
    snapshot_html(state, model_id)   -> a panel drawn as static HTML from a notebook's saved widget
                                        state, as the static book shows it (no JavaScript, no kernel)
"""

from __future__ import annotations

import html

import torch
from torch import Tensor

from ..checkpoints.model_config import ModelConfig
from ..numerics.quant import GROUP_AXIS, VALUE_AXIS, round_trip
from ..caches.quantized import QuantizedKVCache


# ---------------------------------------------------------------- chapter 6: KV quantization
def _quant_numbers(keys: Tensor, values: Tensor, cfg: ModelConfig, bits: int, group_size: int,
                   residual: int, key_axis: str, context: int, dtype: torch.dtype = torch.float16) -> dict:
    """Memory of a QuantizedKVCache for `context` tokens of a `dtype` model, and the relative RMS
    round-trip error on keys and values [Hkv, S, Dh] of one layer (their last `residual` tokens kept exact)."""
    residual = max(residual, group_size)  # the window holds at least one group
    cache = QuantizedKVCache(cfg.n_layers, 1, cfg.n_kv_heads, context, cfg.head_dim, bits, group_size,
                             key_axis, residual, dtype, device="meta")  # sizes only, no memory
    stored = cache.n_quantized(keys.shape[1])  # tokens of the captured layer that left the window

    def error(x: Tensor, axis: int) -> float:
        x_hat = torch.cat([round_trip(x[:, :stored], bits, group_size, axis), x[:, stored:]], dim=1)
        return ((x_hat - x).norm() / x.norm()).item()

    return {"bytes": cache.nbytes,
            "codes": cache.k.data.nbytes + cache.v.data.nbytes,
            "scales_zeros": sum(t.nbytes for t in (cache.k.scales, cache.k.zeros, cache.v.scales, cache.v.zeros)),
            "window": cache.k_window.nbytes + cache.v_window.nbytes,
            "fp16": context * cfg.kv_bytes_per_token(2), "fp32": context * cfg.kv_bytes_per_token(4),
            "key_error": error(keys, GROUP_AXIS[key_axis]), "value_error": error(values, VALUE_AXIS),
            "residual": residual}


def quant_panel(keys: Tensor, values: Tensor, cfg: ModelConfig, context: int = 4096,
                dtype: torch.dtype = torch.float16):
    """Sliders (bits, group size, full-precision window, key axis) over real keys and values
    [Hkv, S, Dh] of one layer: shows the bytes of a `dtype` model's cache at `context` tokens (an
    fp16 model's by default, the article's comparison) and the round-trip error.

    Returns the widget box; `box.numbers()` gives the numbers currently shown (for asserts)."""
    import ipywidgets as w

    bits = w.SelectionSlider(options=[2, 4, 8], value=4, description="bits")
    group = w.SelectionSlider(options=[8, 16, 32, 64], value=32, description="group size")
    window = w.IntSlider(value=32, min=8, max=512, step=8, description="fp window")
    axis = w.ToggleButtons(options=["channel", "token"], value="channel", description="keys per")
    out = w.HTML()

    def numbers() -> dict:
        return _quant_numbers(keys, values, cfg, bits.value, group.value, window.value, axis.value, context, dtype)

    dtype_name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]

    def show(_=None) -> None:
        n = numbers()
        mb = lambda b: f"{b / 1e6:,.1f} MB"  # noqa: E731
        note = f" (raised to one group: {n['residual']})" if n["residual"] != window.value else ""
        out.value = (
            f"<b>KV cache of a {dtype_name} model, {context:,} tokens</b>: {mb(n['bytes'])} = codes "
            f"{mb(n['codes'])} + {dtype_name} scales and zeros {mb(n['scales_zeros'])} + {dtype_name} window "
            f"{mb(n['window'])}{note}<br>"
            f"{n['fp16'] / n['bytes']:.2f}x smaller than fp16 ({mb(n['fp16'])}), "
            f"{n['fp32'] / n['bytes']:.2f}x smaller than fp32 ({mb(n['fp32'])})<br>"
            f"<b>round-trip error</b> on this layer's {keys.shape[1]} real tokens (relative RMS): "
            f"keys {n['key_error']:.2%}, values {n['value_error']:.2%}")

    for control in (bits, group, window, axis):
        control.observe(show, names="value")
    show()
    box = w.VBox([w.HBox([bits, group]), w.HBox([window, axis]), out])
    box.numbers = numbers
    return box


# ---------------------------------------------------------------- chapter 7: window and sinks
LOG_FLOOR = 1e-3  # the map's colour floor: attention below it, and masked keys, are drawn black
SATURATED = 0.9  # attention at or above it is drawn at the top of the colour scale


def map_structure(probs: Tensor) -> float:
    """Share of the map's pixels [T, T] that are neither black (below LOG_FLOOR) nor saturated
    (SATURATED or more) on the panel's log colour scale: near 0 for a head that reads one token."""
    visible = (probs >= LOG_FLOOR) & (probs < SATURATED)
    return visible.float().mean().item()


def window_numbers(model, ids: Tensor, window_size: int | None, sink_tokens: int, layer: int,
                   head: int) -> dict:
    """One masked pass of ids [T] under a window with sinks: the perplexity, the attention map
    [T, T] of one layer and head, every query's entropy [T] (nats) for that head, and the share
    of the map's pixels that show structure (map_structure)."""
    from ..entropy import entropy
    from ..evaluate import score

    captured = {}

    def capture(l: int, probs: Tensor) -> None:
        if l == layer:
            captured["probs"] = probs[0, head].float()  # [T, T]

    overrides = {} if window_size is None else dict(window_size=window_size, sink_tokens=sink_tokens)
    s = score(model, ids, use_cache=False, observers=(capture,), **overrides)
    probs = captured["probs"]
    return {"perplexity": s.perplexity, "probs": probs, "entropy": entropy(probs),
            "sink_mass": probs[:, :max(sink_tokens, 1)].sum(-1).mean().item(), "structure": map_structure(probs)}


def teaching_head(model, ids: Tensor, window_size: int = 32, sink_tokens: int = 4,
                  sink_share: tuple[float, float] = (0.1, 0.9)) -> tuple[int, int]:
    """(layer, head) whose map shows both the window and its sinks, chosen by measuring: among the
    heads whose sinks get a visible share of the attention (between sink_share's bounds, averaged
    over the queries past the window), the one with the highest mean entropy under that window.

    A head that parks everything on token 0 has entropy near 0 and shows one bright column; a head
    that reads its window evenly but ignores the sinks shows no sink. ids [T], T > window_size."""
    from ..entropy import entropy
    from ..evaluate import score

    maps = {}
    score(model, ids, use_cache=False, window_size=window_size, sink_tokens=sink_tokens,
          observers=(lambda l, probs: maps.__setitem__(l, probs[0].float()),))
    probs = torch.stack([maps[l] for l in sorted(maps)])  # [L, H, T, T]
    late = probs[:, :, window_size:]  # queries whose window has left the sinks: [L, H, T - W, T]
    share = late[..., :sink_tokens].sum(-1).mean(-1)  # [L, H]
    mean_entropy = entropy(probs).mean(-1)  # [L, H], nats
    eligible = (share >= sink_share[0]) & (share <= sink_share[1])
    if not eligible.any():
        raise ValueError(f"no head gives its sinks between {sink_share[0]:.0%} and {sink_share[1]:.0%}")
    best = int(mean_entropy.masked_fill(~eligible, float("-inf")).argmax())
    return divmod(best, probs.shape[1])


def window_panel(model, ids: Tensor, layer: int | None = None, head: int | None = None):
    """Sliders for window and sinks (and layer, head) over the text ids [T] (keep T under ~200):
    shows the head's attention map, its entropy per query, and the text's perplexity, live.
    Without a layer and head it opens on teaching_head's choice for its default window and sinks.

    The map is drawn on a log scale from LOG_FLOOR to 1, so a sink column does not wash out the
    window's keys. Returns the widget box; `box.numbers()` gives what is shown (for asserts)."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    T = len(ids)
    cfg = model.config
    window = w.IntSlider(value=min(32, T), min=1, max=T, description="window")
    sinks = w.IntSlider(value=4, min=0, max=16, description="sinks")
    if layer is None or head is None:
        layer, head = teaching_head(model, ids, window.value, min(sinks.value, window.value))
    layer_s = w.IntSlider(value=layer, min=0, max=cfg.n_layers - 1, description="layer")
    head_s = w.IntSlider(value=head, min=0, max=cfg.n_heads - 1, description="head")
    text, plot = w.HTML(), w.Output()

    def numbers() -> dict:
        s = min(sinks.value, window.value)  # more sinks than the window is a ConfigError
        return window_numbers(model, ids, window.value, s, layer_s.value, head_s.value)

    def show(_=None) -> None:
        n = numbers()
        text.value = (f"<b>perplexity</b> of these {T} tokens: {n['perplexity']:.2f} &nbsp; "
                      f"<b>mean entropy</b> of layer {layer_s.value}, head {head_s.value}: "
                      f"{n['entropy'].mean():.2f} nats &nbsp; <b>attention on the first token(s)</b>: "
                      f"{n['sink_mass']:.0%}")
        with plot:
            plot.clear_output(wait=True)
            fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
            # log scale with a stated floor: a sink column near 1 and window keys near 1/W both show
            im = a.imshow(n["probs"].clamp(min=LOG_FLOOR).log10().numpy(), cmap="magma", aspect="auto",
                          vmin=torch.tensor(LOG_FLOOR).log10().item(), vmax=0)
            fig.colorbar(im, ax=a, label=f"log10 attention (black: below {LOG_FLOOR:g}, or masked)")
            a.set(xlabel="key position", ylabel="query position",
                  title=f"attention (log scale), layer {layer_s.value} head {head_s.value}")
            b.plot(n["entropy"].numpy())
            b.plot(torch.arange(1, T + 1).float().log().numpy(), ":", color="grey", label="log(keys): uniform")
            b.set(xlabel="query position", ylabel="entropy (nats)", title="entropy of each query's attention")
            b.legend(fontsize=8)
            plt.show()

    for control in (window, sinks, layer_s, head_s):
        control.observe(show, names="value")
    show()
    box = w.VBox([w.HBox([window, sinks]), w.HBox([layer_s, head_s]), text, plot])
    box.numbers = numbers
    return box


# ---------------------------------------------------------------- the static book's snapshots
LIVE_NOTE = ("This panel is live in JupyterLab (<code>make lab</code>, then run this chapter's cells): "
             "move its controls there. What follows is a snapshot of its default state, as the book's "
             "build ran it; the controls are drawn, not live.")
_ROW = "display:flex;flex-wrap:wrap;gap:0.3em 1.5em;align-items:center"


_CONTROLS = ("SliderModel", "ButtonsModel", "ButtonModel", "DropdownModel", "CheckboxModel", "TextModel",
             "SelectModel", "PickerModel")  # model names of the widgets a reader moves


def snapshot_html(state: dict, model_id: str) -> str:
    """The widget `model_id` (and its children) drawn as static HTML from the widget state that
    Jupyter saves in a notebook's metadata (`{model_id: {"model_name": ..., "state": {...}}}`):
    sliders and buttons show their values, HTML widgets their text, Output widgets their images.
    A panel with controls gets LIVE_NOTE; a widget without any (a finished progress bar) is drawn plain."""
    if not _has_controls(state, model_id):
        return f'<div class="minigen-widget">{_draw(state, model_id)}</div>'
    return (f'<div class="minigen-snapshot" style="border:1px solid #ccc;border-radius:4px;padding:0.6em">'
            f'<p style="font-size:0.9em;margin:0 0 0.6em 0"><em>{LIVE_NOTE}</em></p>{_draw(state, model_id)}</div>')


def _has_controls(state: dict, model_id: str) -> bool:
    entry = state.get(model_id.removeprefix("IPY_MODEL_"), {"model_name": "", "state": {}})
    return (entry["model_name"].endswith(_CONTROLS)
            or any(_has_controls(state, c) for c in entry["state"].get("children", [])))


def _draw(state: dict, model_id: str) -> str:
    entry = state.get(model_id.removeprefix("IPY_MODEL_"))
    if entry is None:  # a model the kernel never sent: say so rather than draw nothing
        return "<em>(a control whose state was not saved)</em>"
    name, s = entry["model_name"], entry["state"]
    label = (f'<span style="min-width:5em;display:inline-block">{html.escape(s["description"])}</span> '
             if s.get("description") else "")
    if name in ("VBoxModel", "HBoxModel", "BoxModel", "GridBoxModel"):
        style = _ROW if name == "HBoxModel" else "display:flex;flex-direction:column;gap:0.4em"
        return f'<div style="{style}">' + "".join(_draw(state, c) for c in s.get("children", [])) + "</div>"
    if name in ("IntSliderModel", "FloatSliderModel", "SelectionSliderModel"):
        if name == "SelectionSliderModel":
            labels = s["_options_labels"]
            low, high, value, shown = 0, len(labels) - 1, s["index"], labels[s["index"]]
        else:
            low, high, value, shown = s["min"], s["max"], s["value"], s["value"]
        return (f'<span>{label}<input type="range" disabled min="{low}" max="{high}" value="{value}" '
                f'aria-label="{html.escape(s.get("description", ""))}"> <b>{html.escape(str(shown))}</b></span>')
    if name in ("ToggleButtonsModel", "DropdownModel", "RadioButtonsModel"):
        labels, index = s["_options_labels"], s.get("index")
        items = [f'<b style="border:1px solid #888;padding:0 0.4em">{html.escape(t)}</b>' if i == index
                 else f'<span style="padding:0 0.4em;color:#666">{html.escape(t)}</span>' for i, t in enumerate(labels)]
        return f"<span>{label}{' '.join(items)}</span>"
    if name in ("FloatProgressModel", "IntProgressModel"):
        return f'<span>{label}<progress value="{s["value"]}" max="{s["max"]}"></progress></span>'
    if name in ("HTMLModel", "HTMLMathModel", "LabelModel"):
        value = s.get("value", "")  # HTML written by our own panels, shown as the kernel sent it
        return f"<div>{label}{value if name != 'LabelModel' else html.escape(value)}</div>"
    if name == "OutputModel":
        return "<div>" + "".join(_output_html(o) for o in s.get("outputs", [])) + "</div>"
    return f"<em>(a {html.escape(name.removesuffix('Model'))} control)</em>"


def _output_html(output: dict) -> str:
    """One Jupyter output (display_data, stream, ...) of an Output widget as HTML: images inline."""
    data = output.get("data", {})
    if "image/png" in data:
        alt = html.escape(str(data.get("text/plain", "figure")))
        return f'<img src="data:image/png;base64,{data["image/png"].strip()}" alt="{alt}" style="max-width:100%">'
    if "text/html" in data:
        return data["text/html"] if isinstance(data["text/html"], str) else "".join(data["text/html"])
    text = output.get("text") or data.get("text/plain", "")
    text = text if isinstance(text, str) else "".join(text)
    return f"<pre>{html.escape(text)}</pre>" if text else ""
