"""What minigen meets of this machine: the files it keeps and writes, its memory and devices, its terminal.

The one place that reads `$MINIGEN_CACHE`; it imports nothing from the package but its errors, so
every module (loading, the C kernel, bench, the serving engine) can import it at the top.
- Files: the checks here return the reason a place cannot be written (None when it can); each
  caller raises its own error with its own fix. Every file the command line writes goes through
  `check_output_path` (before the run) and `write_atomically` / `atomic_path` (after it); every file
  the cache holds has a digest beside it (`write_digest`, `digest_mismatch`).
- Memory and devices: `check_fits` and `check_device` say what was asked, what there is, and the
  fix, in the caller's error class, before the request reaches the allocator or torch, which would
  answer a size past the machine's memory with a bare `MemoryError` (or numpy's
  `_ArrayMemoryError`) and a device that does not exist with an `AssertionError` or `RuntimeError`.
- The terminal: `bar`, a progress bar for long work, drawn on stderr only when it is a terminal.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Iterable, TypeVar

import torch
from torch import Tensor
from tqdm import tqdm

from .errors import ConfigError, MinigenError, ModelLoadError

try:
    import fcntl  # Linux and macOS; Windows has none, and there we do without the lock
except ImportError:
    fcntl = None


def cache_dir() -> Path:
    """Where converted models and built kernels live: $MINIGEN_CACHE, default ~/.cache/minigen."""
    return Path(os.environ.get("MINIGEN_CACHE") or Path.home() / ".cache" / "minigen")


def unwritable_dir(folder: Path) -> str | None:
    """Create `folder` if needed -> why this process cannot make files in it, or None if it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # the folder, or a folder above it, is a file
        above = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), folder)
        return f"{above} is a file, not a folder"
    except OSError as e:  # read-only, or a parent owned by someone else
        return f"cannot create it ({e.strerror})"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "this user cannot write in it (read-only, or owned by another user)"
    return _probe(folder)


def unwritable_file(path: Path) -> str | None:
    """Why `path` cannot be written as a new or replaced file, or None; nothing is left behind.

    Only a regular file (or a link to one) is replaced: a device such as /dev/full, a FIFO or a
    socket would be swapped for a plain file by the rename, which as root removes the device node."""
    if path.is_dir():
        return "it is a folder"
    if path.exists() and not path.is_file():
        return f"it is {_kind(path)}, not a regular file"
    parent = path.parent
    if not parent.is_dir():
        return f"its folder {parent} does not exist" if not parent.exists() else f"{parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"this user cannot write in {parent} (read-only, or owned by another user)"
    return _probe(parent)


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def check_output_path(path: str | os.PathLike, flag: str, error: type[MinigenError]) -> Path:
    """Refuse, before a run, an output file that cannot be written (a missing or read-only folder,
    a folder, a device, a FIFO) -> the path. `flag` is how the user named it (e.g. "--json")."""
    path = Path(path)
    why = unwritable_file(path)
    if why:
        raise error(f"{flag} {path}: cannot write there ({why}); pick a file in a folder you can write")
    return path


