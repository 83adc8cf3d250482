"""Quality as trainers grow, at equal total examples: eight trainers (oversubscribed on CI's 2 cores; NE does not
depend on speed) against one trainer that sees every example."""

from __future__ import annotations

import pytest

from cocosync.shadowsync.config import SyncConfig, TrainConfig
from cocosync.shadowsync.job.launch import run_training

EXAMPLES = 400_000  # (at 160k the former fr-bmuf default was only 9% worse: too close to the spread)


def _eval_ne(tmp_path, algorithm: str, trainers: int, **sync) -> float:
    cfg = TrainConfig(examples=EXAMPLES, eval_examples=10_000, trainers=trainers, progress=False, plot=False,
                      checkpoint=False, out_dir=str(tmp_path / f"{algorithm}-{trainers}"),
                      sync=SyncConfig(algorithm=algorithm, **sync))
    return run_training(cfg).summary["eval_ne"]


@pytest.fixture(scope="module")
def one_trainer(tmp_path_factory) -> float:
    return _eval_ne(tmp_path_factory.mktemp("ref"), "none", 1)


def test_eight_trainers_learn_like_one(tmp_path, one_trainer):
    """fr-bmuf at its first default (block momentum 1 - 1/T = 0.875 on one-iteration blocks) diverged: NE +22% over
    one trainer at these settings (0.86 vs 0.70); with one-iteration blocks and no momentum the worst of 5 seeds was
    +5.6% (the 5-seed means at today's defaults, blocks of 8, are BENCHMARKS.md's, `cocosync bench quality`): a bound
    between the two catches a divergence."""
    ne = _eval_ne(tmp_path, "fr-bmuf", 8)
    assert ne < one_trainer * 1.10, (ne, one_trainer)
