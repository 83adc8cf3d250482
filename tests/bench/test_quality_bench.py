"""`cocosync bench quality`: real runs at two trainer counts, the table's numbers from the runs' own eval NE, the
target verdict, and the JSON and PNG it writes."""

from __future__ import annotations

import json
import statistics

import pytest
from click.testing import CliRunner
from scipy import stats

from cocosync.bench.quality import _reference, _target, change_interval, tolerance, verdict
from cocosync.cli import main as cli


def test_quality_bench_relates_each_run_to_one_trainer_of_the_same_seed(tmp_path):
    out = tmp_path / "q"
    res = CliRunner().invoke(cli, ["bench", "quality", "--trainers", "2", "--algorithms", "shadow-ma",
                                   "--seeds", "2", "--examples", "20000", "--eval-examples", "2000",
                                   "--reference-jobs", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "quality.json").read_text())
    runs = result["runs"]
    assert sorted((r["algorithm"], r["T"], r["seed"]) for r in runs) == sorted(
        [("none", 1, s) for s in (0, 1)] + [("shadow-ma", 2, s) for s in (0, 1)])
    ref = {r["seed"]: r["eval_ne"] for r in runs if r["algorithm"] == "none"}
    for row in result["rows"]:
        mine = [r for r in runs if r["algorithm"] == row["algorithm"] and r["T"] == row["T"]]
        change = sum(r["eval_ne"] / ref[r["seed"]] - 1 for r in mine) / len(mine)
        assert abs(row["change"] - change) < 1e-12
        changes = [r["eval_ne"] / ref[r["seed"]] - 1 for r in mine]
        assert row["verdict"] == verdict(changes, tolerance(2))[0]
        assert row["change_low"] <= row["change"] <= row["change_high"]
        assert row["pass"] == (row["verdict"] == "PASS")
        # the embedding rows' staleness (updates a pushed row received since its fetch): the runs' median
        assert row["row_staleness"] == statistics.median(r["row_staleness"] for r in mine) >= 0
    assert (out / "quality.png").stat().st_size > 10_000
    assert len((out / "quality-runs.jsonl").read_text().splitlines()) == len(runs)  # written as each run ended
    assert "| shadow-ma | 2 |" in res.output  # the markdown row for BENCHMARKS.md
    assert "90% interval" in res.output
    # the references ran side by side: the same bits as a T=1 run alone
    base = dict(examples=20000, eval_examples=2000, progress=False, plot=False, checkpoint=False)
    assert _reference(1, base, tmp_path / "alone")["eval_ne"] == ref[1]


def test_change_interval_is_students_t_interval_of_the_mean():
    changes = [0.012, -0.003, 0.027, 0.002, 0.007]
    lo, hi = change_interval(changes)
    want = stats.t.interval(0.90, len(changes) - 1, loc=statistics.fmean(changes),
                            scale=stats.sem(changes))
    assert lo == pytest.approx(want[0]) and hi == pytest.approx(want[1])


def test_verdict_is_pass_fail_or_unresolved_with_the_seeds_that_would_tell():
    assert verdict([0.001, 0.002, 0.0015, 0.0012, 0.0018], 0.005) == ("PASS", None)  # whole interval below
    assert verdict([0.020, 0.021, 0.019, 0.022, 0.018], 0.005) == ("FAIL", None)  # whole interval above
    word, need = verdict([0.012, -0.003, 0.027, 0.002, 0.007], 0.005)  # mean 0.9%, spread 1.2%: straddles 0.5%
    assert word == "UNRESOLVED" and need > 5
    sd, gap = statistics.stdev([0.012, -0.003, 0.027, 0.002, 0.007]), 0.009 - 0.005
    assert stats.t.ppf(0.95, need - 1) * sd / need ** 0.5 < gap <= stats.t.ppf(0.95, need - 2) * sd / (need - 1) ** 0.5
    assert verdict([0.01], 0.005) == ("UNRESOLVED", None)  # one seed: no interval
    assert verdict([0.004, 0.006, 0.0045, 0.0055, 0.005], 0.005) == ("UNRESOLVED", None)  # mean on the line
    row = {"verdict": "UNRESOLVED", "seeds": 5, "T": 8}
    assert _target({**row, "seeds_to_resolve": None}) == "UNRESOLVED (0.5%, mean on the line: > 1,000 seeds to tell)"
    assert _target({**row, "seeds_to_resolve": 17}) == "UNRESOLVED (0.5%, ~17 seeds to tell)"


