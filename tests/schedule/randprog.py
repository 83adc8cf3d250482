"""Random well-typed data-parallel programs and random valid schedules, both from a seed (so spawned ranks rebuild
exactly the same case), plus the comparison of a scheduled program's outputs with the unscheduled one's."""

from __future__ import annotations

import random

import torch

import cocosync as cs
from cocosync import Local, Replicated
from cocosync.dsl.check import program_groups
from cocosync.dsl.types import part_of
from cocosync.schedule import Schedule, ScheduleError

P_MAX = 4


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def random_program(seed: int):
    """(program, global inputs): all_reduce of a Local gradient, then elementwise/norm computations mixing it with
    Replicated tensors, scalars and states, updates of some states, and a few plain outputs."""
    rng = random.Random(seed)
    shape = rng.choice([(8,), (16,), (8, 3), (6, 2)])  # (6, 2) on 4 ranks: no dim divides, 12 elements do
    g = cs.Tensor("g", shape, layout=Local)
    nstate = rng.randint(1, 3)
    states = [cs.Tensor(f"s{i}", shape, layout=Replicated) for i in range(nstate)]
    r = cs.Tensor("r", shape, layout=Replicated)
    a, b = cs.Scalar("a"), cs.Scalar("b")
    inputs = [g, *states, r, a, b]
    ar = cs.all_reduce(g, rng.choice(["sum", "mean", "max"]))
    pool = [ar, ar, *states, r]
    scal = [a, b]
    local = [g]
    for _ in range(rng.randint(3, 10)):
        x, y = rng.choice(pool), rng.choice(pool)
        k = rng.randrange(11)
        if k == 0:
            v = x + y
        elif k == 1:
            v = x - rng.choice(scal) * y
        elif k == 2:
            v = x * y
        elif k == 3:
            v = cs.maximum(x, y)
        elif k == 4:
            v = cs.where(x > y, x, y * 0.5)
        elif k == 5:
            v = cs.sqrt(cs.abs(x) + 1.0)
        elif k == 6:
            v = x / (cs.abs(y) + 1.0)
        elif k == 7:
            v = cs.dropout(x, 0.25, rng.randrange(100))
        elif k == 8:
            nrm = cs.norm(x)
            scal.append(nrm)
            v = y / (nrm + 1.0)
        elif k == 9:
            scal.append(cs.reduce_tensor(x, rng.choice(["sum", "max", "mean"])) * 0.1)
            continue
        else:
            v = x + rng.choice(local)  # a Local value: reorder must not move it
            local.append(v)
            continue
        pool.append(v)
    outs = []
    for s in states:
        if rng.random() < 0.8:
            u = cs.update(s, rng.choice(pool[-4:] + [ar]))
            outs.append(u)
            if rng.random() < 0.5:
                pool.append(u * 2.0)
    derived = [v for v in pool if v.op != "input"]
    outs += [rng.choice(derived) for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.5:
        outs.append(rng.choice(local))
    outs = list(dict.fromkeys(outs)) or [pool[-1]]
    program = cs.Program(f"rand{seed}", inputs, outs)
    if not any(x.op == "all_reduce" for x in program.stages):
        program = cs.Program(f"rand{seed}", inputs, [*outs, ar])
    vals = {"g": [_rand(shape, seed * 7 + i) for i in range(P_MAX)], "r": _rand(shape, seed + 1), "a": 0.5, "b": -1.25}
    vals |= {s.name: _rand(shape, seed + 2 + i) for i, s in enumerate(states)}
    return program, vals


def random_schedule(program, seed: int) -> Schedule:
    """A random valid schedule: split the all_reduce, reorder a random connected part of its readers, keep the states
    that allow it sliced, fuse and overlap groups that pass their checks, dce."""
    rng = random.Random(seed * 31 + 5)
    s = Schedule(program)
    ar = next(x.name for x in program.stages if x.op == "all_reduce")
    if rng.random() < 0.1:
        return s
    shape = program.stage(ar).shape
    flat = len(shape) > 1 and (shape[0] % P_MAX or rng.random() < 0.5)  # CoCoNeT's flat slicing
    rs, ag = s.split(ar, dim=cs.FLAT if flat else 0)
    p = s.program
    movable = s.movable(ag)
    chosen: set[str] = set()
    for name in movable:
        st = p.stage(name)
        if st.layout.is_local or st.dtype is torch.bool or any(a.layout.is_local for a in st.args):
            continue
        if any(a.name == ag or a.name in chosen for a in st.args) and rng.random() < 0.8:
            chosen.add(name)
    users = p.users()
    for name in reversed(movable):  # inputs-only tensors and comparisons whose readers all move
        st = p.stage(name)
        if name not in chosen and users[name] and all(u.name in chosen for u in users[name]) \
                and not any(o is st for o in p.outputs) and (st.dtype is torch.bool or rng.random() < 0.7):
            chosen.add(name)
    if chosen:
        s.reorder([n for n in movable if n in chosen], ag)
    for st in [x.name for x in program.inputs if x.name.startswith("s")]:
        if rng.random() < 0.7:
            try:
                s.as_slice([st])
            except ScheduleError:
                pass
    stages = [x.name for x in s.program.stages if not x.layout.is_local]
    options = [stages, [x.name for x in s.program.stages]]
    for x in s.program.stages:
        rd = [u.name for u in s.program.users()[x.name] if cs.dsl.registry.OPS[u.op].elementwise]
        if cs.dsl.registry.OPS[x.op].elementwise and rd:
            options.append([x.name, rng.choice(rd)])
    rng.shuffle(options)
    for group in options[:3]:
        try:
            s.fuse(group)
            break
        except ScheduleError:
            pass
    chain = [rs] if rs in {x.name for x in s.program.stages} else []
    while chain and len(chain) < 4:
        nxt = s.program.users()[chain[-1]]
        if len(nxt) != 1:
            break
        chain.append(nxt[0].name)
    if len(chain) >= 2 and rng.random() < 0.7:
        try:
            s.overlap(chain, chunks=rng.randint(1, 4))
        except ScheduleError:
            pass
    s.dce()
    return s


def expected_for(scheduled, expected: list[dict], P: int) -> list[dict]:
    """The unscheduled program's outputs as the scheduled program hands them back (a state kept sliced by as_slice
    returns this rank's slice)."""
    G = P // program_groups(scheduled)
    out_layout = {n: o.layout for n, o in zip(scheduled.output_names, scheduled.outputs)}
    res = []
    for r, outs in enumerate(expected):
        d = {}
        for k, v in outs.items():
            lay = out_layout[k]
            d[k] = v
            if lay.is_sliced and v.shape == _global_shape(scheduled, k):
                d[k] = part_of(v, lay, G, r % G)
        res.append(d)
    return res


def _global_shape(program, name):
    o = dict(zip(program.output_names, program.outputs))[name]
    return torch.Size(o.shape)


def inputs_for(program, vals: dict, P: int) -> dict:
    return {k: (v[:P] if isinstance(v, list) else v) for k, v in vals.items()}


def assert_outputs_close(got: list[dict], want: list[dict], what: str, tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for r, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), f"{what}: outputs {sorted(g)} != {sorted(w)}"
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=tol, atol=tol, msg=lambda m: f"{what}.{k} rank {r}: {m}")


