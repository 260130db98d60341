"""Perplexity of SmolLM2 with a quantized KV cache, the longer run that chapter 06 renders and that
`minigen.measure.plan.QUALITY_LOSS` cites: each setting feeds the text one token at a time
(chunk_size=1), so every prediction reads every earlier token back from the quantized cache.

    python scripts/kv_quant_quality.py [--tokens 600] [--json minigen/data/kv_quant_quality.json]
    python scripts/kv_quant_quality.py --add-losses 4:channel:32   # that row's losses, beside the recorded run

About 30 to 100 s per row at 600 tokens on one thread of a two-core CPU (eight rows). The JSON keeps
the date, the machine and the settings with the rows, so a chapter that quotes it says where it came from,
and each token's loss (nats, baseline and every row), so that the chapter can put an interval on a change
by resampling the tokens (a bootstrap) rather than trust one text's mean. --add-losses reruns only the
rows named and keeps their losses beside the recorded run, with this machine and date (`losses`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import minigen  # noqa: E402
from minigen.evaluate import score  # noqa: E402

ROWS = [(8, "channel", 32), (4, "channel", 32), (4, "token", 32), (2, "channel", 32), (2, "token", 32),
        (4, "channel", 128), (4, "token", 128), (2, "channel", 128)]  # (bits, keys per, window)
DEFAULT_JSON = Path(minigen.__file__).parent / "data" / "kv_quant_quality.json"


def machine() -> str:
    """The CPU's model name and core count, as /proc/cpuinfo says (platform's guess elsewhere)."""
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {torch.get_num_threads()} thread(s) of {torch.multiprocessing.cpu_count()} cores"


def token_losses(s) -> list[float]:
    """Each predicted token's loss in nats, rounded to 1e-6 (a bootstrap resamples these; the rounding
    moves a mean over 600 tokens by under 1e-6, far below the 1e-3 the chapter reads)."""
    return [round(v, 6) for v in s.nll.tolist()]


def measure_row(model, ids, base, bits: int, key_axis: str, residual: int) -> dict:
    """One setting, fed one token at a time through its quantized cache, against the fp32 baseline."""
    s = score(model, ids, chunk_size=1, quant_bits=bits, quant_key_axis=key_axis, quant_residual=residual)
    return {"bits": bits, "key_axis": key_axis, "window": residual, "perplexity": s.perplexity,
            "change": s.perplexity / base.perplexity - 1,
            "top1_agreement": (s.top1 == base.top1).float().mean().item(), "nll": token_losses(s)}


def add_losses(model, ids, base, run: dict, settings: list[str]) -> dict:
    """The recorded run with `losses` beside it: this machine's per-token losses for the baseline and the
    rows `settings` names ("4:channel:32"), with their own perplexities, date and machine (another CPU
    rounds fp32 sums in another order, and a 4-bit cache's roundings then flip: the recorded rows stay
    what they were, and the chapter says which machine each number comes from)."""
    if run["tokens"] != len(ids):
        raise SystemExit(f"the recorded run scored {run['tokens']} tokens, this one {len(ids)}: pass --tokens {run['tokens']}")
    recorded = {(r["bits"], r["key_axis"], r["window"]) for r in run["rows"]}
    rows = []
    for setting in settings:
        bits, key_axis, residual = setting.split(":")
        key = (int(bits), key_axis, int(residual))
        if key not in recorded:
            raise SystemExit(f"--add-losses {setting}: the recorded run has no such row; it has {sorted(recorded)}")
        rows.append(measure_row(model, ids, base, *key))
        print({k: v for k, v in rows[-1].items() if k != "nll"}, flush=True)
    run["losses"] = {"date": datetime.date.today().isoformat(), "machine": machine(), "torch": torch.__version__,
                     "baseline_perplexity": base.perplexity, "baseline_nll": token_losses(base), "rows": rows}
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--add-losses", nargs="+", metavar="BITS:AXIS:WINDOW",
                        help="rerun only these rows and keep their losses beside the run recorded in --json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the chapter runs: a second thread waits on a shared machine
    model, tokenizer = minigen.load("smollm2-135m")
    text = (Path(minigen.__file__).parent / "data" / "english.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt").input_ids[0][:args.tokens]  # [T]
    base = score(model, ids)  # fp32 cache, one pass: the same logits as fed token by token
    if args.add_losses:
        run = add_losses(model, ids, base, json.loads(args.json.read_text(encoding="utf-8")), args.add_losses)
    else:
        rows = []
        for bits, key_axis, residual in ROWS:
            rows.append(measure_row(model, ids, base, bits, key_axis, residual))
            print({k: v for k, v in rows[-1].items() if k != "nll"}, flush=True)
        run = {"date": datetime.date.today().isoformat(), "machine": machine(), "torch": torch.__version__,
               "tokens": args.tokens, "group_size": 32, "scales": "bf16 scales and zeros (an fp32 model)",
               "baseline_perplexity": base.perplexity, "baseline_nll": token_losses(base), "rows": rows}
    args.json.write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
