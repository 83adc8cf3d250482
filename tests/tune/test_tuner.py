"""The autotuner: its schedule space holds the standard schedules, every candidate agrees with the reference
interpreter (and a wrong one is caught), the cost model ranks plans sensibly, and `cocosync tune` times the legal
candidates on real ranks, chooses the fastest median, writes the JSON and caches the choice."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from cocosync.cli import main
from cocosync.lower import lower
from cocosync.programs.optimizers import adam_program
from cocosync.schedule.schedule import Directive, replay
from cocosync.schedule.standard import STANDARD
from cocosync.tune.cost import MachineModel, predict
from cocosync.tune.oracle import agrees
from cocosync.tune.space import Candidate, schedule_space
from cocosync.tune.workloads import BUILTIN, workload

MODEL = MachineModel(copy_bw=10e9, alloc_bw=2e9, call_s=2e-6, comm_latency_s=30e-6, comm_bw=4e9,
                     matmul_flops=50e9, world=2)


@pytest.mark.parametrize("name", ["adam", "lamb", "sgd", "bmuf", "megatron"])
def test_space_holds_the_standard_schedule_and_every_candidate_agrees_with_the_oracle(name):
    work = workload(name)
    program = work.small()
    space = schedule_space(program, work.internal)
    programs = [str(replay(program, c.directives)) for c in space]
    assert programs[0] == str(program) and len(set(programs)) == len(programs)  # as written first, no duplicates
    assert str(STANDARD[name](program).program) in programs
    for world in (2, 3):
        for c in space:
            assert agrees(work, c, world) is None, (c.name, world)
    if name == "megatron":
        assert {"split+reorder+overlap(2)", "split+reorder+overlap(8)"} <= {c.name for c in space}


@dataclass(frozen=True)
class _L2Instead(Directive):
    """Not a schedule: swaps AdamW's decoupled decay for L2 (a different update with the same inputs)."""

    def apply(self, program):
        return adam_program(program.inputs[0].shape[0], decoupled=False), None


def test_the_oracle_rejects_a_candidate_that_computes_something_else():
    why = agrees(workload("adam"), Candidate("wrong", (_L2Instead(),)), 2)
    assert why is not None and "differs from the program as written" in why


def test_cost_model_ranks_the_fused_collective_first_and_scales_with_bandwidth():
    program = BUILTIN["adam"][0]()
    space = {c.name: c for c in schedule_space(program, ("m", "v"))}
    plans = {name: lower(replay(program, c.directives)) for name, c in space.items()}
    fused = predict(plans["split+reorder+as_slice+fuse"], MODEL)
    unfused = predict(plans["as written"], MODEL, [False] * len(plans["as written"].steps))
    assert fused < unfused / 5
    faster = MachineModel(**{**MODEL.as_dict(), "copy_bw": 2 * MODEL.copy_bw, "comm_bw": 2 * MODEL.comm_bw})
    assert predict(plans["split+reorder+as_slice+fuse"], faster) < 0.6 * fused


def test_cost_model_across_nodes_is_hierarchical():
    import cocosync as cs

    x = cs.Tensor("x", 1 << 20, layout=cs.Local)  # 4 MB
    plan = lower(cs.Program("ar", [x], {"y": cs.all_reduce(x)}))
    net = MachineModel(**{**MODEL.as_dict(), "inter_latency_s": 200e-6, "inter_bw": 1e9, "inter_rs_bw": 0.5e9,
                          "inter_ag_bw": 0.8e9})
    one = predict(plan, net.at(4, 1))
    assert one == pytest.approx(30e-6 + 4 * 2**20 * 2 * 3 / 4 / 4e9)
    # 2 nodes x 2 ranks: shared memory over 2 local ranks, then each rank's half among 2 nodes over the network
    two = predict(plan, net.at(4, 2))
    assert two == pytest.approx(30e-6 + 4 * 2**20 * 2 * 1 / 2 / 4e9 + 200e-6 + 2 * 2**20 * 2 * 1 / 2 / 1e9)
    assert predict(plan, net.at(4, 2, net_bw=10e9)) < two  # a faster network
    with pytest.raises(ValueError, match="nodes=3 must divide world=4"):
        net.at(4, 3)