def test_quality_bench_names_bad_arguments():
    res = CliRunner().invoke(cli, ["bench", "quality", "--algorithms", "shadow-foo"])
    assert res.exit_code == 2 and "shadow-foo" in res.output
    res = CliRunner().invoke(cli, ["bench", "quality", "--trainers", "2,x"])
    assert res.exit_code == 2 and "2,x" in res.output
    res = CliRunner().invoke(cli, ["bench", "quality", "--examples", "1600000,lots"])
    assert res.exit_code == 2 and "1600000,lots" in res.output
    # a length too short for a trainer count is refused before any run, naming both
    res = CliRunner().invoke(cli, ["bench", "quality", "--trainers", "16", "--examples", "1600000,1000"])
    assert res.exit_code == 2 and "1000 with --trainers 16" in res.output


def test_several_run_lengths_each_against_one_trainer_of_the_same_length(tmp_path, monkeypatch):
    """--examples N1,N2: every configuration and its T=1 reference at each length, seed-major; a row per (algorithm,
    T, length) against the references of its own length, with its examples per trainer; one plot panel per length."""
    import cocosync.bench.quality as bench

    order = []

    def train(alg, T, seed, base, out, console):  # NE known per run: the loss at T shrinks with examples per trainer
        n = base["examples"]
        order.append((seed, n, alg, T))
        assert out.name == f"examples-{n}"  # each length's runs in a folder of its own
        ne = 0.70 + 0.002 * seed - 0.01 * (n > 100_000) + (T > 1) * 0.7 * T / n
        return {"algorithm": alg, "T": T, "seed": seed, "examples": n, "eval_ne": ne, "eps": 1e5,
                "sync_gap": 3.0, "max_train_ne": 0.8, "row_staleness": 1.0}

    monkeypatch.setattr(bench, "_train", train)
    out = tmp_path / "q"
    res = CliRunner().invoke(cli, ["bench", "quality", "--trainers", "4", "--algorithms", "shadow-ma", "--seeds", "3",
                                   "--examples", "80000,160000", "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "quality.json").read_text())
    assert result["settings"]["examples"] == [80000, 160000]
    assert result["reference_eval_ne"] == pytest.approx({"80000": 0.702, "160000": 0.692})
    rows = {r["examples"]: r for r in result["rows"]}
    assert [(r["T"], r["examples_per_trainer"], r["seeds"]) for r in rows.values()] == [(4, 20000, 3), (4, 40000, 3)]
    for n, row in rows.items():  # each against its own length's T=1 of the same seed
        want = statistics.fmean((0.70 + 0.002 * s - 0.01 * (n > 100_000) + 2.8 / n)
                                / (0.70 + 0.002 * s - 0.01 * (n > 100_000)) - 1 for s in range(3))
        assert row["change"] == pytest.approx(want)
    assert rows[160000]["change"] < rows[80000]["change"]
    # seed-major: both lengths of seed 0 before any run of seed 1
    assert [k for k in order if k[3] > 1] == [(s, n, "shadow-ma", 4) for s in range(3) for n in (80000, 160000)]
    assert "| shadow-ma | 4 | 80k (20k) |" in res.output and "| shadow-ma | 4 | 160k (40k) |" in res.output
    assert (out / "quality.png").stat().st_size > 10_000


def test_a_time_limit_keeps_the_runs_that_finished(tmp_path, monkeypatch):
    """Under --time-limit no run starts that would end after it (by the slowest so far); the rows are the finished
    runs' (runs of known NE here: the bench's arithmetic, not training)."""
    import time

    import cocosync.bench.quality as bench

    clock = [0.0]

    def train(alg, T, seed, base, out, console):  # each run takes 10 s of the fake clock
        clock[0] += 10.0
        return {"algorithm": alg, "T": T, "seed": seed, "examples": base["examples"],
                "eval_ne": 0.70 + 0.01 * (T > 1) + 0.001 * seed,
                "eps": 1e5, "sync_gap": 2.0 if T > 1 else float("nan"), "max_train_ne": 0.8}

    monkeypatch.setattr(bench, "_train", train)
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    out = tmp_path / "q"
    # 2 references (20 s), then seed 0's T=2 and T=4 (to 40 s); seed 1's T=2 would end at 50 s
    res = CliRunner().invoke(cli, ["bench", "quality", "--trainers", "2,4", "--algorithms", "shadow-ma", "--seeds", "2",
                                   "--time-limit", "45", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "stopped after 2 of 4 runs" in res.output
    result = json.loads((out / "quality.json").read_text())
    assert [(r["T"], r["seeds"]) for r in result["rows"]] == [(2, 1), (4, 1)]
    assert result["rows"][0]["change"] == pytest.approx(0.01 / 0.70)
    assert result["rows"][0]["verdict"] == "UNRESOLVED"  # one seed decides nothing
    assert len((out / "quality-runs.jsonl").read_text().splitlines()) == 4
