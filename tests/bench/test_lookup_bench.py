"""`cocosync bench lookups`: CPU per extra example recovered from two runs of known cost, the straight-line
projection, the verdicts, and the table, JSON and PNG it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cocosync.bench.common import fit_line
from cocosync.bench.lookup_scaling import projected_efficiency
from cocosync.cli import main as cli


def test_the_fit_and_its_projection():
    a, b = fit_line([1, 2, 4], [10.0, 11.0, 13.0])  # exactly 9 + 1 x nodes
    assert (a, b) == pytest.approx((9.0, 1.0))
    assert projected_efficiency(a, b, 1) == pytest.approx(1.0)
    assert projected_efficiency(a, b, 32) == pytest.approx(10 / 41)
    assert projected_efficiency(10.0, 0.0, 128) == 1.0  # flat: scales


def _fake_wave(jobs, per_node):
    return [_fake_run(n, label, ex, per_node, extra, out) for n, label, ex, extra, out in jobs]


def _fake_run(nodes, transport, examples, per_node, extra, out):
    """A job whose CPU is 2 s of start-up plus (9 + 1.5 x nodes) us per example (RPC 3 us per node): what the bench
    must recover by its difference of two runs."""
    per_node_us = {"exchange": 1.5, "rpc": 3.0, "exchange hot=4096": 1.0, "exchange hot=0": 2.0}[transport]
    cpu = 2.0 + examples * (9 + per_node_us * nodes) * 1e-6
    assert "--config" in extra and "--eval-examples" in extra  # no checkpoint/plot config, the eval size
    return {"job_cpu_seconds": cpu, "examples": examples, "staleness": 0.0 if nodes == 1 else 2.5 * nodes,
            "lookup_wait_fraction": 0.01 * nodes, "eval_ne": 0.7, "messages_per_example": 0.002 * (nodes - 1),
            "lookup_wait_past_start": 0.001 * nodes,  # the job's share past its trainers' start windows
            "network_bytes_per_example": 500.0 * (nodes - 1), "exchange_cpu_us_per_round": 800.0 + 100 * nodes,
            "rpc_round_trip_s": 0.0, "eps": 1e5, "prefetch": 6, "exchange_rounds": examples // 1000 * (nodes > 1),
            "hot_syncs": examples // 2000 * (nodes > 1), "hot_sync_cpu_us_per_sync": 400.0,
            "rows_per_example": 20.0, "remote_row_fraction": 0.25 * (nodes - 1) / nodes,
            # the workers' share grows by 0.5 us per example per node, the exchange's is 1 us from 2 nodes on
            "cpu_seconds_by_thread": {"trainer/worker": 1.0 + examples * (6 + 0.5 * nodes) * 1e-6,
                                      "trainer/exchange": examples * 1e-6 * (nodes > 1)}}


def test_lookup_bench_recovers_cpu_per_example_and_projects_it(tmp_path, monkeypatch):
    """The bench's arithmetic on jobs of known cost (the jobs themselves: the multi-node tests in test_cluster.py)."""
    import cocosync.bench.lookup_scaling as bench

    monkeypatch.setattr(bench, "_run_wave", _fake_wave)
    out = tmp_path / "lk"
    res = CliRunner().invoke(cli, ["bench", "lookups", "--nodes", "1,2,4", "--repeats", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "lookups.json").read_text())
    rows = {(r["nodes"], r["transport"]): r for r in result["rows"]}
    assert set(rows) == {(1, "local"), (2, "exchange"), (2, "rpc"), (4, "exchange"), (4, "rpc")}
    assert rows[(1, "local")]["cpu_us_per_example"] == pytest.approx(10.5)  # start-up cancelled
    assert rows[(4, "exchange")]["cpu_us_per_example"] == pytest.approx(15.0)
    assert rows[(4, "rpc")]["efficiency"] == pytest.approx(10.5 / 21.0)
    assert rows[(2, "exchange")]["samples"] == 2 and len(result["samples"]["4:rpc"]) == 2
    fit = result["fits"]["exchange"]  # the 1-node point is the local run (9 + 1.5 at one node)
    assert (fit["intercept_us"], fit["slope_us_per_node"]) == pytest.approx((9.0, 1.5))
    assert fit["efficiency_32"] == pytest.approx(10.5 / 57.0)
    model = result["models"]["exchange"]  # exchange_model.py on these rows (its arithmetic: test_exchange_model.py)
    assert [c["nodes"] for c in model["checks"]] == [1, 2, 4]
    assert model["costs"]["round_us"] == pytest.approx((900.0, 100.0))  # 800 + 100 N = 900 + 100 (N - 1)
    assert 0 < model["projections"][0]["per_trainer_exchange"] <= model["projections"][0]["per_node_exchange"] <= 1
    verdicts = result["verdicts"]
    assert "MISS CPU efficiency at 4 nodes, exchange: 0.70 (target >= 0.9)" in verdicts
    # the wait past the start: the long run's share past its trainers' start windows, beside the whole run's
    assert rows[(4, "exchange")]["lookup_wait_past_start"] == pytest.approx(0.004)
    assert "PASS lookup wait past the start at 4 nodes, exchange: 0.4% of step time past each trainer's first " \
           "prefetch window (target < 5%)" in verdicts
    assert any(v.startswith("MISS staleness at 4 nodes, rpc: 10.00") for v in verdicts)
    assert any(v.startswith("PASS lookup wait at 2 nodes, exchange: 2.0%") for v in verdicts)
    assert (out / "lookups.png").stat().st_size > 10_000
    assert "| 4 | rpc | 21.00 | 0.50 |" in res.output  # the markdown row for BENCHMARKS.md
    # the CPU by thread, recovered per extra example like the total
    assert rows[(4, "exchange")]["cpu_us_per_example_by_thread"] == pytest.approx(
        {"trainer/worker": 8.0, "trainer/exchange": 1.0})
    assert rows[(1, "local")]["cpu_us_per_example_by_thread"]["trainer/exchange"] == 0.0
    assert "| trainer/worker | 6.50 | 7.00 | 7.00 | 8.00 | 8.00 |" in res.output


