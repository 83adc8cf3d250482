"""The lookup exchange's scaling model (bench/exchange_model.py): its costs recovered from rows generated with known
ones, its predictions of other node counts, and its projection's formula."""

from __future__ import annotations

import pytest

from cocosync.bench.exchange_model import fit_costs, model_report, predict_cpu, project_efficiency

C1, K_ROW, ROWS, REMOTE = 8.0, 0.05, 25.0, 0.4  # us/example, us per remote row, rows/example, remote share at M -> inf
ROUND, HOT = (900.0, 150.0), (1500.0, 400.0)  # us per round / per hot sync: a + b (N - 1)
GLOO, GLOO_ONE = (300.0, 50.0), 0.2  # gloo's threads: us per collective; us per example at one node (barriers...)
RHO, ETA = 1 / 1200, 1 / 2400  # rounds and hot syncs per example


def _row(n: int) -> dict:
    share = REMOTE * (n - 1) / n
    k_round, k_hot = ROUND[0] + ROUND[1] * (n - 1), HOT[0] + HOT[1] * (n - 1)
    multi = n > 1
    gloo = multi * (GLOO[0] + GLOO[1] * (n - 1)) * (RHO + ETA)
    cpu = C1 + K_ROW * ROWS * share + multi * (k_round * RHO + k_hot * ETA) + gloo
    return {"nodes": n, "cpu_us_per_example": cpu, "rows_per_example": ROWS, "remote_row_fraction": share,
            "exchange_cpu_us_per_round": k_round if multi else float("nan"), "rounds_per_example": RHO * multi,
            "hot_sync_cpu_us_per_sync": k_hot if multi else float("nan"), "hot_syncs_per_example": ETA * multi,
            "gloo_cpu_us_per_example": GLOO_ONE + gloo}


def test_costs_are_recovered_and_other_node_counts_predicted():
    costs = fit_costs([_row(1), _row(2), _row(4)], interval_s=0.04, hot_interval_s=0.04)
    assert costs.c_one == pytest.approx(C1) and costs.k_row == pytest.approx(K_ROW)
    assert costs.round_us == pytest.approx(ROUND) and costs.hot_us == pytest.approx(HOT)
    assert costs.gloo_us == pytest.approx(GLOO)
    assert costs.remote_rows_all == pytest.approx(ROWS * REMOTE)
    for n in (2, 4, 8, 16):  # 8 and 16 were not fitted on
        assert predict_cpu(costs, _row(n)) == pytest.approx(_row(n)["cpu_us_per_example"])


def test_the_prediction_error_is_reported_against_the_measurement():
    rows = [_row(1), _row(2), {**_row(4), "cpu_us_per_example": _row(4)["cpu_us_per_example"] * 1.25}]
    checks = {c["nodes"]: c for c in model_report(rows, interval_s=0.04, hot_interval_s=0.04)["checks"]}
    assert checks[2]["error"] == pytest.approx(0.0, abs=1e-12)
    assert checks[4]["error"] == pytest.approx(1 / 1.25 - 1)  # the model holds; the measurement ran 25% over it


def test_projection_formula_per_trainer_and_per_node_exchange():
    costs = fit_costs([_row(1), _row(2), _row(4)], interval_s=0.04, hot_interval_s=0.04)
    m, t = 32, 15
    gloo = GLOO[0] + GLOO[1] * 31
    k_round, k_hot = ROUND[0] + ROUND[1] * 31 + gloo, HOT[0] + HOT[1] * 31 + gloo
    work = C1 / (C1 + K_ROW * ROWS * REMOTE * 31 / 32)
    assert project_efficiency(costs, m, 1) == pytest.approx((1 - k_round * 1e-6 / 0.04 - k_hot * 1e-6 / 0.04) * work)
    assert project_efficiency(costs, m, t) == pytest.approx((1 - k_round * 1e-6 / 0.04 - k_hot * 1e-6 / 0.6) * work)
    assert project_efficiency(costs, m, t, per_node=True) == pytest.approx(
        (1 - k_round * 1e-6 / 0.6 - k_hot * 1e-6 / 0.6) * work)
    assert project_efficiency(costs, 1, 1) == 1.0
    assert project_efficiency(costs, 4096, 1) == 0.0  # rounds longer than the interval: no time left to train


