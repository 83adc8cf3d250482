"""`cocosync export RUN OUT` (the trained model as a plain PyTorch state_dict with the run's config) and
`cocosync predict RUN --data FILE --out scores.parquet` (scores of new rows, in batches)."""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.markup import escape

from cocosync.shadowsync.cli.options import console as make_console
from cocosync.shadowsync.config import ConfigError
from cocosync.shadowsync.errors import debug_mode
from cocosync.shadowsync.export import EXPORT_FILE, export_model, load_model, predictor_of_checkpoint

__all__ = ["export", "predict"]


def _usage(e: Exception) -> click.UsageError:
    if debug_mode():
        raise e
    return click.UsageError(str(e))


@click.command("export")
@click.argument("run", type=click.Path())
@click.argument("out", type=click.Path(file_okay=False))
def export(run: str, out: str) -> None:
    """Write RUN's model (a run directory's latest checkpoint, or a checkpoint) to OUT/model.pt: the model as its
    factory builds it with its full tables, as a state_dict, and the run's config (the data's schema). Load it with
    cocosync.shadowsync.load_model(OUT), or score files with `cocosync predict OUT`."""
    try:
        path = export_model(run, out)
    except ConfigError as e:
        raise _usage(e) from None
    make_console().print(f"exported: {escape(str(path))}  (score rows with: cocosync predict {escape(out)} --data "
                         "FILE)", soft_wrap=True)


@click.command("predict")
@click.argument("model", type=click.Path())
@click.option("--data", "data_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="rows to score: a file in the format the model was trained on (Parquet/CSV: the label optional).")
@click.option("--out", "out_path", default="scores.parquet", show_default=True, type=click.Path(dir_okay=False),
              help="Parquet file of the scores: one row per input row, in order (score, and label where known).")
@click.option("--batch-size", type=click.IntRange(min=1), default=4096, show_default=True)
def predict(model: str, data_path: str, out_path: str, batch_size: int) -> None:
    """Score the rows of a file with MODEL: an exported model (a directory with model.pt), a run directory or a
    checkpoint. Writes the click probabilities to --out."""
    try:
        p = Path(model)
        predictor = load_model(p) if (p / EXPORT_FILE).is_file() or p.suffix == ".pt" else predictor_of_checkpoint(p)
        scores, labels = [], []
        for s, y in predictor.predict_file(data_path, batch_size):
            scores.append(s)
            labels.append(y)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        raise _usage(e) from None
    score = np.concatenate(scores) if scores else np.zeros(0, dtype=np.float32)
    columns = {"score": score}
    if labels and labels[0] is not None:
        columns["label"] = np.concatenate(labels)
    pq.write_table(pa.table(columns), out_path)
    make_console().print(f"scored {len(score):,} rows of {escape(data_path)} -> {escape(out_path)} (mean score "
                         f"{float(score.mean()) if len(score) else float('nan'):.4f})", soft_wrap=True)
