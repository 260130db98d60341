"""The report of `minigen bench` (bench.run_bench's result), as the terminal shows it: the machine,
the settings, one row per engine, and the ratios measured side by side in the one run."""

from __future__ import annotations

from ..kernels.probes import SLOWER, Measurement


def print_report(result: dict, explain: bool = False) -> None:
    """The report of run_bench; explain=True adds each minigen engine's plan: what ran, in words."""
    hw = result["hardware"]
    print(f"\nhardware: {hw['cpu']} | {hw['threads']} threads | torch {hw['torch']} | GPU: {hw['gpu'] or 'none'}")
    if "cpu_kernel" in hw and not hw["gpu"]:
        print(f"minigen's batch-1 matrix-vector kernel: {hw['cpu_kernel']}")
    if hw.get("fastpaths"):  # kernels/fastpaths.py: ratio = reference time / fast time, at one thread
        print(f"fast paths measured here ({hw['fastpaths']['threads']} thread; below {SLOWER}x a path stands aside):")
        for m in hw["fastpaths"]["measured"]:
            print("  " + Measurement(**m).line())
    print(f"model {result['model']} ({result['dtype']}), prompt {result['prompt_len']} tokens, "
          f"{result['new_tokens']} new tokens, median of {result['repeats']}")
    if "precision" in result:
        prefill = result.get("config", {}).get("prefill_precision", "float32")
        print(f"minigen's precision: {result['precision']}; a prompt's products "
              + {"float32": "in fp32", "int8": "with int8 inputs and int32 sums (prefill_precision)"}.get(
                  prefill, f"with {prefill} inputs and fp32 sums (prefill_precision)")
              + (f"; compiled in {result['compile_s']:.1f} s (the warm-up run; timed runs reuse it)"
                 if result.get("compile_s") else ""))
    steps = {name: r["step"] for name, r in result["engines"].items() if r.get("step")}
    if steps:  # fused: every layer of a token in one C call (steps/fused.py); eager: op by op in torch
        print("minigen's decode step: " + ", ".join(f"{name} {step}" for name, step in steps.items()))
    for name, r in result["engines"].items() if explain else ():
        if r.get("plan"):
            print(f"{name}'s plan:\n" + "\n".join("  " + line for line in r["plan"].splitlines()))
    if result.get("weight_bits"):
        print(f"minigen's weights: int{result['weight_bits']} (linear layers; the output head int8), "
              f"packed: the roofline counts the packed bytes")
    w = max(14, *(len(name) + 2 for name in result["engines"]))  # the engine column fits its longest name
    print(f"{'engine':<{w}}{'decode tok/s':>14}{'TTFT ms':>10}{'prefill tok/s':>15}{'peak MiB':>10}{'KV MiB':>9}"
          f"{'MB/step':>9}{'of roofline':>13}")
    for name, r in result["engines"].items():
        prefill = r.get("prefill_tokens_per_s", result["prompt_len"] / r["ttft_s"])  # a result saved before the column
        print(f"{name:<{w}}{r['decode_tokens_per_s']:>14.1f}{r['ttft_s'] * 1000:>10.0f}{prefill:>15.0f}"
              f"{r['peak_memory_bytes'] / 2**20:>10.0f}{r['kv_cache_bytes'] / 2**20:>9.2f}"
              f"{r.get('bytes_per_token', result['bytes_per_token']) / 1e6:>9.0f}{r['roofline_fraction']:>12.0%}")
    probes = hw.get("memory_read_gb_s_probes")  # absent from a saved result that holds one reading
    when = (f"the better of {', '.join(f'{b:.1f}' for b in probes)} before and after the runs" if probes
            else "measured now")
    print(f"memory read bandwidth ({when}): {hw['memory_read_gb_s']:.1f} GB/s; "
          f"bytes per decode step (minigen): {result['bytes_per_token'] / 1e6:.0f} MB; "
          f"roofline: {result['roofline_tokens_per_s']:.1f} tok/s")
    if "speedup_vs_unquantized" in result:
        print(f"minigen int{result['weight_bits']} / minigen {result['dtype']} decode: "
              f"{result['speedup_vs_unquantized']:.2f}x (same run)")
    if "speedup_vs_float32" in result:
        print(f"minigen {result['dtype']} / minigen float32 decode: {result['speedup_vs_float32']:.2f}x (same run)")
    if "speedup_vs_llama_cpp" in result:  # a float in a result saved before llama.cpp raced in several formats
        ratios = result["speedup_vs_llama_cpp"]
        ratios = ratios if isinstance(ratios, dict) else {"llama.cpp": ratios}
        print("minigen / " + ", ".join(f"{name}: {r:.2f}x" for name, r in ratios.items()) + " decode")
    if "speculation" in result:
        sp = result["speculation"]
        print(f"speculative ({sp['method']}, k={sp['k']}"
              + (f", draft {result['draft']}, c={sp['draft_cost']:.2f}" if result.get("draft") else "") + "): "
              f"{sp['accepted_tokens']} of {sp['draft_tokens']} proposals accepted ({sp['acceptance_rate']:.0%}), "
              f"{sp['mean_acceptance_length']:.2f} tokens per target forward (alpha {sp['alpha']:.2f}); "
              f"minigen / minigen plain decode: {sp['speedup_vs_plain']:.2f}x (same run), "
              f"the speed model predicts {sp['predicted_speedup']:.2f}x")
    if "structured" in result:
        st = result["structured"]
        print(f"{st['plan']}; the reply took {st['reply_tokens']} of the {result['new_tokens']} tokens (the mask then "
              f"allows only the stop token): minigen / minigen unmasked decode: {st['speedup_vs_unmasked']:.2f}x (same run)")
    engines = result["engines"]
    if "minigen" in engines:  # prefill: prompt tokens over TTFT, each engine beside minigen's, same run
        others = [name for name in engines if name in ("minigen float32", "minigen plain", "transformers")
                  or name.startswith("llama.cpp")]
        if others:
            ratio = {name: engines[name]["ttft_s"] / engines["minigen"]["ttft_s"] for name in others}
            print(f"prefill of {result['prompt_len']} tokens (prompt tokens / TTFT), minigen / "
                  + ", ".join(f"{name}: {r:.2f}x" for name, r in ratio.items()) + " (same run)")
    if "speedup" in result:
        print(f"minigen / transformers decode: {result['speedup']:.2f}x; greedy tokens agree: "
              f"{result['greedy_token_agreement']:.1%} ({'exact config' if result['exact'] else 'lossy config'}"
              f"{'' if result['dtype'] == 'float32' else '; asserted in float32 only'})")
