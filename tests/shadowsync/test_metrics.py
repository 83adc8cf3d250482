"""NE, AUC, Bayes NE, sliding window, throughput, sync gap, JSON-lines logs, summary table, NE plot."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cocosync.shadowsync.metrics import (
    MetricsLogger,
    auc,
    bayes_ne,
    curve,
    evaluate,
    normalized_entropy,
    plot_ne,
    read_metrics,
    summary_table,
)


def test_base_rate_predictor_has_ne_one():
    y = np.array([1, 0, 0, 0, 1, 0, 0, 0, 0, 0], dtype=float)
    assert normalized_entropy(y, np.full(10, 0.2)) == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor(y), torch.full((10,), 0.2)) == pytest.approx(1.0)
    assert normalized_entropy(y, np.full(10, 0.5)) > 1.0


def test_ne_matches_hand_computation():
    y, p = [1, 0, 0, 1], [0.9, 0.2, 0.4, 0.6]
    loss = -(math.log(0.9) + math.log(0.8) + math.log(0.6) + math.log(0.6)) / 4
    h = -(0.5 * math.log(0.5) * 2)
    assert normalized_entropy(y, p) == pytest.approx(loss / h)
    h_given = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert normalized_entropy(y, p, base_rate=0.25) == pytest.approx(loss / h_given)
    assert bayes_ne(y, p) == pytest.approx(loss / h)
    with pytest.raises(ValueError, match="base rate 0.0"):
        normalized_entropy([0, 0], [0.1, 0.1])


def test_auc():
    assert auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == pytest.approx(0.75)
    assert auc([0, 1], [0.2, 0.9]) == 1.0
    assert math.isnan(auc([1, 1], [0.2, 0.9]))
    assert auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5  # all tied: no ordering


@pytest.mark.parametrize("n,decimals", [(3, None), (50, 1), (1000, None), (20_000, 2)])
def test_auc_equals_sklearns_with_and_without_ties(n, decimals):
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(n)
    for _ in range(5):
        y = rng.integers(0, 2, n)
        p = rng.random(n).astype(np.float32)
        if decimals is not None:  # runs of equal scores across both classes
            p = np.round(p, decimals)
        if y.min() == y.max():
            continue
        assert auc(torch.from_numpy(y), torch.from_numpy(p)) == pytest.approx(roc_auc_score(y, p), abs=1e-12)


def test_logger_table_and_plot(tmp_path):
    path = tmp_path / "m" / "run.jsonl"
    with MetricsLogger(path) as log:
        for i in range(1, 4):
            log.log({"examples": i * 1000, "train_ne": 1 - 0.1 * i}, eval_ne=torch.tensor(0.95 - 0.1 * i))
    recs = read_metrics(path)
    assert [r["examples"] for r in recs] == [1000, 2000, 3000] and recs[2]["eval_ne"] == pytest.approx(0.65)
    table = summary_table([{"name": "easgd", "eval_ne": 0.71234, "examples": 3000}, {"name": "ma", "auc": 0.8}])
    assert [c.header for c in table.columns] == ["name", "eval_ne", "examples", "auc"]
    assert table.row_count == 2
    runs = [{"name": "run", "records": recs, "bayes_ne": 0.6}, {"name": "other", "records": recs[:2]}]
    png = plot_ne(runs, tmp_path / "ne.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_evaluate_restores_mode():
    class Const(torch.nn.Module):
        def forward(self, dense, sparse):
            return torch.logit(torch.full((dense.shape[0],), 0.25))

    class B:
        dense, sparse = torch.zeros(4, 13), torch.zeros(4, 26, dtype=torch.long)
        label, prob = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.full((4,), 0.25)

    m = Const().train()
    out = evaluate(m, [B(), B()])
    assert m.training and out["examples"] == 8
    assert out["ne"] == pytest.approx(1.0) and out["bayes_ne"] == pytest.approx(1.0)
    assert out["ctr"] == 0.25 and math.isnan(out["auc"]) is False


def test_calibration_is_predicted_over_actual_ctr():
    from cocosync.shadowsync.metrics import calibration

    y = np.array([1, 0, 0, 0], dtype=float)
    assert calibration(y, np.full(4, 0.25)) == 1.0
    assert calibration(y, np.full(4, 0.5)) == 2.0
    assert np.isnan(calibration(np.zeros(4), np.full(4, 0.1)))


def test_the_curve_of_a_resumed_run_runs_forwards():
    """Records of two sessions (the second resumed at 100): the summaries count their session's examples and are
    not points of the curve (they made ne.png jump back to x=0)."""
    recs = [{"event": "start"}, {"event": "train", "examples": 50, "train_ne": 0.8},
            {"event": "eval", "examples": 100, "eval_ne": 0.75}, {"event": "summary", "examples": 100, "eval_ne": 0.75},
            {"event": "start"}, {"event": "train", "examples": 150, "train_ne": float("nan")},
            {"event": "eval", "examples": 200, "eval_ne": 0.7}, {"event": "summary", "examples": 100, "eval_ne": 0.7}]
    assert curve(recs, "eval_ne") == [(100, 0.75), (200, 0.7)]
    assert curve(recs, "train_ne") == [(50, 0.8)]
