"""Where minigen keeps files it makes: converted models and built kernels; whether it can write there.

The one place that reads `$MINIGEN_CACHE`; it imports nothing from the package, so every module
(loading, the C kernel, bench) can import it at the top. The checks here return the reason a
place cannot be written (None when it can); each caller raises its own error with its own fix.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

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
    """Why `path` cannot be written as a new or replaced file, or None; nothing is left behind."""
    if path.is_dir():
        return "it is a folder"
    parent = path.parent
    if not parent.is_dir():
        return f"its folder {parent} does not exist" if not parent.exists() else f"{parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"this user cannot write in {parent} (read-only, or owned by another user)"
    return _probe(parent)


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
