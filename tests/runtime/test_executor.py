"""The executor on real processes (gloo, 127.0.0.1) equals the interpreter, for every op and layout."""

import pytest
import torch

import cocosync as cs
from cocosync import DslError
from tests.dsl.cases import CASES, TOL, run_cases_on_rank


@pytest.mark.parametrize("P", [2, 4])
def test_executor_matches_interpreter(rank_pool, P):
    names = list(CASES)
    per_rank = rank_pool(P).run(run_cases_on_rank, names)
    for name in names:
        program, inputs = CASES[name](P)
        expected = cs.interpret(program, P, inputs)
        tol = TOL.get(name, 1e-5)
        for r in range(P):
            got = per_rank[r][name]
            assert set(got) == set(expected[r]), name
            for out, want in expected[r].items():
                torch.testing.assert_close(got[out], want, rtol=tol, atol=tol, msg=f"{name}.{out} rank {r}")


def _bad_inputs():
    from cocosync.programs.optimizers import sgd_program

    fn = cs.compile(sgd_program(8))
    errors = []
    for kwargs in ({"g": torch.zeros(8), "w": torch.zeros(8)},
                   {"g": torch.zeros(8), "w": torch.zeros(8), "lr": 0.1, "extra": 1},
                   {"g": torch.zeros(4), "w": torch.zeros(8), "lr": 0.1},
                   {"g": torch.zeros(8, dtype=torch.float64), "w": torch.zeros(8), "lr": 0.1},
                   {"g": [1.0] * 8, "w": torch.zeros(8), "lr": 0.1}):
        try:
            fn(**kwargs)
            errors.append(None)
        except DslError as e:
            errors.append(str(e))
    return errors


def test_executor_input_errors_are_clear(rank_pool):
    errors = rank_pool(2).run(_bad_inputs)[0]
    assert "missing inputs ['lr']" in errors[0]
    assert "unknown inputs ['extra']" in errors[1]
    assert "'g'" in errors[2] and "(8,)" in errors[2] and "(4,)" in errors[2]
    assert "float64" in errors[3]
    assert "'g' must be a tensor" in errors[4]


def _groups_with_backends(group_ranks):
    """The 'groups' case (2 stages) with its backend, and the backend of a program over an explicit group."""
    import torch.distributed as dist

    from cocosync.interp import rank_inputs

    out = run_cases_on_rank(["groups"])
    program, inputs = CASES["groups"](dist.get_world_size())
    backends = {"stages": cs.compile(program).comm.backend}
    torch_fn = cs.compile(program, backend="torch")  # the gloo path for subgroups, pruned the same way
    backends["forced"] = torch_fn.comm.backend
    out["groups_torch"] = torch_fn(**rank_inputs(program, dist.get_world_size(), inputs, dist.get_rank()))
    sub = dist.new_group(group_ranks)  # collective over the world; only members compile over it
    if dist.get_rank() in group_ranks:
        from cocosync.programs.optimizers import sgd_program

        fn = cs.compile(sgd_program(8), sub)
        g = torch.full((8,), float(dist.get_rank()))
        backends["explicit"] = fn.comm.backend
        out["explicit"] = fn(g=g, w=torch.zeros(8), lr=1.0)
    return out, backends


@pytest.mark.parametrize("nnodes", [1, 2])
def test_subgroups_on_one_node_use_shared_memory(rank_pool, nnodes):
    # 4 ranks; with 2 nodes each stage (2 consecutive ranks) is one node, and the group {0, 2} spans both
    got = rank_pool(4, nnodes=nnodes).run(_groups_with_backends, [0, 2])
    program, inputs = CASES["groups"](4)
    expected = cs.interpret(program, 4, inputs)
    for r, (out, backends) in enumerate(got):
        assert backends["stages"] == "shm" and backends["forced"] == "torch", (r, backends)
        for name, want in expected[r].items():
            for key in ("groups", "groups_torch"):
                torch.testing.assert_close(out[key][name], want, rtol=1e-5, atol=1e-5, msg=f"{key}.{name} rank {r}")
        if r in (0, 2):
            assert backends["explicit"] == ("shm" if nnodes == 1 else "torch"), (r, nnodes, backends)
            # sgd on the group's mean gradient (0 + 2) / 2 with lr 1
            (w_new,) = out["explicit"].values()
            torch.testing.assert_close(w_new, torch.full((8,), -1.0))


def _subgroup_without_torchrun_env():
    import os

    import torch.distributed as dist

    from cocosync.runtime.comm.topology import subgroup_node_groups

    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")}
    try:  # init_process_group without torchrun's variables: nodes unknown -> torch.distributed
        return subgroup_node_groups([0, 1], dist.group.WORLD)
    finally:
        os.environ.update(saved)


def test_subgroups_without_torchrun_environment_use_torch(rank_pool):
    assert rank_pool(2).run(_subgroup_without_torchrun_env) == [None, None]
