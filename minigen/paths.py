"""Where minigen keeps files it makes: converted models and built kernels; whether it can write there.

The one place that reads `$MINIGEN_CACHE`; it imports nothing from the package but its errors, so
every module (loading, the C kernel, bench) can import it at the top. The checks here return the
reason a place cannot be written (None when it can); each caller raises its own error with its own
fix. Every file the command line writes goes through `check_output_path` (before the run) and
`write_atomically` / `atomic_path` (after it); every file the cache holds has a digest beside it
(`write_digest`, `digest_mismatch`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import MinigenError

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
