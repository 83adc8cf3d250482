"""Checkpoints of a ShadowSync job, one format for every run: torch.distributed.checkpoint (DCP) directories.

Every rank saves its own part in one collective `dcp.save`: an embedding server its shard (weights, row-wise Adagrad
accumulator, row versions), a sync server its range of EASGD's centre, a trainer its dense replica, dense Adagrad
accumulator, BMUF state and reader positions. Trainer 0 adds `meta.json` (config, topology, examples seen). A
checkpoint is a directory `checkpoints/seen-<examples>` under the run's output; `checkpoints/latest` names the last
complete one (replaced atomically after every rank has written), so a crash while saving leaves the previous one.
`checkpoints/best` holds the best-eval model of an eval curve (weights only: the tables as one shard, trainer 0's
replica; scorable, not a resume point).

Loading runs no code: DCP pickles its metadata, which is read here by an unpickler that knows only DCP's own
metadata classes, and tensors load with `weights_only`. Every saving rank writes the CRC-32 of each tensor it saved
(crc-<part>.json); a loaded tensor whose bytes differ, or whose values are not finite, is refused naming it.

Loading is collective too. On the same topology every rank reads back its own keys (exact resume). With another
number of embedding or sync servers each new server reads every
old shard and keeps the rows the new row hash gives it. With another number of trainers (or workers) the unread rows
of every old reader shard are planned onto the new shards (data/plan.py: every example still read once), and every
new trainer starts from the average of the old dense replicas and Adagrad accumulators (BMUF's global state, the same
on every trainer, is taken from trainer 0).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch
import torch.distributed as dist

from cocosync.shadowsync.config import TrainConfig, config_to_dict, resume_value
from cocosync.shadowsync.errors import CheckpointError, ConfigError
from cocosync.shadowsync.model.shard import RowHash
from cocosync.shadowsync.sync.center import center_bounds

__all__ = ["CheckpointError", "CheckpointWriteError", "Stateful", "Snapshot", "part_name", "save_job", "load_job",
           "load_parts", "resolve", "resumed_run_dir", "read_meta", "check_resumable", "resharded_trainers",
           "read_positions", "save_best", "load_weights", "read_tensors", "BEST"]

RESUME_KEYS = ("data", "examples", "seed", "batch_size", "model_factory", "model", "data_options",
               "embedding_optimizer")
#: settings added since checkpoints were first written: an older checkpoint had the value here
_RESUME_DEFAULTS = {"model_factory": "dlrm"}
BEST = "best"  # checkpoints/best: the best-eval model


_ONE_PROCESS = "torch.distributed is disabled"  # DCP's warning when one process reads or writes a checkpoint alone


def _crc(t: torch.Tensor) -> str:
    """CRC-32 of a tensor's bytes (damage detection, not security: loading runs no code either way)."""
    return f"{zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()):08x}"


def _write_checksums(path: Path, name: str, state: dict[str, torch.Tensor]) -> None:
    """<checkpoint>/crc-<name>.json: the CRC-32 of every tensor this process saved (one file per saving rank)."""
    (path / f"crc-{name}.json").write_text(json.dumps({k: _crc(v) for k, v in state.items()}, indent=0) + "\n")


