"""The README's table of how the settings combine, rendered from combinations.py's tables
(scripts/update_readme.py writes it; tests/test_combinations.py checks the README holds it)."""

from __future__ import annotations

import string

from ..combinations import APPLIED, FEATURES, MODEL_WINDOW, REFUSED, REFUSED_SETTINGS, SWITCHES


def combination_table() -> str:
    """The Markdown table of which cache features combine (README, 'How the features combine')."""
    names = list(FEATURES)
    refused: list[str] = []  # numbered notes
    applied: list[str] = []  # lettered notes
    rows = ["| | " + " | ".join(f"`{n}`" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = []
        for b in names:
            pair = frozenset({a, b})
            if a == b:
                cells.append("")
            elif pair in REFUSED:
                note = "{}; {}".format(*REFUSED[pair])
                refused += [note] if note not in refused else []
                cells.append(f"no ({refused.index(note) + 1})")
            elif pair in APPLIED:
                applied += [APPLIED[pair]] if APPLIED[pair] not in applied else []
                cells.append(f"yes ({string.ascii_lowercase[applied.index(APPLIED[pair])]})")
            else:
                cells.append("yes")
        rows.append(f"| `{a}` | " + " | ".join(cells) + " |")
    rows += ["", "Switched on by: " + "; ".join(f"`{n}`: {what}" for n, (_, what) in FEATURES.items()) + ".", ""]
    rows += [f"{i}. Refused: {note}." for i, note in enumerate(refused, 1)]
    rows += [""] + [f"- ({string.ascii_lowercase[i]}) {note}." for i, note in enumerate(applied)]
    rows += ["", "Settings that need another:"]
    rows += [f"- `{key}` with `{other}`: refused: {why}; {fix}." for key, other, _, why, fix in REFUSED_SETTINGS]
    needs: dict[str, list[str]] = {}
    for key, (switch, _, _) in SWITCHES.items():
        needs.setdefault(switch, []).append(f"`{key}`")
    rows += [f"- {', '.join(keys)} only with `{switch}`: set to anything but the default without it, refused."
             for switch, keys in needs.items()]
    rows += ["", "Models with their own sliding window (`ModelConfig.layer_types`: Mistral, Qwen2 with "
             "`use_sliding_window`; chapter 5) get the hybrid cache, a ring per sliding layer and every position "
             "per full layer. Beside it:"]
    rows += [f"- `{feature}`: {verdict}: {how}." for feature, (verdict, how) in MODEL_WINDOW.items()]
    return "\n".join(rows)
