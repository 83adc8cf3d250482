"""DCP's file reader whose metadata cannot run code: a checkpoint's `.metadata` (a pickle) is read by an unpickler
that knows only DCP's own metadata classes, so a crafted one is refused naming what it holds.

Its own module because it subclasses DCP's reader: importing torch.distributed.checkpoint costs a process ~1.5 s
of CPU, which checkpoint.py and the launcher now pay only when they save or read one (BENCHMARKS.md, "A job's fixed
cost")."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from cocosync.shadowsync.errors import CheckpointError

__all__ = ["SafeReader"]

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("collections", "OrderedDict")}


class _Refused(pickle.UnpicklingError):
    """The metadata names a global outside DCP's metadata classes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type) or name == "_MEM_FORMAT_ENCODING":  # classes (dataclasses, enums) only
                return obj
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


class SafeReader(FileSystemReader):
    """DCP's file reader whose metadata cannot run code (a crafted .metadata is refused naming what it holds)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except _Refused as e:
            raise CheckpointError(f"refused to load {str(self.path)!r}: its .metadata holds an object ({e}) that "
                                  "loading would have to call; a checkpoint holds only tensors and DCP's metadata") \
                from None
        except Exception as e:  # noqa: BLE001 - a damaged or cut file
            raise CheckpointError(f"cannot read checkpoint {str(self.path)!r}: damaged .metadata "
                                  f"({type(e).__name__}: {str(e)[:200]})") from None
        _check_files(Path(self.path), metadata)
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_files(path: Path, metadata: Any) -> None:
    """Every data file the metadata names is there and holds the bytes it names: a checkpoint saved across machines
    to directories they do not share has only this machine's files (each saved its part to its own --out), and a
    copy cut short misses the end of one. Either was a FileNotFoundError, or a read past a file's end, mid-load."""
    need: dict[str, int] = {}
    root = path.resolve()
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str):
            raise CheckpointError(f"refused to load {str(path)!r}: its .metadata names a data file by "
                                  f"{type(name).__name__}, not a file name")
        target = (root / name).resolve()
        if Path(name).is_absolute() or target.parent != root:  # '../other-run/...', '/etc/...', a link out of it
            raise CheckpointError(f"refused to load {str(path)!r}: its .metadata names the data file {name!r}, "
                                  "which is not a file of the checkpoint's own directory")
        need[name] = max(need.get(name, 0), int(info.offset) + int(info.length))
    missing = sorted(n for n in need if not (path / n).is_file())
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {len(missing)} of its {len(need)} data files "
                              f"are missing ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); a job "
                              "across machines must write to a directory every machine shares (each saved its own "
                              "part to its own --out)")
    for name, end in sorted(need.items()):
        size = (path / name).stat().st_size
        if size < end:
            raise CheckpointError(f"checkpoint {str(path)!r}: data file {name} is cut short ({size:,} bytes; its "
                                  f"metadata names bytes up to {end:,})")
