"""`cocosync bench collectives` end to end on a tiny sweep, and the shared bench utilities (no timed assertions)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cocosync.bench.common import fmt_bytes, fmt_seconds, markdown_table, parse_size, stats
from cocosync.cli import main
from cocosync.runtime.comm.shm import leftover_segments
from cocosync.runtime.comm.topology import Topology, topology_from_env


def test_parse_and_format():
    assert parse_size("4K") == 4096 and parse_size("16mb") == 16 << 20 and parse_size("1G") == 1 << 30
    assert parse_size("100") == 100
    with pytest.raises(ValueError, match="'4Q'"):
        parse_size("4Q")
    assert fmt_bytes(4096) == "4 KB" and fmt_bytes(256 << 20) == "256 MB"
    assert fmt_seconds(0.0025) == "2.50 ms" and fmt_seconds(2e-5) == "20 us"
    s = stats([3.0, 1.0, 2.0])
    assert s.median == 2.0 and s.n == 3
    assert markdown_table(["a", "b"], [[1, 2]]).splitlines()[2] == "| 1 | 2 |"


def test_topology(monkeypatch):
    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    t = topology_from_env()
    assert (t.node, t.nnodes, t.local_ranks_global, t.global_rank(0, node=0)) == (1, 2, [2, 3], 0)
    with pytest.raises(ValueError, match="numbered node by node"):
        Topology(rank=1, world_size=4, local_rank=1, local_world_size=2, node=1)


def test_bench_collectives_cli_tiny(tmp_path):
    out = tmp_path / "c.json"
    res = CliRunner().invoke(main, ["bench", "collectives", "--sizes", "4K,64K", "--repeats", "1",
                                    "--fused-params", "64K", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "all_reduce" in res.output and "gloo" in res.output and "fused" in res.output
    data = json.loads(out.read_text())
    ops = {(r["op"], r["bytes"]) for r in data["rows"]}
    assert ops == {(op, b) for op in ("all_reduce", "reduce_scatter", "all_gather") for b in (4096, 65536)}
    assert data["bandwidth_Bps"] > 0 and len(data["fused"]["rows"]) == 4
    assert all(r["backend_s"] > 0 and r["gloo_over_backend"] > 0 for r in data["rows"]) and "backend" in res.output
    assert any(r["variant"].startswith("DSL: scheduled adam_program") for r in data["fused"]["rows"])
    assert leftover_segments() == []


def test_peer_baselines_say_why_they_are_missing(monkeypatch):
    import sys

    from cocosync.bench.peers import deepspeed_all_reduce, mpi_all_reduce

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # not installed
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    fn, why = deepspeed_all_reduce()
    assert fn is None and why.startswith("deepspeed not importable")
    fn, why = mpi_all_reduce()
    assert fn is None and why.startswith("mpi4py not importable")
