"""Where the project keeps what it computes once per machine (converted models, tokenised data)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where the project keeps converted models; `RLHF_CACHE_DIR` overrides `~/.cache/rlhf_pipeline`."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlhf_pipeline"
    return Path(os.environ.get("RLHF_CACHE_DIR", default))
