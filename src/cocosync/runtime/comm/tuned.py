"""Constants of the runtime that `cocosync tune one-shot` measures on this machine instead of taking the hand-tuned
default: read from $COCOSYNC_<NAME> if set, else from the tuner's file ($COCOSYNC_CACHE_DIR or ~/.cache/cocosync,
tune/constants.json: {"<name>@<local ranks>": value}), else the default. Read once per process."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

__all__ = ["tuned", "constants_path"]


def constants_path() -> Path:
    return Path(os.environ.get("COCOSYNC_CACHE_DIR", Path.home() / ".cache" / "cocosync")) / "tune" / "constants.json"


@functools.lru_cache(maxsize=None)
def _saved() -> dict:
    try:
        return json.loads(constants_path().read_text())
    except (OSError, ValueError):  # no file (the usual case), or a damaged one: the defaults
        return {}


def tuned(name: str, local_ranks: int, default: int) -> int:
    """The value of constant `name` for `local_ranks` ranks per node."""
    env = os.environ.get(f"COCOSYNC_{name.upper()}")
    if env is not None:
        return int(env)
    return int(_saved().get(f"{name}@{local_ranks}", default))