def _verify(state: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a loaded tensor whose bytes differ from what was saved, or whose values are not finite, naming it.
    (Checkpoints written before checksums existed have no crc-*.json: only finiteness is checked.)"""
    sums: dict[str, str] = {}
    for f in sorted(path.glob("crc-*.json")):
        try:
            sums.update(json.loads(f.read_text()))
        except ValueError:
            raise CheckpointError(f"checkpoint {str(path)!r}: damaged checksum file {f.name}") from None
    for key, t in state.items():
        if key in sums and _crc(t) != sums[key]:
            raise CheckpointError(f"checkpoint {str(path)!r}: tensor {key!r} is damaged (its bytes changed since "
                                  "it was saved: CRC-32 mismatch); use an earlier checkpoint (checkpoints/seen-N)")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"checkpoint {str(path)!r}: tensor {key!r} holds {bad} non-finite value(s) (NaN or "
                                  "inf): the run that saved it diverged, or the file was altered")


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported when a checkpoint is first saved or read: ~1.5 s of a process's CPU
    that a launcher and a rank that never touch one need not pay (BENCHMARKS.md, "A job's fixed cost")."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _load(state: dict[str, torch.Tensor], path: Path, *, no_dist: bool = False) -> None:
    from cocosync.shadowsync.safe_reader import SafeReader

    reader = SafeReader(str(path))
    reader.read_metadata()  # a crafted or damaged .metadata is named here (DCP would wrap the error in its own)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_ONE_PROCESS)
            _dcp().load(state, storage_reader=reader, no_dist=no_dist)
    except Exception as e:  # noqa: BLE001 - a missing key, a damaged data file
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {type(e).__name__}: {str(e)[:300]}") from None
    _verify(state, path)


# ---------------------------------------------------------------------------------------------- the parts
class Stateful(Protocol):
    """A part of the job that owns its state (torch.distributed.checkpoint's Stateful): `state_dict()` gives its
    tensors by key, `load_state_dict(state)` takes them back. A checkpoint holds each part's keys under its name."""

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


@dataclass
class Snapshot:
    """A part's state taken earlier (a trainer's between two sync rounds), saved as it is."""

    state: dict[str, torch.Tensor]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise TypeError("a Snapshot is saved, not loaded into")


def part_name(kind: str, index: int) -> str:
    """The name a role's part has in a checkpoint: emb.<i> (embedding server i's shard), center (every sync
    server's range, keyed by its index), trainer.<t>."""
    return {"embedding": f"emb.{index}", "sync": "center", "trainer": f"trainer.{index}"}[kind]


def _flatten(states: Mapping[str, Stateful]) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": t for name, part in states.items() for key, t in part.state_dict().items()}


def _unflatten(flat: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {k[len(name) + 1:]: v for k, v in flat.items() if k.startswith(f"{name}.")}


def _point_latest(root: Path, path: Path, meta: dict) -> None:
    (path / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    tmp = root / "checkpoints" / "latest.tmp"
    tmp.write_text(path.name + "\n")
    os.replace(tmp, root / "checkpoints" / "latest")


def save_job(states: Mapping[str, Stateful], root: Path, meta: dict | None, *, owner: str, writer: int,
             group: Any = None) -> Path:
    """Collective over `group` (default: the job's): every rank writes its parts (`states`, by name) into
    root/checkpoints/seen-<N>, and the checksums of its tensors into crc-<owner>.json; the writer (the global rank
    holding `meta`: trainer 0) then points root/checkpoints/latest at it."""
    seen = [int(meta["examples_seen"]) if meta else -1]
    dist.broadcast_object_list(seen, src=writer, group=group)
    path = root / "checkpoints" / f"seen-{seen[0]}"
    state = _flatten(states)
    error = None
    try:
        _dcp().save(state, checkpoint_id=str(path), process_group=group)
        _write_checksums(path, owner, state)
    except BaseException as e:  # (DCP's CheckpointException is a BaseException wrapping each rank's error)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        error = _write_error(path, e, sum(t.numel() * t.element_size() for t in state.values()))
    errors: list[Any] = [None] * dist.get_world_size(group)
    # every rank's files are written (or not) before `latest` points here
    dist.all_gather_object(errors, error, group=group)
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:  # no rank points `latest` here, and the partial directory goes: `latest` stays whole
        if meta is not None:
            shutil.rmtree(path, ignore_errors=True)
        raise CheckpointWriteError(failed)
    if meta is not None:
        _point_latest(root, path, meta)
    return path


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only or unwritable directory): the message names the
    directory and the cause; the partial checkpoint is removed and `latest` still names the last whole one."""


def _write_error(path: Path, e: BaseException, nbytes: int) -> str:
    """One line for a failed checkpoint write: the path, the OS's cause where one is in the chain, and the space."""
    found = [e, *getattr(e, "failures", {}).values()]  # (DCP's CheckpointException: each rank's own error)
    os_error = None
    while found and os_error is None:
        x = found.pop(0)
        if isinstance(x, OSError):
            os_error = x
        elif isinstance(x, BaseException):
            found += [c for c in (x.__cause__, x.__context__) if c is not None]
    try:
        usage = shutil.disk_usage(path.parent if path.parent.exists() else path.parent.parent)
    except OSError:
        usage = None
    if os_error is not None:
        reason = os_error.strerror or str(os_error)
    elif usage is not None and usage.free < max(nbytes, 1 << 20):  # (torch's writer says 'unexpected pos' then)
        reason = "No space left on device"
    else:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    text = f"cannot write checkpoint {str(path)!r}: {reason}"
    if usage is not None:
        text += (f" ({usage.free / 2**20:,.1f} MiB free of {usage.total / 2**20:,.1f} MiB there; this rank's part "
                 f"is {nbytes / 2**20:,.1f} MiB)")
    return text + "; the last whole checkpoint is kept (checkpoints/latest)"


def save_best(root: Path, meta: dict, table: torch.Tensor, flat: torch.Tensor) -> Path:
    """checkpoints/best from one process: the whole tables (as one shard) and a dense replica; replaced atomically."""
    best = root / "checkpoints" / BEST
    tmp = root / "checkpoints" / f"{BEST}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        state = {"emb.0.weight": table, "trainer.0.flat": flat}
        _dcp().save(state, checkpoint_id=str(tmp), no_dist=True)
    _write_checksums(tmp, BEST, state)
    (tmp / "meta.json").write_text(json.dumps({**meta, "best": True, "embedding_servers": 1, "sync_servers": 0,
                                               "trainers": 1}, indent=2, default=str) + "\n")
    old = root / "checkpoints" / f"{BEST}.old"
    shutil.rmtree(old, ignore_errors=True)
    if best.exists():
        os.replace(best, old)
    os.replace(tmp, best)
    shutil.rmtree(old, ignore_errors=True)
    return best


# ---------------------------------------------------------------------------------------------- finding one
def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from what a user names: the checkpoint itself, or a run directory (its latest)."""
    p = Path(path)
    if p.is_file():
        raise CheckpointError(
            f"{str(p)!r} is a file: checkpoints are directories (<out>/checkpoints/seen-N, written by torch."
            "distributed.checkpoint); name one, or the run directory for its latest. A checkpoint.pt file is the "
            "one-file format of cocosync before the single-machine and multi-machine jobs became one: this version "
            "does not read it (score or resume it with the cocosync that wrote it, or train again)")
    if (p / "meta.json").is_file():
        return p
    latest = p / "checkpoints" / "latest"
    if latest.is_file():
        cand = p / "checkpoints" / latest.read_text().strip()
        if (cand / "meta.json").is_file():
            return cand
    raise CheckpointError(f"{str(p)!r}: no checkpoint there (expected a checkpoint directory with meta.json, e.g. "
                          "<out>/checkpoints/seen-N or <out>/checkpoints/best, or a run directory with "
                          "checkpoints/latest)")


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: unreadable meta.json: {e}") from None
    if not isinstance(meta, dict) or not {"config", "trainers", "embedding_servers"} <= meta.keys():
        raise CheckpointError(f"checkpoint {str(path)!r}: meta.json is not a cocosync checkpoint's")
    return meta


def resumed_run_dir(path: Path, named: str | os.PathLike) -> Path:
    """Where a resumed run writes when no --out is given: the run directory holding the checkpoint `path` (what the
    user named, `named`), never the directory the checkpoint's run once wrote to (a copy of a run resumes into the
    copy). ConfigError for a checkpoint outside a run directory."""
    if path.parent.name == "checkpoints":
        return path.parent.parent
    raise ConfigError(f"resuming {str(named)!r}: it is not inside a run directory (<run>/checkpoints/...), so there is "
                      "no run to continue in; name where this run writes with --out")


def check_resumable(meta: dict, cfg: TrainConfig, path: Path) -> None:
    """ConfigError naming the first setting that differs from the checkpoint's (reader positions and tables only
    mean something for the same data, budget and model), or that the checkpoint is not a resume point."""
    if meta.get("best"):
        raise ConfigError(f"cannot resume {str(path)!r}: it is the best-eval model (weights only, no optimizer, sync "
                          "or reader state); resume from the run directory (its checkpoints/latest), score this one "
                          "with `cocosync eval`")
    if meta.get("lost_trainers"):
        raise ConfigError(f"cannot resume {str(path)!r}: it was written after trainer(s) "
                          f"{', '.join(map(str, meta['lost_trainers']))} were lost, before the trainers left had read "
                          "their rows; resume from a checkpoint written before the loss, or score this one with "
                          "`cocosync eval`")
    old, new = meta["config"], config_to_dict(cfg)
    old = {**_RESUME_DEFAULTS, **old}
    for key in RESUME_KEYS:
        if key not in old:
            raise CheckpointError(f"cannot resume {str(path)!r}: its meta.json has no {key!r} in its config")
        if resume_value(old, key) != resume_value(new, key):
            raise ConfigError(f"cannot resume {str(path)!r}: it was trained with {key}={old[key]!r}, this job has "
                              f"{key}={new[key]!r}")


def resharded_trainers(meta: dict, trainers: int, workers: int) -> bool:
    """Whether the job's reader shards differ from the checkpoint's (another trainer or worker count)."""
    return (meta["trainers"], meta["workers"]) != (trainers, workers)


def read_positions(path: Path, meta: dict) -> list[int]:
    """Every old reader shard's position, in shard order (trainer t's worker w is shard t * W + w). Collective."""
    T, W = meta["trainers"], meta["workers"]
    state = {f"trainer.{t}.positions": torch.zeros(W, dtype=torch.int64) for t in range(T)}
    _load(state, path)
    return [int(p) for t in range(T) for p in state[f"trainer.{t}.positions"]]


# ---------------------------------------------------------------------------------------------- loading
def load_job(kind: str, index: int, part: Stateful, path: Path, meta: dict, *, rowhash: RowHash, centre_numel: int,
             sync_servers: int, trainers: int, workers: int) -> None:
    """Collective: fill this rank's part (role `kind`: 'embedding' | 'sync' | 'trainer', and its `index` in that
    role) from the checkpoint, resharding servers or trainers when their count changed."""
    if kind == "trainer" and resharded_trainers(meta, trainers, workers):
        _load_averaged_trainer(part, path, meta)
    elif kind == "embedding" and meta["embedding_servers"] != rowhash.servers:
        _load_resharded_shard(part, index, path, meta, rowhash)
    elif kind == "sync" and meta["sync_servers"] != sync_servers:
        _load_resharded_centre(part, path, meta, centre_numel, sync_servers)
    else:
        load_parts({part_name(kind, index): part}, path)


def load_parts(states: Mapping[str, Stateful], path: Path, *, no_dist: bool = False) -> None:
    """Fill each part from the checkpoint at the same topology: its keys under its name, loaded in place where its
    state_dict gives live tensors, then handed to its load_state_dict."""
    flat = _flatten(states)
    _load(flat, path, no_dist=no_dist)
    for name, part in states.items():
        part.load_state_dict(_unflatten(flat, name))


def _old_shards(path: Path, meta: dict, dim: int, *, accumulators: bool, no_dist: bool = False) -> dict:
    old_hash = RowHash(sum(meta["table_rows"]), meta["embedding_servers"])
    old = {}
    for s in range(old_hash.servers):
        n = old_hash.shard_rows(s)
        old[f"emb.{s}.weight"] = torch.empty(n, dim)
        if accumulators:
            old |= {f"emb.{s}.accumulator": torch.empty(n), f"emb.{s}.versions": torch.empty(n, dtype=torch.int64)}
    _load(old, path, no_dist=no_dist)
    return old


def _load_resharded_shard(shard: Stateful, s_new: int, path: Path, meta: dict, rowhash: RowHash) -> None:
    """Server `s_new` of a job with another server count: the rows the new row hash gives it, from every old shard."""
    state = shard.state_dict()
    S_old = meta["embedding_servers"]
    old = _old_shards(path, meta, state["weight"].shape[1], accumulators=True)
    old_hash = RowHash(rowhash.total_rows, S_old)
    for s in range(S_old):
        g = s + S_old * torch.arange(old_hash.shard_rows(s))  # the global rows of old shard s
        mine = g % rowhash.servers == s_new
        local = g[mine] // rowhash.servers
        for key in ("weight", "accumulator", "versions"):
            state[key][local] = old[f"emb.{s}.{key}"][mine]
    shard.load_state_dict(state)


def _load_resharded_centre(centre: Stateful, path: Path, meta: dict, numel: int, servers: int) -> None:
    """A sync server of a job with another sync-server count: its new range of the old ranges put together."""
    C_old = meta["sync_servers"]
    old = {f"center.{i}": torch.empty(hi - lo) for i, (lo, hi) in enumerate(center_bounds(numel, C_old))}
    _load(old, path)
    whole = torch.cat([old[f"center.{i}"] for i in range(C_old)])
    (key,) = centre.state_dict()  # the range's index
    lo, hi = center_bounds(numel, servers)[int(key)]
    centre.load_state_dict({key: whole[lo:hi]})


def _load_averaged_trainer(trainer: Stateful, path: Path, meta: dict) -> None:
    """A trainer of a job with another trainer count: the mean of the old replicas and accumulators, BMUF's state
    from old trainer 0; its reader positions stay as they are (0: the data plan starts its shards afresh)."""
    state, T = trainer.state_dict(), meta["trainers"]
    old = {f"trainer.{t}.{k}": torch.empty_like(state[k]) for t in range(T) for k in ("flat", "accumulator")}
    old |= {f"trainer.0.{k}": torch.empty_like(v) for k, v in state.items() if k.startswith("bmuf.")}
    _load(old, path)
    for k in ("flat", "accumulator"):
        state[k] = torch.stack([old[f"trainer.{t}.{k}"] for t in range(T)]).mean(0)
    state |= {k: old[f"trainer.0.{k}"] for k in state if k.startswith("bmuf.")}
    trainer.load_state_dict(state)


def load_weights(path: Path, meta: dict, *, dim: int, dense_params: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole tables [rows, dim] in global row order, the dense parameters to score) from one process: EASGD's
    centre where the checkpoint has one, else trainer 0's replica."""
    old = _old_shards(path, meta, dim, accumulators=False, no_dist=True)
    S = meta["embedding_servers"]
    table = torch.empty(sum(meta["table_rows"]), dim)
    for s in range(S):
        table[s::S] = old[f"emb.{s}.weight"]
    C = meta["sync_servers"]
    if C:
        centre = {f"center.{i}": torch.empty(hi - lo) for i, (lo, hi) in enumerate(center_bounds(dense_params, C))}
        _load(centre, path, no_dist=True)
        flat = torch.cat([centre[f"center.{i}"] for i in range(C)])
    else:
        state = {"trainer.0.flat": torch.empty(dense_params)}
        _load(state, path, no_dist=True)
        flat = state["trainer.0.flat"]
    return table, flat


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory by key, from one process (inspection, tests, comparisons)."""
    from cocosync.shadowsync.safe_reader import SafeReader

    p = resolve(path)
    metadata = SafeReader(str(p)).read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if hasattr(m, "size")}
    _load(state, p, no_dist=True)
    return state
