"""Where minigen keeps files it makes: converted models and built kernels.

The one place that reads `$MINIGEN_CACHE`; it imports nothing from the package, so every module
(loading, the C kernel) can import it at the top.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and built kernels live: $MINIGEN_CACHE, default ~/.cache/minigen."""
    return Path(os.environ.get("MINIGEN_CACHE") or Path.home() / ".cache" / "minigen")