def test_parallel_waves_are_a_latin_square_and_give_the_same_arithmetic(tmp_path, monkeypatch):
    import cocosync.bench.lookup_scaling as bench

    plan = bench.waves([1, 2, 4], ["A", "B"], parallel=True)
    assert plan == [[(1, "A"), (2, "A"), (4, "B")], [(1, "A"), (2, "B"), (4, "A")]]  # each variant once per count
    assert bench.waves([1, 2], ["A", "B"], parallel=False) == [[(1, "A")], [(2, "A")], [(2, "B")]]
    started = []
    monkeypatch.setattr(bench, "_run_wave", lambda jobs, per_node: started.append(len(jobs)) or _fake_wave(jobs, 1))
    out = tmp_path / "lk"
    res = CliRunner().invoke(cli, ["bench", "lookups", "--nodes", "1,2,4", "--transports", "exchange", "--hot-rows",
                                   "4096,0", "--repeats", "1", "--parallel", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert started == [3, 3, 3, 3]  # 2 waves x (short, long), 3 jobs side by side each
    result = json.loads((out / "lookups.json").read_text())
    rows = {(r["nodes"], r["transport"]): r for r in result["rows"]}
    assert rows[(1, "local")]["samples"] == 2 and rows[(4, "exchange hot=0")]["samples"] == 1
    assert rows[(4, "exchange hot=4096")]["cpu_us_per_example"] == pytest.approx(13.0)  # 9 + 1.0 x 4
    assert rows[(2, "exchange hot=0")]["cpu_us_per_example"] == pytest.approx(13.0)  # 9 + 2.0 x 2


def test_lookup_bench_names_bad_arguments():
    res = CliRunner().invoke(cli, ["bench", "lookups", "--transports", "carrier-pigeon"])
    assert res.exit_code == 2 and "carrier-pigeon" in res.output
    res = CliRunner().invoke(cli, ["bench", "lookups", "--nodes", "2,4"])
    assert res.exit_code == 2 and "including 1" in res.output
    res = CliRunner().invoke(cli, ["bench", "lookups", "--hot-staleness", "2,-1"])
    assert res.exit_code == 2 and "--hot-staleness '2,-1'" in res.output
    res = CliRunner().invoke(cli, ["bench", "lookups", "--gloo-device", "shared,one"])
    assert res.exit_code == 2 and "--gloo-device 'shared,one'" in res.output
    res = CliRunner().invoke(cli, ["bench", "lookups", "--launcher", "torchrun,mpirun"])
    assert res.exit_code == 2 and "--launcher 'torchrun,mpirun'" in res.output


def test_staleness_bounds_are_variants_of_the_exchanges_with_hot_rows():
    from cocosync.bench.lookup_scaling import variants

    got = variants(["exchange", "rpc"], [4096, 0], [0.0, 2.0])
    assert list(got) == ["exchange hot=4096 bound=0", "exchange hot=4096 bound=2", "exchange hot=0", "rpc"]
    assert got["exchange hot=4096 bound=2"][-3:] == ["--hot-staleness", "2.0", "launcher:cocosync"]
    assert got["rpc"] == ["--lookup-transport", "rpc", "--hot-rows", "0", "--hot-staleness", "0.0", "launcher:cocosync"]
    assert list(variants(["exchange"], [4096])) == ["exchange"]  # one configuration: the plain label
    got = variants(["exchange"], [4096], None, ["shared", "per-group"])  # the device mode rides as the job's env
    assert list(got) == ["exchange dev=shared", "exchange dev=per-group"]
    assert got["exchange dev=per-group"][-2] == "env:COCOSYNC_GLOO_DEVICE=per-group"
    got = variants(["exchange"], [4096], None, None, ["cocosync", "torchrun"])  # how each node starts
    assert list(got) == ["exchange via cocosync", "exchange via torchrun"]
    assert got["exchange via torchrun"][-1] == "launcher:torchrun"


def test_a_time_limit_keeps_the_rounds_that_finished(tmp_path, monkeypatch):
    """Under --time-limit the bench starts no wave that would end after it (by the slowest wave so far) and reports
    what finished; too short for a comparison, it says so."""
    import time

    import cocosync.bench.lookup_scaling as bench

    clock = [0.0]

    def wave(jobs, per_node):  # every job of a wave takes 10 s of the fake clock
        clock[0] += 10.0
        return _fake_wave(jobs, per_node)

    monkeypatch.setattr(bench, "_run_wave", wave)
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    out = tmp_path / "lk"
    # 5 waves a round (1 node, then 2 and 4 nodes x 2 transports), 20 s each (a short and a long run)
    res = CliRunner().invoke(cli, ["bench", "lookups", "--nodes", "1,2,4", "--repeats", "2", "--time-limit", "70",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "stopped after 3 of 10 samples" in res.output
    result = json.loads((out / "lookups.json").read_text())
    assert [(r["nodes"], r["transport"], r["samples"]) for r in result["rows"]] == [
        (1, "local", 1), (2, "exchange", 1), (2, "rpc", 1)]
    assert result["rows"][1]["cpu_us_per_example"] == pytest.approx(12.0)  # the finished samples' arithmetic
    clock[0] = 0.0
    res = CliRunner().invoke(cli, ["bench", "lookups", "--nodes", "1,2", "--time-limit", "10", "--out", str(out)])
    assert res.exit_code == 1 and "--time-limit 10 s: too short" in res.output


def test_side_by_side_references_take_the_machines_load_out(tmp_path, monkeypatch):
    """--side-by-side: N one-node jobs of examples / N each, started together through torchrun's launcher, as the
    N-node rows' reference. A fake machine whose every process costs more per example the more processes share it
    (+0.5 us per node's worth of jobs) must show the N-node job's own cost apart from that load."""
    import cocosync.bench.lookup_scaling as bench
    import cocosync.testing.multinode as multinode

    started: list[tuple[int, int, int]] = []  # (nnodes, examples, wave) of every torchrun start

    def start(args, *, nnodes, nproc_per_node, env, launcher):
        assert launcher == "cocosync" and not any(a.startswith("launcher:") for a in args)
        started.append((nnodes, int(args[args.index("--examples") + 1]), len(waits)))
        return (nnodes, args)

    waits: list[int] = []

    def wait(job, timeout):
        nnodes, args = job
        load = sum(n for n, _, w in started if w == len(waits))  # nodes' worth of jobs started in this wave
        ex = int(args[args.index("--examples") + 1])
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        run = _fake_run(nnodes, "exchange", ex, 1, ["--config", "--eval-examples"], out)
        run["job_cpu_seconds"] += ex * 0.5 * (load - 1) * 1e-6
        run["cpu_seconds_by_thread"]["trainer/worker"] += ex * 0.5 * (load - 1) * 1e-6
        (out / "summary.json").write_text(json.dumps(run))
        return [multinode.NodeRun(0, 0, "")]

    real_wave = bench._run_wave

    def wave(jobs, per_node):
        got = real_wave(jobs, per_node)
        waits.append(1)
        return got

    monkeypatch.setattr(multinode, "start_nodes", start)
    monkeypatch.setattr(multinode, "wait_nodes", wait)
    monkeypatch.setattr(bench, "_run_wave", wave)
    out = tmp_path / "lk"
    res = CliRunner().invoke(cli, ["bench", "lookups", "--nodes", "1,2,4", "--transports", "exchange", "--repeats", "1",
                                   "--examples", "100000,300000", "--side-by-side", "--out", str(out)])
    assert res.exit_code == 0, res.output
    # the 4-node reference: 4 one-node jobs of 25,000 and of 75,000 examples, each wave's started together
    assert started.count((1, 25_000, 8)) == 4 and started.count((1, 75_000, 9)) == 4
    result = json.loads((out / "lookups.json").read_text())
    rows = {(r["nodes"], r["transport"]): r for r in result["rows"]}
    assert set(rows) == {(1, "local"), (2, "exchange"), (2, "side by side"), (4, "exchange"), (4, "side by side")}
    assert rows[(4, "side by side")]["cpu_us_per_example"] == pytest.approx(10.5 + 1.5)  # one node's + the load
    assert rows[(4, "exchange")]["cpu_us_per_example"] == pytest.approx(15.0 + 1.5)  # 9 + 1.5 x 4, + the load
    assert rows[(4, "exchange")]["efficiency"] == pytest.approx(10.5 / 16.5)
    assert rows[(4, "exchange")]["efficiency_side_by_side"] == pytest.approx(12.0 / 16.5)
    assert "efficiency_side_by_side" not in rows[(4, "side by side")]
    assert rows[(4, "side by side")]["cpu_us_per_example_by_thread"]["trainer/worker"] == pytest.approx(6.5 + 1.5)
    side = result["fits_side_by_side"]["exchange"]  # through 10.5, 10.5 x 12.5 / 11, 10.5 x 16.5 / 12
    a, b = fit_line([1, 2, 4], [10.5, 10.5 * 12.5 / 11.0, 10.5 * 16.5 / 12.0])
    assert (side["intercept_us"], side["slope_us_per_node"]) == pytest.approx((a, b))
    assert side["efficiency_32"] > result["fits"]["exchange"]["efficiency_32"]
    assert any(v.startswith("MISS CPU efficiency at 4 nodes against 4 one-node jobs side by side, exchange: 0.73")
               for v in result["verdicts"])
    assert not any("side by side:" in v for v in result["verdicts"])  # the reference gets no verdict of its own
    matched = result["models"]["exchange, load matched"]  # the exchange model on the side-by-side bases
    assert dict(map(tuple, matched["costs"]["load_us"])) == pytest.approx({2: 10.5 + 0.5, 4: 12.0})
    assert 0 < matched["costs"]["k_row"] < result["models"]["exchange"]["costs"]["k_row"]  # the load taken out
    assert "exchange, load matched, the exchange model" in res.output
    assert "| 4 | exchange | 16.50 | 0.64 | 0.73 |" in res.output
    res = CliRunner().invoke(cli, ["bench", "lookups", "--side-by-side", "--parallel"])
    assert res.exit_code == 2 and "not with --parallel" in res.output


def test_side_by_side_summaries_add_up():
    from cocosync.bench.lookup_scaling import combined

    a = {"job_cpu_seconds": 2.0, "examples": 100, "hot_syncs": 3, "staleness": 1.0, "eval_ne": 0.70,
         "cpu_seconds_by_thread": {"trainer/worker": 1.5, "embedding/main": 0.5}}
    b = {"job_cpu_seconds": 4.0, "examples": 100, "hot_syncs": 5, "staleness": 3.0, "eval_ne": 0.72,
         "cpu_seconds_by_thread": {"trainer/worker": 3.0, "trainer/gloo": 1.0}}
    got = combined([a, b])
    assert (got["job_cpu_seconds"], got["examples"], got["hot_syncs"]) == (6.0, 200, 8)
    assert got["staleness"] == 2.0 and got["eval_ne"] == pytest.approx(0.71)
    assert got["cpu_seconds_by_thread"] == {"trainer/worker": 4.5, "embedding/main": 0.5, "trainer/gloo": 1.0}
    assert combined([a]) is a


def test_the_load_matched_bases_lie_on_a_line_through_one_node_and_the_references():
    """One side-by-side reference below one node alone (a noisy pair, seen on the 2-core VM) is pulled up to the
    line through all of them; references already on a line are kept."""
    from cocosync.bench.lookup_scaling import _load_line

    assert _load_line(10.5, {2: 11.0, 4: 12.0}) == pytest.approx({2: 11.0, 4: 12.0})
    a, b = fit_line([1, 2, 4], [7.6, 7.3, 10.8])
    got = _load_line(7.6, {2: 7.3, 4: 10.8})
    assert got == pytest.approx({2: a + 2 * b, 4: a + 4 * b}) and got[2] > 7.6 > 7.3
