"""The ShadowSync scaling model: which resource binds, and how efficiency follows from the measured inputs."""

from __future__ import annotations

import math

from cocosync.bench.scaling_model import Measured, project, projection_table


def _m(**kw) -> Measured:
    base = dict(c_single=40_000.0, c_remote=40_000.0, rows_per_example=20.0, remote_bytes_per_example=1_000.0,
                dense_params=27_601, rpc_s=0.002, server_call_s=1e-6, server_row_s=5e-8, batch_size=256)
    return Measured(**{**base, **kw})


def test_one_machine_is_the_reference_but_its_server_core_idles():
    p = project(_m(), 1, 10, 15, 1)
    assert (p["limit"], p["sync_gap"]) == ("trainers", 0.0) and math.isclose(p["efficiency"], 15 / 16)


def test_trainer_cost_is_linear_in_the_remote_fraction():
    m = _m(c_remote=50_000.0, server_row_s=1e-9)  # servers take the remote rows' updates: trainers get cheaper
    p2, p4, p32 = project(m, 2, 100, 15, 1), project(m, 4, 100, 15, 1), project(m, 32, 100, 15, 1)
    assert p2["limit"] == "trainers" and math.isclose(p2["eps"], 2 * 15 * 50_000)
    assert math.isclose(p4["eps"], 4 * 15 * 50_000) and math.isclose(p32["eps"], 32 * 15 * 50_000)  # no extrapolation
    half = project(m, 1, 100, 15, 1)
    assert math.isclose(half["eps"], 15 * 40_000)


def test_a_thin_network_binds_and_more_servers_do_not_help_it():
    # 15 trainers x 36k ex/s x 1000 B x 31/32 remote = 523 MB/s > 1 Gb/s
    p = project(_m(), 32, 1, 15, 1)
    assert p["limit"] == "network" and p["efficiency"] < 0.5
    assert project(_m(), 32, 1, 12, 4)["limit"] == "network"
    assert p["sync_gap"] == math.inf  # no bandwidth left for the dense sync


def test_slow_rows_bind_the_servers_and_more_servers_lift_them():
    slow = _m(server_row_s=2e-6)
    assert project(slow, 32, 100, 15, 1)["limit"] == "servers"
    assert project(slow, 32, 100, 12, 4)["efficiency"] > project(slow, 32, 100, 15, 1)["efficiency"]


def test_the_per_call_cost_grows_with_machines_and_more_servers_do_not_lift_it():
    m = _m(server_call_s=5e-4)  # every trainer batch calls every remote server
    e = [project(m, n, 100, 12, 4) for n in (2, 8, 32)]
    assert e[2]["limit"] == "servers" and e[0]["efficiency"] > e[1]["efficiency"] > e[2]["efficiency"]
    assert math.isclose(project(m, 32, 100, 8, 8)["eps"] / 32, 1 / (31 * 5e-4 / 256 + 20 * 31 / 32 * 5e-8 / 8))


def test_a_round_trip_longer_than_a_batch_slows_the_trainers():
    p = project(_m(rpc_s=0.05), 8, 100, 15, 1)  # a batch computes in 256 / 40k = 6 ms; 2 batches are prefetched
    assert p["limit"] == "trainers" and math.isclose(p["efficiency"], 15 * 2 * 256 / 0.05 / (16 * 40_000))
    assert project(_m(rpc_s=0.05, prefetch=16), 8, 100, 15, 1)["efficiency"] == 15 / 16


def test_the_sync_gap_grows_with_machines():
    gaps = [project(_m(), n, 10, 15, 1)["sync_gap"] for n in (2, 8, 32)]
    assert 0 < gaps[0] < gaps[1] < gaps[2]
    assert len(projection_table(_m())) == 4 * 3 * 8
