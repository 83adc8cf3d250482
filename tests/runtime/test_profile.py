"""CompiledPlan.profile(): per-step times of real calls on 2 ranks, with and without the barriers between steps."""

import pytest
import torch

from cocosync.runtime.profile import WAIT


def _profiled():
    import torch.distributed as dist

    from cocosync import compile_plan, lower
    from cocosync.programs.model_parallel import megatron_mlp_program
    from cocosync.schedule.standard import megatron_schedule

    r = dist.get_rank()
    plan = compile_plan(lower(megatron_schedule(megatron_mlp_program(8, 16, 32), chunks=1)), backend="shm")
    g = torch.Generator().manual_seed(r)
    inputs = {"x": torch.randn(8, 16), "w1": torch.randn(16, 16, generator=g), "w2": torch.randn(16, 16, generator=g),
              "b": torch.randn(16)}
    want = plan(**inputs)["out"]
    out = {}
    for sync in (False, True):
        with plan.profile(sync=sync) as prof:
            got = [plan(**inputs)["out"] for _ in range(3)]
            try:
                with plan.profile():
                    pass
                out["nested"] = None
            except RuntimeError as e:
                out["nested"] = str(e)
        plan(**inputs)  # after the block: not recorded
        out[sync] = {"rows": prof.rows(), "same": all(torch.equal(x, want) for x in got)}
    out["steps"] = [str(s) for s in plan.plan.steps]
    out["fast"] = plan.fast_steps
    return out


def test_profile_times_every_step_of_real_calls(rank_pool):
    for res in rank_pool(2).run(_profiled):
        assert "profile() is already active" in res["nested"]
        for sync in (False, True):
            rows = res[sync]["rows"]
            assert res[sync]["same"]  # profiling does not change results
            assert [r["step"] for r in rows] == res["steps"] + ([WAIT] if sync else [])
            assert all(r["calls"] == 3 and r["median_ms"] > 0 for r in rows[:len(res["steps"])])
            assert [r["fast"] for r in rows[:len(res["steps"])]] == [s in res["fast"] for s in res["steps"]]
            assert sum(r["share"] for r in rows) == pytest.approx(1.0)
        assert any("all_reduce1_rs" in s for s in res["steps"])  # the collectives are among the timed steps
