"""Small checks config.py shares: of one setting's value (each raises ConfigError naming the key, the
value and the range), and the keys that are no GenerationConfig field but belong somewhere else."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

# Keys that are settings of another call: where each belongs, as the call to write instead.
MISPLACED_KEYS = {
    "weight_bits": "`load`: minigen.load(name, weight_bits=8)",
    "dtype": "`load`: minigen.load(name, dtype=torch.bfloat16)",
    "max_batch_size": "the serving engine: Engine(model, config, max_batch_size=8)",
    "num_blocks": "the serving engine: Engine(model, config, num_blocks=1024)",
    "max_num_batched_tokens": "the serving engine: Engine(model, config, max_num_batched_tokens=256)",
}
# transformers' generation settings that minigen does not have, and what minigen offers instead
TRANSFORMERS_ONLY_KEYS = {
    "no_repeat_ngram_size": "minigen never bans repeated n-grams: repetition_penalty, frequency_penalty or presence_penalty discourage repeats",
    "min_new_tokens": "minigen has no minimum length: set stop_token_ids=[] to never stop early",
    "typical_p": "minigen has no typical sampling: use min_p, top_p or top_k",
    "max_length": "minigen counts new tokens only: use max_new_tokens",
    "eos_token_id": "minigen stops at stop_token_ids (None: the model's eos)",
    "num_return_sequences": "minigen names it as vLLM and OpenAI do: n (samples a prompt)",
    "output_scores": "minigen records each new token's log-probability and the top k with logprobs=k",
}


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_int(name: str, value: Any, low: int, high: int | None = None, hint: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low \
        and (high is None or value <= high)
    if not ok:
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name}={value!r} is invalid: use an integer {rng}"
                          + (f" {hint}" if hint else ""))


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is invalid: use true or false")