PROGRAM_FILE = """
from cocosync.programs.optimizers import adam_program
program = adam_program(1 << 16)
small = adam_program(96)
internal = ("m", "v")
scalars = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "wd": 0.0, "c1": 0.1, "c2": 0.001}
"""


def test_cocosync_tune_times_the_candidates_chooses_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("COCOSYNC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COCOSYNC_KERNELS", "eager")  # no kernel compilation: this test checks the tuner, not speed
    path = tmp_path / "adam_small.py"
    path.write_text(textwrap.dedent(PROGRAM_FILE))
    out = tmp_path / "tune.json"
    res = CliRunner().invoke(main, ["tune", str(path), "--repeats", "3", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    rows = doc["candidates"]
    timed = [r for r in rows if "measured_s" in r]
    assert len(timed) == len(rows) == 5 and all(r["predicted_s"] > 0 for r in timed)
    assert doc["chosen"] == min(timed, key=lambda r: r["measured_s"])["name"]
    assert rows[0]["schedule"] == [] and rows[-1]["schedule"][-1].startswith("fuse(")
    assert "chosen:" in res.output and "(cached)" not in res.output
    again = CliRunner().invoke(main, ["tune", str(path)])
    assert again.exit_code == 0 and "(cached)" in again.output and doc["chosen"] in again.output
    assert len(list((tmp_path / "cache" / "tune").glob("*.json"))) == 1
    assert [p["nodes"] for p in doc["projection"]] == [1, 2, 4, 8, 16, 32]
    assert set(doc["projection"][1]["predicted_s"]) == {r["name"] for r in timed}
    # two simulated nodes (one rank each: gloo between them), predicted also from the one-node model
    out2 = tmp_path / "tune2.json"
    res = CliRunner().invoke(main, ["tune", str(path), "--ranks", "2", "--nodes", "2", "--repeats", "1",
                                    "--model-from", str(out), "--json", str(out2)])
    assert res.exit_code == 0, res.output
    two = json.loads(out2.read_text())
    assert two["nodes"] == 2 and two["model"]["nodes"] == 2 and two["model_from"] == doc["model"]
    assert all(r["predicted_from_s"] > 0 for r in two["candidates"] if "measured_s" in r)
    assert two["cross_error"] is not None and "2 nodes" in res.output and "median error" in res.output
    bad = CliRunner().invoke(main, ["tune", str(path), "--ranks", "3", "--nodes", "2"])
    assert bad.exit_code != 0 and "does not divide --ranks 3" in bad.output


def test_tune_refuses_an_unknown_target():
    res = CliRunner().invoke(main, ["tune", "adamw2"])
    assert res.exit_code != 0 and "neither a .py file nor a built-in workload" in res.output


_HEAP_CHILD = """
import sys, torch
from cocosync.tune.measure import steady_allocator
if sys.argv[1] == "pin":
    assert steady_allocator()
t = torch.empty(4 << 20)  # 16 MB
for line in open("/proc/self/maps"):
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    if lo <= t.data_ptr() < hi:
        print("heap" if line.rstrip().endswith("[heap]") else "mmap")
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_steady_allocator_serves_16mb_results_from_the_heap():
    # glibc's default mmaps a fresh 16 MB block (its pages fault in on first write); the tuner's ranks pin the
    # allocator so such results reuse heap memory, as a training loop's steady state does
    where = {mode: subprocess.run([sys.executable, "-c", _HEAP_CHILD, mode], capture_output=True, text=True,
                                  timeout=120).stdout.strip() for mode in ("default", "pin")}
    assert where == {"default": "mmap", "pin": "heap"}