def test_a_measured_relay_cost_replaces_the_shared_rounds_and_the_server_load_is_reported():
    """With k_relay from a node-exchange run, a trainer core pays its relay, not a share of the rounds (they run on
    the node's server, whose load is t rounds merged plus gloo's per interval)."""
    rows = [_row(1), _row(2), _row(4)]
    report = model_report(rows, interval_s=0.04, hot_interval_s=0.04, relay_us=400.0)
    p = next(p for p in report["projections"] if (p["machines"], p["trainers_per_node"]) == (32, 15))
    gloo = GLOO[0] + GLOO[1] * 31
    k_hot = HOT[0] + HOT[1] * 31 + gloo
    work = C1 / (C1 + K_ROW * ROWS * REMOTE * 31 / 32)
    assert p["per_node_exchange"] == pytest.approx((1 - 400e-6 / 0.04 - k_hot * 1e-6 / 0.6) * work)
    assert p["server_load"] == pytest.approx((15 * (ROUND[0] + ROUND[1] * 31) + gloo) * 1e-6 / 0.04)
    without = model_report(rows, interval_s=0.04, hot_interval_s=0.04)["projections"]
    assert all(q["server_load"] is None for q in without)  # unknown relay: the former per-node estimate


def test_rows_without_gloo_measures_leave_it_out():
    rows = [{k: v for k, v in _row(n).items() if k != "gloo_cpu_us_per_example"} for n in (1, 2, 4)]
    costs = fit_costs(rows, interval_s=0.04, hot_interval_s=0.04)
    assert costs.gloo_us == (0.0, 0.0) and costs.k_row > K_ROW  # gloo's share lands in the fitted rest


def test_the_model_needs_a_multi_node_run():
    with pytest.raises(ValueError, match="more than one node"):
        fit_costs([_row(1)], interval_s=0.04, hot_interval_s=0.04)


def _loaded(n: int, slope: float = 0.15) -> float:
    """What N one-node jobs side by side cost per example on a machine that slows every process as more run."""
    return C1 * (1 + slope * (n - 1))


def test_load_matched_costs_take_the_machines_load_out_of_the_per_row_rest():
    """Loopback nodes share one machine: rows whose every process costs more the more of them run. Against c(1)
    alone the load lands in k_row and the 4-node point is under-predicted; against each node count's side-by-side
    reference the true costs come back, the other node counts are predicted, and the projection (a machine per
    node) is the load-free one."""
    rows = [{**_row(n), "cpu_us_per_example": _row(n)["cpu_us_per_example"] + _loaded(n) - C1} for n in (1, 2, 4)]
    plain = model_report(rows, interval_s=0.04, hot_interval_s=0.04)
    assert plain["costs"]["k_row"] > 2 * K_ROW  # the 2-node load, taken for a cost per remote row
    assert {c["nodes"]: c for c in plain["checks"]}[4]["error"] < -0.02  # under-predicts the loaded 4-node point
    load = {n: _loaded(n) for n in (2, 4)}
    matched = fit_costs(rows, interval_s=0.04, hot_interval_s=0.04, load=load)
    assert matched.k_row == pytest.approx(K_ROW) and matched.c_one == pytest.approx(C1)
    assert matched.round_us == pytest.approx(ROUND) and matched.gloo_us == pytest.approx(GLOO)
    report = model_report(rows, interval_s=0.04, hot_interval_s=0.04, load=load)
    assert all(c["error"] == pytest.approx(0.0, abs=1e-12) for c in report["checks"])
    clean = fit_costs([_row(n) for n in (1, 2, 4)], interval_s=0.04, hot_interval_s=0.04)  # a machine per node
    assert project_efficiency(matched, 32, 15) == pytest.approx(project_efficiency(clean, 32, 15))
    assert project_efficiency(matched, 32, 15) > project_efficiency(fit_costs(rows, interval_s=0.04,
                                                                               hot_interval_s=0.04), 32, 15)
