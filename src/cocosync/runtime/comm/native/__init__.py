"""cocosync's native (C++) module, JIT-built once with the system compiler through torch.utils.cpp_extension:
the hot loops of the shared-memory all_reduce (one-shot and three-phase), the streaming copies of large collectives
(one_shot.cpp), the lookup exchange's per-round sorting and packing (lookup_rounds.cpp), row-wise Adagrad on
embedding rows (embedding_rows.cpp) and the replicated hot rows' sync (hot_rows.cpp). Cached in torch's extensions
directory ($TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions; the first build says so on stderr), under a name
hashed from what the module depends on (`build_name`), built and loaded under a lock the kernel releases when its
holder dies (`build_lock`).
`$COCOSYNC_NATIVE=0` turns it off; a build that fails is reported once as a warning and the Python paths, the
references the native ones are tested against, run."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

__all__ = ["one_shot", "enabled", "is_built", "build_lock", "build_name"]

#: say once that another process's build is being waited for, past this many seconds
SAY_AFTER_SECONDS = 3.0


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


def build_name(sources: list[Path] | None = None) -> str:
    """The build's name: a hash of what the built module depends on (this CPU's kind, the sources' bytes, torch's
    version and include paths, Python's version). Checkouts with the same sources share one build; a checkout with
    other sources gets its own (no two checkouts rebuild each other's module), and no machine loads code built for
    instructions its CPU lacks."""
    from torch.utils import cpp_extension

    h = hashlib.sha256(_cpu_key().encode())
    for src in sources if sources is not None else _sources():
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    h.update("\0".join([torch_version(), sys.version, *cpp_extension.include_paths()]).encode())
    return f"cocosync_native_{h.hexdigest()[:16]}"


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def _build_dir() -> tuple[str, Path]:
    from torch.utils import cpp_extension

    name = build_name()
    return name, Path(cpp_extension._get_build_directory(name, verbose=False))


#: the module's sources, beside this file (one_shot.cpp defines the Python module)
SOURCES = ("one_shot.cpp", "lookup_rounds.cpp", "embedding_rows.cpp", "hot_rows.cpp")


def _sources() -> list[Path]:
    return [Path(__file__).with_name(name) for name in SOURCES]


def _staged_sources(build: Path) -> list[Path]:
    """The sources copied into the build's own directory (once; their bytes are in its name): torch's loader keys
    a build by its sources' paths too, so two checkouts compiling from their own paths would rebuild each other's
    module."""
    staged = build / "sources"
    staged.mkdir(parents=True, exist_ok=True)
    out = []
    for src in _sources():
        dst = staged / src.name
        data = src.read_bytes()
        if not dst.is_file() or dst.read_bytes() != data:
            tmp = dst.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
        out.append(dst)
    return out


def is_built() -> bool:
    """Whether this machine has a build of the current sources (else the first `one_shot()` builds it, ~20 s)."""
    return any(_build_dir()[1].glob("*.so"))


@functools.lru_cache(maxsize=None)
def one_shot() -> Any:
    """The built module (OneShot, stream copies, the exchange's sort_lookups/sort_pushes/pack_messages,
    rowwise_adagrad, the hot rows' pack_changes/merge_changes), or None (disabled, or the build failed)."""
    if not enabled():
        return None
    try:
        from torch.utils import cpp_extension

        name, build = _build_dir()
        with build_lock(build):
            if not is_built():
                print("cocosync: building the native module (all_reduce loops, lookup rounds, embedding rows) once "
                      f"with the system compiler (~20 s; cached in {build})", file=sys.stderr, flush=True)
            return cpp_extension.load(name, [str(src) for src in _staged_sources(build)],
                                      extra_cflags=["-O3", "-march=native"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the Python path runs
        warnings.warn(f"cocosync: the native module did not build ({type(e).__name__}: "
                      f"{str(e)[:300]}); the Python path runs", RuntimeWarning, stacklevel=2)
        return None


@contextlib.contextmanager
def build_lock(build: Path, *, say_after: float = SAY_AFTER_SECONDS) -> Iterator[None]:
    """Hold the build's lock: an flock on `<build>.lock`, which the kernel releases when its holder exits, however
    it exits. Every cocosync process loads the module under it, so torch's own build lock (`<build>/lock`, a file
    that a killed build leaves behind, on which torch would wait forever) found here is a dead build's: it is
    removed. A live build is waited for, saying so once past `say_after` seconds, with the builder's pid."""
    build.parent.mkdir(parents=True, exist_ok=True)
    path = build.parent / f"{build.name}.lock"
    with open(path, "a+") as f:
        t0, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said and time.monotonic() - t0 >= say_after:
                    f.seek(0)
                    holder = f.read().strip() or "?"
                    print(f"cocosync: waiting for another process's build of the native module (pid {holder}, lock "
                          f"{path})", file=sys.stderr, flush=True)
                    said = True
                time.sleep(0.05)
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            baton = build / "lock"
            if baton.exists():
                baton.unlink(missing_ok=True)
                warnings.warn(f"cocosync: removed {baton}, left by a build that was killed; building the native "
                              "module again", RuntimeWarning, stacklevel=3)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