@contextlib.contextmanager
def atomic_path(path: Path, flag: str, error: type[MinigenError]) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; on success it is fsynced and renamed over
    `path`, so a reader sees the old file or the new one, never half. An OSError (a full disk,
    a read-only one, a folder removed since) becomes `error` naming the path, the bytes and the fix,
    and the temporary file is removed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:  # the data on disk before the rename makes it visible
            os.fsync(f.fileno())
        if path.exists() and not path.is_file():  # made since the check: never rename over a device
            raise error(f"{flag} {path}: it is {_kind(path)}, not a regular file; pick another path")
        os.replace(tmp, path)
    except OSError as e:
        size = tmp.stat().st_size if tmp.exists() else 0
        fix = ("free some space or pick another disk" if e.errno in (errno.ENOSPC, errno.EDQUOT)
               else "pick a file in a folder you can write")
        raise error(f"{flag} {path}: writing failed after {size:,} bytes ({e.strerror or e}); "
                    f"nothing was written there; {fix}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # only still there when something failed


def write_atomically(path: Path, text: str, flag: str, error: type[MinigenError]) -> None:
    """Write `text` to `path` whole or not at all (atomic_path): the old file stays on any failure."""
    with atomic_path(path, flag, error) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


# ---------------------------------------------------------------- digests of what the cache holds
def digest_path(path: Path) -> Path:
    """Where the digest of a cached file lives: beside it, `<name>.digest.json`."""
    return path.with_name(path.name + ".digest.json")


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_digest(path: Path) -> None:
    """Record `path`'s size and sha256 beside it, written after the file and atomically (a digest
    without its file never exists; a file without a digest is treated as written by an older minigen)."""
    record = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    target = digest_path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def read_digest(path: Path) -> dict | None:
    """The recorded {"size", "sha256"} of `path`, or None when there is none or it is unreadable."""
    try:
        record = json.loads(digest_path(path).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("size"), int) and isinstance(record.get("sha256"), str)
    return record if ok else None


def digest_mismatch(path: Path, record: dict, hash_it: bool = True) -> str | None:
    """How `path` differs from its recorded digest (size first, then sha256 if hash_it), or None."""
    size = path.stat().st_size
    if size != record["size"]:
        return f"it has {size:,} bytes, not the {record['size']:,} written"
    if hash_it and file_sha256(path) != record["sha256"]:
        return "its sha256 differs from the one recorded when it was written (the bytes changed)"
    return None


def _probe(folder: Path) -> str | None:
    """Create and remove a file in `folder` -> why that failed, or None. os.access cannot know
    everything: root passes it even where nothing can be written (/proc, some mounts)."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".minigen-probe-")
    except OSError as e:
        return f"this user cannot write in {folder} ({e.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None


@contextlib.contextmanager
def locked(lock_file: Path):
    """Hold an exclusive lock on `lock_file` for the block; a second process waits here until the
    first leaves. Without fcntl (Windows) the block runs unlocked."""
    if fcntl is None:
        yield
        return
    with open(lock_file, "a") as f:  # the file stays (empty) for the next run: deleting it would race
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- what the cache holds, checked
# Each converted file has `<name>.digest.json` beside it (size and sha256, write_digest). The size
# is checked at every load; the sha256 (0.7 to 0.8 s for SmolLM2's 538 MB on this course's CPU)
# once per process and file, then again only if the file's size or mtime changed.
_hashed: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) whose sha256 matched here


def converted_file_damaged(weights: Path) -> str | None:
    """Why a converted weights file does not hold what was written, or None. Without a digest (a
    cache from an older minigen), the size its own header implies is checked instead."""
    record = read_digest(weights)
    if record is None:
        return safetensors_size_mismatch(weights)
    st = weights.stat()
    key = (str(weights), st.st_size, st.st_mtime_ns)
    why = digest_mismatch(weights, record, hash_it=key not in _hashed)
    if why is None:
        _hashed.add(key)
    return why


def safetensors_size_mismatch(weights: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensors' bytes, whose
    last offset the header gives: a file of another size was cut or appended to."""
    size = weights.stat().st_size
    try:
        with open(weights, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if n <= size else None
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    except Exception:  # short, not JSON, no tensors: all mean the same here
        return f"its header is unreadable ({size:,} bytes)"
    if 8 + n + end != size:
        return f"it has {size:,} bytes, but its header describes {8 + n + end:,}"
    return None


def remove_stale_conversions(root: Path) -> list[Path]:
    """Remove the `.convert-<pid>-*` folders whose process is gone (a conversion killed with
    SIGKILL or by a power cut leaves one: 538 MB for SmolLM2) -> the folders removed. Needs no
    lock: a live conversion's folder is never touched."""
    stale = []
    for tmp in root.glob(".convert-*"):
        pid = tmp.name.split("-")[1]
        if not (pid.isdigit() and _alive(int(pid))):  # a name without a pid predates this naming
            shutil.rmtree(tmp, ignore_errors=True)  # in a read-only cache it stays, and so be it
            if not tmp.exists():
                stale.append(tmp)
    return stale


def _alive(pid: int) -> bool:
    if sys.platform == "win32":  # os.kill(pid, 0) would send CTRL_C_EVENT there: never remove
        return True
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


# ---------------------------------------------------------------- a converted model, written whole or not at all
# config.json, the tokenizer (3.5 MB for SmolLM2) and the safetensors header, above the tensors' bytes
CONVERSION_SLACK_BYTES = 64 * 2**20


def write_converted(folder: Path, hf_cfg: dict, state: dict[str, Tensor],
                    save_tokenizer: Callable[[str], object]) -> None:
    """Write a converted model (config.json, model.safetensors and its digest, the tokenizer) as
    `folder`: into a hidden folder beside it, renamed into place, so an interrupted or failed run
    leaves nothing half-done. Refused before writing when the disk cannot hold it."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    root = folder.parent
    need = check_conversion_space(folder, sum(t.numel() * t.element_size() for t in state.values()))
    # the pid in the name lets a later run tell a conversion in progress from one that was killed
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".convert-{os.getpid()}-"))
    failed = None
    try:
        new = tmp / folder.name
        new.mkdir()
        (new / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        save_file({k: v.contiguous() for k, v in state.items()}, str(new / "model.safetensors"))
        write_digest(new / "model.safetensors")  # after the file: a digest means the file is whole
        save_tokenizer(str(new))
        if folder.exists():  # force=True, or a damaged copy: move it aside, to be removed with tmp
            folder.rename(tmp / "old")
        new.rename(folder)
    except (OSError, SafetensorError) as e:  # the disk filled up anyway (another writer), or went read-only
        failed = e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failed is not None:
        raise ModelLoadError(f"writing the converted {folder.name!r} failed ({short_reason(failed)}); nothing was "
                             f"kept. {no_space_message(folder, need)}") from None


def check_conversion_space(folder: Path, tensor_bytes: int) -> int:
    """Refuse a conversion whose tensors (plus CONVERSION_SLACK_BYTES) the disk cannot hold -> the bytes needed."""
    need = tensor_bytes + CONVERSION_SLACK_BYTES
    if shutil.disk_usage(folder.parent).free < need:
        raise ModelLoadError(f"cannot convert {folder.name!r}: {no_space_message(folder, need)}")
    return need


def no_space_message(folder: Path, need: int) -> str:
    free = shutil.disk_usage(folder.parent).free
    return (f"it needs {need / 1e6:,.0f} MB in the model cache {folder.parent}, which has {free / 1e6:,.0f} MB "
            "free: free some space there, or point MINIGEN_CACHE at a folder on a larger disk "
            "(export MINIGEN_CACHE=/path/with/space)")


def short_reason(e: Exception) -> str:
    return getattr(e, "strerror", None) or str(e).splitlines()[0][:200]


# ---------------------------------------------------------------- memory and devices
GIB = 2**30


def total_memory_bytes(device: torch.device | str = "cpu") -> int:
    """All the memory of `device`: a CUDA device's, or the host's RAM (what is free is smaller)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_bytes(device: torch.device) -> int:
    """Memory free now (the serving engine's pool takes a share of it): CUDA's free memory, or the host's
    MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(needed_bytes: int, what: str, fix: str, error: type[MinigenError] = ConfigError,
               device: torch.device | str = "cpu") -> None:
    """Raise `error` when `needed_bytes` exceed all the memory of `device`: a size no run could hold,
    refused before it is allocated. `what` names the request (e.g. "num_blocks=10**12"); `fix` says what to do."""
    total = total_memory_bytes(device)
    if needed_bytes > total:
        where = "this machine" if torch.device(device).type == "cpu" else f"{torch.device(device)}"
        raise error(f"{what} needs {needed_bytes / GIB:,.1f} GiB; {where} has {total / GIB:,.1f} GiB. {fix}")


def devices() -> list[str]:
    """The devices torch can use here: 'cpu', then 'cuda:0'... and 'mps' where they exist."""
    found = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return found


def check_device(device) -> torch.device:
    """`device` (a str or torch.device) -> torch.device, or ConfigError naming the devices this machine
    has: torch gave an AssertionError for 'cuda' on a CPU-only build and a RuntimeError for 'banana'."""
    here = devices()
    if isinstance(device, torch.device):
        d = device
    elif isinstance(device, str):
        try:
            d = torch.device(device)
        except RuntimeError:
            d = None
    else:
        d = None
    if d is None:
        raise ConfigError(f"device={device!r} is invalid: use a device name or torch.device; this machine "
                          f"has {', '.join(map(repr, here))}")
    index = 0 if d.index is None else d.index
    name = d.type if d.type in ("cpu", "mps") else f"{d.type}:{index}"
    if name not in here:
        raise ConfigError(f"device={device!r} does not exist here: this machine has "
                          f"{', '.join(map(repr, here))}; use one of them (e.g. device='cpu')")
    return d


# ---------------------------------------------------------------- the terminal: progress bars
# A bar is drawn only when stderr is a terminal: piped or captured output (a test, a notebook's cell,
# a CI log, `--json` redirected) stays free of carriage returns and half-drawn bars, and stdout,
# where results and JSON go, never has one.
T = TypeVar("T")


def bar(iterable: Iterable[T] | None = None, **kwargs) -> tqdm:
    """tqdm over `iterable` (or with total=... and .update()), drawn on stderr when it is a terminal."""
    # tqdm.auto would draw a widget in a notebook, where the chapters' outputs are asserted and stored
    return tqdm(iterable, file=sys.stderr, disable=not sys.stderr.isatty(), leave=False, **kwargs)
