"""Launching a ShadowSync run: T trainer processes around shared state, Ctrl-C and failure handling, the
progress bar, and the end of a run (evaluation, summary, plot, checkpoint). The trainers themselves are in
trainer.py."""

from __future__ import annotations

import ctypes
import json
import math
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import DataConfig
from .embeddings import SharedEmbeddings
from .sync import FlatParams
from .train_config import ConfigError, TrainConfig, config_to_dict
from .trainer import (
    InMemorySource,
    SharedState,
    Trainer,
    TrainerFailure,
    _build_model,
    _new_embeddings,
    build_configs,
    eval_batches,
    json_safe,
    make_source,
)

__all__ = ["RunResult", "run_training", "load_checkpoint_model"]


def _die_with_parent() -> None:
    try:  # Linux: SIGKILL this trainer if the launcher dies, so no orphan survives a killed run
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _trainer_main(rank: int, cfg: TrainConfig, state: SharedState, source: Any, store_port: int | None,
                  conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C and tells us through state.stop
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent()
    torch.set_num_threads(cfg.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo between trainers stays on loopback
    group_ready = False
    try:
        group = None
        if store_port is not None:
            import datetime

            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=min(cfg.timeout, 120))
            store = dist.TCPStore("127.0.0.1", store_port, cfg.trainers, False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.trainers, timeout=timeout)
            group_ready = True
        trainer = Trainer(cfg, rank, state, source, group=group, emit=conn.send)
        conn.send({"kind": "ready", "trainer": rank})
        while not state.go[0] and not state.stop[0]:  # start together: EPS is measured over a common window
            time.sleep(0.001)
        result = trainer.train()
        conn.send({"kind": "result", **result})
    except BaseException:
        try:
            conn.send({"kind": "error", "trainer": rank, "traceback": traceback.format_exc()})
        except OSError:
            pass
        conn.close()
        os._exit(1)  # do not wait on gloo/threads of a broken run
    finally:
        if group_ready:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:
                pass
    conn.close()


# ---------------------------------------------------------------------------------------------- launcher
@dataclass
class RunResult:
    """What a run measured: the summary row, the metric records (for plots), and where its files are."""

    name: str
    summary: dict
    records: list[dict] = field(default_factory=list)
    out_dir: str = ""
    checkpoint: str | None = None
    plot: str | None = None
    interrupted: bool = False


class _Interrupts:
    """Counts SIGINTs: the first asks the trainers to stop, the second aborts."""

    def __init__(self) -> None:
        self.count = 0
        self.previous: Any = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count >= 3:
            raise KeyboardInterrupt


def _describe_exit(rank: int, proc: mp.process.BaseProcess) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code} without reporting a result"
    return f"trainer {rank} (pid {proc.pid}) {how}"


