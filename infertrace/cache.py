"""Where infertrace keeps what it makes for itself: the built-in models and the records of live captures."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """INFERTRACE_CACHE, else ~/.cache/infertrace."""
    return Path(os.environ.get("INFERTRACE_CACHE") or Path.home() / ".cache" / "infertrace")
