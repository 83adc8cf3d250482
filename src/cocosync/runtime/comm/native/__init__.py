"""cocosync's native (C++) module, JIT-built once with the system compiler through torch.utils.cpp_extension:
the hot loops of the shared-memory all_reduce (one-shot and three-phase), the streaming copies of large collectives
(one_shot.cpp), the lookup exchange's per-round sorting and packing (lookup_rounds.cpp), row-wise Adagrad on
embedding rows (embedding_rows.cpp) and the replicated hot rows' sync (hot_rows.cpp). Cached in torch's extensions
directory ($TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions; the first build says so on stderr).
`$COCOSYNC_NATIVE=0` turns it off; a build that fails is reported once as a warning and the Python paths, the
references the native ones are tested against, run."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

__all__ = ["one_shot", "enabled", "is_built", "clear_stale_lock"]

#: a build lock older than this is a killed build's (a build takes ~20 s on 2 idle cores): torch would wait forever
STALE_LOCK_SECONDS = 300.0


def enabled() -> bool:
    return os.environ.get("COCOSYNC_NATIVE", "1") != "0"


def _cpu_key() -> str:
    """A short hash of this CPU's model and instruction-set flags: a home directory shared by machines of different
    CPUs keeps one build per kind, so no machine loads code for instructions it lacks."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        lines = []
    return hashlib.sha256("\n".join([platform.machine(), *lines]).encode()).hexdigest()[:10]


def _build_dir() -> tuple[str, Path]:
    from torch.utils import cpp_extension

    name = f"cocosync_one_shot_{_cpu_key()}"  # built for this CPU (-march=native): one build per CPU kind
    return name, Path(cpp_extension._get_build_directory(name, verbose=False))


#: the module's sources, beside this file (one_shot.cpp defines the Python module)
SOURCES = ("one_shot.cpp", "lookup_rounds.cpp", "embedding_rows.cpp", "hot_rows.cpp")


def _sources() -> list[Path]:
    return [Path(__file__).with_name(name) for name in SOURCES]


def is_built() -> bool:
    """Whether this machine has a build of the current sources (else the first `one_shot()` builds it, ~20 s)."""
    built = sorted(_build_dir()[1].glob("*.so"))
    return bool(built) and built[0].stat().st_mtime >= max(src.stat().st_mtime for src in _sources())


@functools.lru_cache(maxsize=None)
def one_shot() -> Any:
    """The built module (OneShot, stream copies, the exchange's sort_lookups/sort_pushes/pack_messages,
    rowwise_adagrad, the hot rows' pack_changes/merge_changes), or None (disabled, or the build failed)."""
    if not enabled():
        return None
    try:
        from torch.utils import cpp_extension

        name, build = _build_dir()
        clear_stale_lock(build / "lock")
        if not is_built():
            print("cocosync: building the native module (all_reduce loops, lookup rounds, embedding rows) once with "
                  f"the system compiler (~20 s; cached in {build})", file=sys.stderr, flush=True)
        return cpp_extension.load(name, [str(src) for src in _sources()], extra_cflags=["-O3", "-march=native"],
                                  verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the Python path runs
        warnings.warn(f"cocosync: the native module did not build ({type(e).__name__}: "
                      f"{str(e)[:300]}); the Python path runs", RuntimeWarning, stacklevel=2)
        return None


def clear_stale_lock(lock: Path, stale_after: float = STALE_LOCK_SECONDS, poll: float = 0.05,
                     say_after: float = 3.0) -> bool:
    """Wait while another process builds (its `lock` exists; torch also holds it briefly for every load's version
    check), saying so once past `say_after` seconds; a lock older than `stale_after` seconds is a killed build's,
    which torch.utils.cpp_extension would wait on forever: remove it, with a warning. Returns whether it removed
    one."""
    said, t0 = False, time.monotonic()
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        if age > stale_after:
            lock.unlink(missing_ok=True)
            warnings.warn(f"cocosync: removed a stale build lock {lock} ({age:.0f} s old: a build that was killed); "
                          "building the native module again", RuntimeWarning, stacklevel=3)
            return True
        if not said and time.monotonic() - t0 >= say_after:
            print(f"cocosync: waiting for another process's build of the native module (lock {lock}; treated as "
                  f"stale after {stale_after:.0f} s)", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll)