def _stop_processes(procs: list, grace: float) -> None:
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def run_training(cfg: TrainConfig, *, name: str | None = None, console: Any = None,
                 extra_summary: dict | None = None, resume: str | os.PathLike | None = None) -> RunResult:
    """Train T trainers x W workers as configured; returns the measurements (see module doc).

    `resume`: a checkpoint of a run with the same data, budget, T and W (e.g. one stopped by Ctrl-C):
    training restarts from its dense and embedding weights at its reader positions."""
    from rich.console import Console

    from .metrics import MetricsLogger

    console = console or Console(stderr=True)
    name = name or f"{cfg.sync.algorithm} T={cfg.trainers}"
    data, model_cfg = build_configs(cfg)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    source = make_source(cfg, data)
    if isinstance(source, InMemorySource):
        source.share_memory_()
    ckpt = _resume_checkpoint(resume, cfg) if resume is not None else None
    embeddings = _new_embeddings(cfg, data, model_cfg)
    if ckpt is not None:
        embeddings.weight.copy_(ckpt["embeddings"]["weight"])
        embeddings.accumulator.copy_(ckpt["embeddings"]["accumulator"])
    model = _build_model(data, model_cfg, embeddings)
    if ckpt is not None:
        model.load_state_dict(ckpt["dense"], strict=False)
    parent_flat = FlatParams(model.dense_parameters())
    state = SharedState.create(cfg, embeddings, parent_flat.flat)
    resumed_from = 0
    if ckpt is not None:
        state.positions.copy_(ckpt["positions"])
        resumed_from = int(ckpt["positions"].sum())
        extra_summary = {**(extra_summary or {}), "resumed_from": resumed_from}
    T = cfg.trainers
    store = None
    if cfg.sync.method in ("ma", "bmuf") and T > 1:
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=120),
                              wait_for_workers=False)
    logger = MetricsLogger(out / "metrics.jsonl", append=ckpt is not None)
    logger.log(event="start", name=name, config=config_to_dict(cfg), resumed_from=resumed_from)
    ctx = mp.get_context("spawn")
    procs, conns = [], {}
    interrupts = _Interrupts()
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:  # children are spawned with SIGINT blocked and ignore it: the launcher owns Ctrl-C
        interrupts.previous = signal.signal(signal.SIGINT, interrupts)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for r in range(T):
            rd, wr = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_trainer_main, name=f"cocosync-trainer{r}", daemon=True,
                            args=(r, cfg, state, source, store.port if store else None, wr))
            p.start()
            wr.close()
            procs.append(p)
            conns[rd] = r
    finally:
        if main_thread:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    results: dict[int, dict] = {}
    failures: list[str] = []
    latest: dict[int, dict] = {}
    t_start = t_launch = time.time()
    ready = 0
    try:
        with _progress(cfg, console) as bar:
            task = bar.add_task(name, total=cfg.examples, ne="-", eps="-") if bar else None
            while len(results) < T and not failures:
                if interrupts.count and not state.stop[0]:
                    state.stop[0] = 1
                    console.print("[yellow]Ctrl-C: stopping the trainers (Ctrl-C again to abort)...")
                if interrupts.count >= 2:
                    failures.append("aborted by a second Ctrl-C")
                    break
                if time.time() - t_launch > cfg.timeout:
                    failures.append(f"run timed out after {cfg.timeout:.0f}s (TrainConfig.timeout)")
                    break
                for c in wait(list(conns), timeout=0.2):
                    r = conns[c]
                    try:
                        msg = c.recv()
                    except (EOFError, OSError):
                        del conns[c]
                        if r not in results:
                            procs[r].join(2)
                            failures.append(_describe_exit(r, procs[r]))
                        continue
                    if msg["kind"] == "train":
                        latest[r] = msg
                        total = resumed_from + sum(m["trainer_examples"] for m in latest.values())
                        nes = [m["train_ne"] for m in latest.values() if math.isfinite(m["train_ne"])]
                        rec = {"event": "train", "examples": total, "train_ne": float(np.mean(nes)) if nes else None,
                               "eps": total / max(time.time() - t_start, 1e-9), "trainer": r,
                               "trainer_examples": msg["trainer_examples"], "trainer_ne": msg["train_ne"],
                               "trainer_eps": msg["trainer_eps"], "syncs": msg["syncs"]}
                        logger.log(json_safe(rec))
                        if bar:
                            bar.update(task, completed=int(state.positions.sum()),
                                       ne=f"{rec['train_ne']:.4f}" if rec["train_ne"] else "-",
                                       eps=f"{rec['eps']:,.0f}")
                    elif msg["kind"] == "ready":
                        ready += 1
                        if ready == T:
                            state.go[0] = 1
                            t_start = time.time()
                    elif msg["kind"] == "result":
                        results[r] = msg
                    elif msg["kind"] == "error":
                        failures.append(f"trainer {r} raised:\n{msg['traceback']}")
                if bar:
                    bar.update(task, completed=int(state.positions.sum()))
    except KeyboardInterrupt:
        failures.append("aborted by Ctrl-C")
    finally:
        if failures:
            state.stop[0] = 1
        _stop_processes(procs, grace=3.0 if failures else 30.0)
        for c in conns:
            c.close()
        if main_thread:
            signal.signal(signal.SIGINT, interrupts.previous)
        if store is not None:
            del store
    if failures:
        logger.log(event="failed", error=failures[0])
        logger.close()
        raise TrainerFailure(f"training failed: {failures[0]}" +
                             (f"\n(and {len(failures) - 1} consequential error(s))" if len(failures) > 1 else ""))
    interrupted = bool(state.stop[0])
    return _finish(cfg, name, data, model, parent_flat, state, results, logger, out, interrupted,
                   [dict(r) for r in _records_of(out / "metrics.jsonl")], extra_summary or {})


def _resume_checkpoint(path: str | os.PathLike, cfg: TrainConfig) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"cannot resume: no checkpoint at {str(p)!r}")
    ckpt = torch.load(p, map_location="cpu", weights_only=False)
    old = ckpt["config"]
    for key in ("data", "examples", "trainers", "workers", "seed", "batch_size", "model", "data_options"):
        new = config_to_dict(cfg)[key]
        if old[key] != new:
            raise ConfigError(f"cannot resume {str(p)!r}: it was trained with {key}={old[key]!r}, this run has "
                              f"{key}={new!r} (the reader positions only mean something for the same data and shards)")
    if ckpt["embeddings"]["optimizer"] != cfg.embedding_optimizer:
        raise ConfigError(f"cannot resume {str(p)!r}: embedding_optimizer {ckpt['embeddings']['optimizer']!r} "
                          f"!= {cfg.embedding_optimizer!r}")
    return ckpt


