"""What this machine has: its devices and their memory, and the checks that refuse what it cannot
hold or run before anything is allocated or loaded.

A size past the machine's memory used to reach the allocator and come back as a bare
`MemoryError` (or numpy's `_ArrayMemoryError`); a device that does not exist came back as torch's
`AssertionError` or `RuntimeError`. `check_fits` and `check_device` say what was asked, what
there is, and the fix, in the caller's error class.
"""

from __future__ import annotations

import os

import torch

from .errors import ConfigError, MinigenError

GIB = 2**30


def total_memory_bytes(device: torch.device | str = "cpu") -> int:
    """All the memory of `device`: a CUDA device's, or the host's RAM (what is free is smaller)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
