"""ShadowSync data: the Criteo-format reader, the synthetic teacher, and `open_stream`, which picks one of
them from a `DataConfig` (a file when a path is set, else the embedded synthetic teacher). `sources` turns a run's
config into each trainer's reader shards and the held-out set; `plan` moves the unread rows onto another shard count
when a run resumes on other trainer or worker counts."""

from __future__ import annotations

from cocosync.shadowsync.config import DataConfig
from cocosync.shadowsync.data.criteo import (
    Batch,
    CriteoFormatError,
    CriteoReader,
    hash_tokens,
    log_transform,
    prob_sidecar_path,
)
from cocosync.shadowsync.data.synth import (
    EVAL,
    TRAIN,
    SynthConfig,
    SyntheticDataset,
    SyntheticStream,
    Teacher,
    expected_ne,
    make_synthetic_dataset,
    write_synthetic,
)

__all__ = [
    "Batch", "CriteoReader", "CriteoFormatError", "hash_tokens", "log_transform", "prob_sidecar_path",
    "SynthConfig", "SyntheticDataset", "SyntheticStream", "Teacher", "expected_ne", "make_synthetic_dataset",
    "write_synthetic", "open_stream", "TRAIN", "EVAL",
]


def open_stream(
    config: DataConfig,
    split: str = "train",
    *,
    shard: tuple[int, int] = (0, 1),
    batch_size: int | None = None,
    skip_rows: int = 0,
    max_rows: int | None = None,
) -> CriteoReader | SyntheticStream:
    """Batches of `split` ("train" or "eval") for shard (index, count).

    train: `config.train_path` if set (capped at train_rows / count per shard), else the synthetic stream
    (seed `config.seed`, `train_rows` rows in all, endless if None). eval: `config.eval_path` (first
    `eval_rows` rows) or `eval_rows` synthetic held-out rows from the same teacher.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"open_stream: split={split!r}: expected 'train' or 'eval'")
    path = config.train_path if split == "train" else config.eval_path
    rows = config.train_rows if split == "train" else config.eval_rows
    kw = dict(shard=shard, batch_size=batch_size, skip_rows=skip_rows)
    if path is not None:
        cap = None if rows is None else -(-rows // shard[1])
        if max_rows is not None:
            cap = max_rows if cap is None else min(cap, max_rows)
        return CriteoReader(path, config, max_rows=cap, **kw)
    return SyntheticStream(config, split=TRAIN if split == "train" else EVAL, rows=rows, max_rows=max_rows, **kw)