# ---- standard workloads, rebuilt by name on every rank ---------------------------------------------------------
def standard_case(name: str):
    """(program, schedule, global inputs) of a standard workload."""
    from cocosync.programs.lamb import lamb_program
    from cocosync.programs.model_parallel import megatron_mlp_program, pipeline_program
    from cocosync.programs.optimizers import adam_program, adam_scalars, sgd_program
    from cocosync.schedule.standard import STANDARD

    n = 16
    g = [_rand(n, 100 + r) for r in range(P_MAX)]
    if name in ("adam", "lamb"):
        prog = adam_program(n) if name == "adam" else lamb_program(n)
        vals = {"g": g, "w": _rand(n, 1), "m": _rand(n, 2), "v": _rand(n, 3).abs(), **adam_scalars(2,
                                                                                                   weight_decay=0.01)}
    elif name == "sgd":
        prog = sgd_program(n, momentum=True)
        vals = {"g": g, "w": _rand(n, 1), "buf": _rand(n, 2), "lr": 0.1, "mu": 0.9}
    elif name.startswith("megatron"):
        prog = megatron_mlp_program(8, 8, 16)
        vals = {"x": _rand((8, 8), 1), "w1": _rand((8, 16), 2), "w2": _rand((16, 8), 3), "b": _rand(8, 4)}
        if name == "megatron_fused":  # ol_MM_fuse_RS_C_AG
            return prog, STANDARD["megatron"](prog, fuse=True), vals
    else:
        prog = pipeline_program(8, 8)
        vals = {"y": [_rand((8, 8), r) for r in range(P_MAX)], "b": _rand(8, 4)}
    return prog, STANDARD[name](prog), vals


def case(key):
    """key: ('rand', seed) or ('std', name) -> (program, schedule, global inputs)."""
    kind, x = key
    if kind == "rand":
        prog, vals = random_program(x)
        return prog, random_schedule(prog, x), vals
    return standard_case(x)


def run_plans_on_rank(keys: list) -> dict:
    """On a real rank: lower each case's scheduled program, run the plan with this rank's part of the inputs."""
    import torch.distributed as dist

    from cocosync import compile_plan, lower
    from cocosync.interp import rank_inputs

    P, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for key in keys:
        _, s, vals = case(key)
        local = rank_inputs(s.program, P, inputs_for(s.program, vals, P), rank)
        local = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in local.items()}
        out[key] = {k: v.clone() for k, v in compile_plan(lower(s.program))(**local).items()}
    return out


def adam_vs_torch_on_rank(n: int, steps: int) -> dict:
    """The scheduled Adam (RS -> sliced update -> AG, m and v kept as this rank's slices) for `steps` steps."""
    import torch.distributed as dist

    from cocosync import compile_plan, lower
    from cocosync.programs.optimizers import adam_program, adam_scalars
    from cocosync.schedule import adam_schedule

    P, rank = dist.get_world_size(), dist.get_rank()
    s = adam_schedule(adam_program(n))
    fn = compile_plan(lower(s))
    w = _rand(n, 7)
    m, v = torch.zeros(n // P), torch.zeros(n // P)
    for t in range(1, steps + 1):
        g = _rand(n, 1000 * t + rank)
        fn(g=g, w=w, m=m, v=v, **adam_scalars(t, lr=0.01, weight_decay=0.0))
    return {"w": w, "m": m, "v": v}
