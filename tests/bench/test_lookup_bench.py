"""`cocosync bench lookups`: real torchrun runs on 1 and 2 loopback nodes, CPU per extra example recomputed from the
runs' own summaries, the straight-line projection, and the JSON and PNG it writes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cocosync.bench.lookup_scaling import fit_line, projected_efficiency
from cocosync.cli import main as cli


def test_the_fit_and_its_projection():
    a, b = fit_line([1, 2, 4], [10.0, 11.0, 13.0])  # exactly 9 + 1 x nodes
    assert (a, b) == pytest.approx((9.0, 1.0))
    assert projected_efficiency(a, b, 1) == pytest.approx(1.0)
    assert projected_efficiency(a, b, 32) == pytest.approx(10 / 41)
    assert projected_efficiency(10.0, 0.0, 128) == 1.0  # flat: scales


def test_lookup_bench_on_one_and_two_nodes(tmp_path):
    out = tmp_path / "lk"
    res = CliRunner().invoke(cli, ["bench", "lookups", "--nodes", "1,2", "--transports", "exchange", "--repeats", "1",
                                   "--examples", "4000,8000", "--eval-examples", "500", "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "lookups.json").read_text())
    one, two = sorted(result["rows"], key=lambda r: r["nodes"])
    assert (one["transport"], two["transport"]) == ("local", "exchange")
    for key, row in (("1:exchange", one), ("2:exchange", two)):  # the difference of the two runs' own CPU
        (sample,) = result["samples"][key]
        (cpu_a, cpu_b), (ex_a, ex_b) = sample["job_cpu_seconds"], sample["examples_run"]
        assert (ex_a, ex_b) == (4000, 8000) and cpu_a > 0 and cpu_b > 0
        assert row["cpu_us_per_example"] == pytest.approx(1e6 * (cpu_b - cpu_a) / (ex_b - ex_a))
    assert two["efficiency"] == pytest.approx(one["cpu_us_per_example"] / two["cpu_us_per_example"])
    assert two["messages_per_example"] > 0 and two["network_bytes_per_example"] > 0 and two["staleness"] >= 0
    assert one["messages_per_example"] == 0 and one["staleness"] == 0  # one node: every row in place
    fit = result["fits"]["exchange"]  # two points: the line passes through both
    assert fit["intercept_us"] + fit["slope_us_per_node"] == pytest.approx(one["cpu_us_per_example"])
    assert any(v.startswith(("PASS", "MISS")) and "projected efficiency" in v for v in result["verdicts"])
    assert (out / "lookups.png").stat().st_size > 10_000
    assert "| 2 | exchange |" in res.output  # the markdown row for BENCHMARKS.md


def test_lookup_bench_names_bad_arguments():
    res = CliRunner().invoke(cli, ["bench", "lookups", "--transports", "carrier-pigeon"])
    assert res.exit_code == 2 and "carrier-pigeon" in res.output
    res = CliRunner().invoke(cli, ["bench", "lookups", "--nodes", "2,4"])
    assert res.exit_code == 2 and "including 1" in res.output