def _records_of(path: Path) -> list[dict]:
    from .metrics import read_metrics

    return read_metrics(path)


class _NoBar:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _progress(cfg: TrainConfig, console: Any) -> Any:
    if not cfg.progress:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("EPS {task.fields[eps]}"), TextColumn("train NE {task.fields[ne]}"),
                    TimeElapsedColumn(), console=console)


def _finish(cfg: TrainConfig, name: str, data: DataConfig, model: Any, flat: FlatParams, state: SharedState,
            results: dict[int, dict], logger: Any, out: Path, interrupted: bool, records: list[dict],
            extra: dict) -> RunResult:
    from .metrics import evaluate, plot_ne

    T = cfg.trainers
    final = state.center if state.center is not None else torch.from_numpy(results[0]["dense"])
    flat.flat.copy_(final)
    ev = evaluate(model, eval_batches(cfg, data))
    examples = sum(r["examples"] for r in results.values())
    seconds = max(r["end"] for r in results.values()) - min(r["start"] for r in results.values())
    gaps = [r["sync_gap"] for r in results.values() if math.isfinite(r["sync_gap"])]
    summary = {
        "name": name, "sync": cfg.sync.algorithm, "T": T, "W": cfg.workers, "examples": examples,
        "eps": examples / max(seconds, 1e-9),
        "eps_per_trainer": float(np.mean([r["examples"] / max(r["seconds"], 1e-9) for r in results.values()])),
        "eps_per_cpu": examples / max(sum(r["cpu_seconds"] for r in results.values()), 1e-9),
        "train_ne": float(np.nanmean([r["train_ne"] for r in results.values()])),
        "eval_ne": ev["ne"], "auc": ev["auc"], "bayes_ne": ev["bayes_ne"],
        "excess_ne": ev["ne"] - ev["bayes_ne"] if math.isfinite(ev["bayes_ne"]) else float("nan"),
        "sync_gap": float(np.mean(gaps)) if gaps else float("nan"),
        "syncs": int(sum(r["syncs"] for r in results.values())),
        "seconds": seconds, "interrupted": interrupted, **extra,
    }
    seen = examples + int(extra.get("resumed_from", 0))  # the x axis of the plots counts earlier sessions too
    logger.log(event="eval", examples=seen, eval_ne=ev["ne"], auc=ev["auc"], bayes_ne=ev["bayes_ne"])
    logger.log(event="summary", **summary)
    logger.close()
    (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2, default=str) + "\n")
    result = RunResult(name=name, summary=summary, records=records + [{"examples": seen, "eval_ne": ev["ne"]}],
                       out_dir=str(out), interrupted=interrupted)
    if cfg.checkpoint:
        ckpt = {
            "config": config_to_dict(cfg), "name": name,
            "dense": {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")},
            "embeddings": state.embeddings.state_dict(),
            "positions": state.positions.clone(), "shards": T * cfg.workers, "summary": summary,
        }
        tmp = out / "checkpoint.pt.tmp"
        torch.save(ckpt, tmp)
        os.replace(tmp, out / "checkpoint.pt")
        result.checkpoint = str(out / "checkpoint.pt")
    if cfg.plot:
        run = {"name": name, "records": result.records, "bayes_ne": ev["bayes_ne"] if math.isfinite(ev["bayes_ne"]) else None}
        result.plot = plot_ne([run], out / "ne.png", title=f"{name}: NE vs examples")
    return result


def load_checkpoint_model(path: str | os.PathLike) -> tuple[Any, TrainConfig, DataConfig, dict]:
    """(model with the checkpoint's dense + embedding weights, its TrainConfig, DataConfig, raw checkpoint)."""
    from .train_config import config_from_dict

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(p)!r} (a run writes <out_dir>/checkpoint.pt)")
    ckpt = torch.load(p, map_location="cpu", weights_only=False)
    cfg = config_from_dict(ckpt["config"])
    data, model_cfg = build_configs(cfg)
    emb = SharedEmbeddings.from_state_dict(ckpt["embeddings"])
    model = _build_model(data, model_cfg, emb)
    missing, unexpected = model.load_state_dict(ckpt["dense"], strict=False)
    if unexpected or [k for k in missing if not k.startswith("embeddings.")]:
        raise ValueError(f"checkpoint {str(p)!r} does not match the model: missing {missing}, unexpected {unexpected}")
    return model, cfg, data, ckpt
