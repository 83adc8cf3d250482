"""DistributedAdam / LAMB / SGD on 2 real ranks equal single-process torch.optim on the concatenated batch (50 steps);
mixed precision within bf16 tolerance; clipping as clip_grad_norm_; state_dict moves between world sizes."""

import pytest
import torch

from cocosync.optim import DistributedAdam, DistributedAdamW, DistributedLAMB, DistributedSGD
from cocosync.programs.lamb import lamb_reference

STEPS, BATCH = 50, 16
HP = {"adam": dict(lr=1e-2, weight_decay=0.1), "sgd": dict(lr=5e-2, momentum=0.9, weight_decay=0.01),
      "lamb": dict(lr=1e-2, weight_decay=0.01)}
CLIP = 0.05  # small enough to clip on every step


class Net(torch.nn.Module):
    """Parameters of several shapes, 69 elements in all (odd: the flat buffer is padded)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)
        self.s = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))) * self.s


def _batch(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 5, generator=g).to(dtype), torch.randn(BATCH, 3, generator=g).to(dtype)


def _loss(net, step, rows, dtype=torch.float32):
    x, y = _batch(step, dtype)
    return torch.nn.functional.mse_loss(net(x[rows]), y[rows])


def _make(kind, params, **kw):
    cls = {"adam": DistributedAdamW, "sgd": DistributedSGD, "lamb": DistributedLAMB}[kind]
    return cls(params, **HP[kind], **kw)


def _train(net, opt, steps, rank, P, dtype=torch.float32):
    n = BATCH // P
    for step in steps:
        opt.zero_grad()
        _loss(net, step, slice(rank * n, (rank + 1) * n), dtype).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


CASES = [("adam", {}), ("sgd", {}), ("lamb", {}), ("adam", {"max_grad_norm": CLIP}), ("sgd", {"max_grad_norm": CLIP}),
         ("adam", {"master_dtype": torch.float32, "dtype": torch.bfloat16}),
         ("sgd", {"master_dtype": torch.float32, "dtype": torch.bfloat16}), ("lamb", {"max_grad_norm": CLIP}),
         ("lamb", {"master_dtype": torch.float32, "dtype": torch.bfloat16}), ("lamb", {"per_tensor": False})]


def _on_rank(state_from_p1=None):
    import torch.distributed as dist

    rank, P = dist.get_rank(), dist.get_world_size()
    out = {}
    for i, (kind, kw) in enumerate(CASES):
        kw = dict(kw)
        dtype = kw.pop("dtype", torch.float32)
        net = Net().to(dtype)
        opt = _make(kind, net.parameters(), **kw)
        out[i] = (_train(net, opt, range(1, STEPS + 1), rank, P, dtype), opt.compiled.fast_steps,
                  opt.last_grad_norm)
    # state_dict after 25 steps (for the P=1 continuation), and continuing a P=1 state on 2 ranks
    net = Net()
    opt = _make("adam", net.parameters())
    _train(net, opt, range(1, STEPS // 2 + 1), rank, P)
    out["saved"] = (net.state_dict(), opt.state_dict())
    if state_from_p1 is not None:
        net = Net()
        net.load_state_dict(state_from_p1[0])
        opt = _make("adam", net.parameters())
        opt.load_state_dict(state_from_p1[1])
        out["continued"] = _train(net, opt, range(STEPS // 2 + 1, STEPS + 1), rank, P)
    return out


def _reference(kind, kw, norms=None):
    """Single process on the whole batch: torch.optim (LAMB: lamb_reference, per tensor or on the flat vector)."""
    kw = dict(kw)
    dtype, master = kw.pop("dtype", torch.float32), kw.pop("master_dtype", None)
    clip = kw.pop("max_grad_norm", None)
    per_tensor = kw.pop("per_tensor", True)
    net = Net().to(dtype)
    params = list(net.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params] if master else params
    hp = HP[kind]
    if kind == "adam":
        opt = torch.optim.AdamW(masters, **hp)
    elif kind == "sgd":
        opt = torch.optim.SGD(masters, **hp)
    else:
        flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
        m = v = torch.zeros(sum(p.numel() for p in params))
    for step in range(1, STEPS + 1):
        net.zero_grad()
        _loss(net, step, slice(None), dtype).backward()
        if master:
            for p, q in zip(params, masters):
                q.grad = p.grad.float()
        if clip:
            total = torch.nn.utils.clip_grad_norm_(masters, clip)
            if norms is not None:
                norms.append(total)
        with torch.no_grad():
            if kind == "lamb":
                sizes = tuple(p.numel() for p in params) if per_tensor else None
                w, m, v = lamb_reference(flat(masters), m, v, flat(q.grad for q in masters), step,
                                         lr=hp["lr"], wd=hp["weight_decay"], sizes=sizes)
                for p, q, new in zip(params, masters, w.split([p.numel() for p in params])):
                    q.copy_(new.view(p.shape))
                    p.copy_(q)
            else:
                opt.step()
                if master:
                    for p, q in zip(params, masters):
                        p.copy_(q)
    return [p.detach().clone() for p in params]


def test_two_ranks_match_torch_optim(rank_pool):
    # a P=1 (no torch.distributed) run of 25 steps, continued on 2 ranks
    net = Net()
    opt = _make("adam", net.parameters())
    assert opt.compiled is None
    _train(net, opt, range(1, STEPS // 2 + 1), 0, 1)
    got = rank_pool(2).run(_on_rank, (net.state_dict(), opt.state_dict()))
    for i, (kind, kw) in enumerate(CASES):
        low = kw.get("dtype") == torch.bfloat16
        tol = dict(rtol=2e-2, atol=2e-2) if low else dict(rtol=1e-4, atol=1e-5)
        norms: list[torch.Tensor] = []
        ref = _reference(kind, kw, norms)
        for r in range(2):
            params, fast, last_norm = got[r][i]
            for p, q in zip(params, ref):
                torch.testing.assert_close(p, q, **tol, msg=lambda m: f"case {i} {kind} {kw} rank {r}: {m}")
            if "max_grad_norm" in kw:  # the norm before clipping, as clip_grad_norm_ returns it, on every rank
                torch.testing.assert_close(last_norm, norms[-1], rtol=1e-4, atol=1e-6)
                assert torch.equal(last_norm, got[0][i][2])
            else:
                assert last_norm is None
        # the update is one fused collective (with clipping or LAMB's norms: in phases around the norms)
        assert any(f.startswith("fused_collective") for f in got[0][i][1]), (i, got[0][i][1])
    ref = _reference("adam", {})
    for r in range(2):
        for p, q in zip(got[r]["continued"], ref):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    # the 2-rank state after 25 steps continues identically on 1 process
    net_sd, opt_sd = got[0]["saved"]
    other = got[1]["saved"][1]["state"]
    assert all(torch.equal(a, other[i][k]) for i in opt_sd["state"] for k, a in opt_sd["state"][i].items())
    net = Net()
    net.load_state_dict(net_sd)
    opt = _make("adam", net.parameters())
    opt.load_state_dict(opt_sd)
    for p, q in zip(_train(net, opt, range(STEPS // 2 + 1, STEPS + 1), 0, 1), ref):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_bad_inputs():
    net = Net()
    opt = DistributedAdam(net.parameters())
    with pytest.raises(ValueError, match="more than one parameter group"):  # torch's own check
        opt.add_param_group({"params": [net.s]})
    clipped = DistributedAdam([torch.nn.Parameter(torch.ones(3))], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="add_param_group: max_grad_norm"):
        clipped.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    with pytest.raises(TypeError, match="one dtype"):
        DistributedSGD([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, dtype=torch.float64))])
    with pytest.raises(ValueError, match="max_grad_norm"):
        DistributedAdam(Net().parameters(), max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="master_dtype"):
        DistributedAdam(Net().parameters(), master_dtype=torch.float16)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.5"):  # torch.optim.Adam's message
        DistributedAdam(Net().parameters(), betas=(0.9, 1.5))
    sgd = DistributedSGD(Net().parameters(), lr=0.1)
    sgd.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match="fixed"):
        sgd.step()
    net(torch.randn(2, 5)).sum().backward()
    opt.step()  # state exists after a parameter's first step, as in torch.optim
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"\[2 group\(s\)\]"):  # a one-group state into a two-group optimizer
        DistributedAdam(_groups(Net(), "adam")).load_state_dict(opt.state_dict())


def test_flat_views_and_single_process():
    """Gradients land in the flat buffer without copies; a replaced .grad / zero_grad(set_to_none) still works;
    single-process clipping (the one-program form under the interpreter) equals clip_grad_norm_ + AdamW."""
    net, ref = Net(), Net()
    opt = DistributedAdam(net.parameters(), lr=1e-2, max_grad_norm=CLIP)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(1, 6):
        opt.zero_grad()
        if step == 3:
            net.zero_grad(set_to_none=True)  # backward then allocates fresh grads: copied in once
        _loss(net, step, slice(None)).backward()
        if step != 3:
            assert all(p.grad.data_ptr() == opt.flat.view(opt.flat.grad, i).data_ptr()
                       for i, p in enumerate(net.parameters()))
        opt.step()
        ropt.zero_grad()
        _loss(ref, step, slice(None)).backward()
        total = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        torch.testing.assert_close(opt.last_grad_norm, total, rtol=1e-4, atol=1e-6)  # the interpreter's form too
        ropt.step()
    assert all(p.data_ptr() == opt.flat.view(opt.flat.flat, i).data_ptr() for i, p in enumerate(net.parameters()))
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def _first_half(kind):
    import torch.distributed as dist

    net = Net()
    opt = _make(kind, net.parameters())
    _train(net, opt, range(1, STEPS // 2 + 1), dist.get_rank(), dist.get_world_size())
    return net.state_dict(), opt.state_dict()


def _second_half(kind, saved):
    import torch.distributed as dist

    net = Net()
    net.load_state_dict(saved[0])
    opt = _make(kind, net.parameters())
    opt.load_state_dict(saved[1])
    return _train(net, opt, range(STEPS // 2 + 1, STEPS + 1), dist.get_rank(), dist.get_world_size())


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_state_dict_moves_from_two_ranks_to_four(rank_pool, kind):
    """Saved on 2 ranks (sliced state gathered in full), loaded on 4 (re-sliced): the run continues as one."""
    saved = rank_pool(2).run(_first_half, kind)[0]
    ref = _reference(kind, {})
    for r, params in enumerate(rank_pool(4).run(_second_half, kind, saved)):
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{kind} rank {r}: {m}")


def _groups(net, kind):
    """Two parameter groups as transformer recipes make them: weight decay on the matrices, none on biases and
    `s`; the second group also gets its own learning rate."""
    decay = [net.l1.weight, net.l2.weight]
    rest = [net.l1.bias, net.l2.bias, net.s]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": HP[kind]["lr"] / 2}]


def _grouped_on_rank(kind, saved=None):
    import torch.distributed as dist

    rank, P = dist.get_rank(), dist.get_world_size()
    net = Net()
    opt = _make(kind, _groups(net, kind))
    if saved is None:
        params = _train(net, opt, range(1, STEPS // 2 + 1), rank, P)
        return params, opt.state_dict(), net.state_dict(), [u.compiled.fast_steps for u in opt._updates]
    net.load_state_dict(saved[1])
    opt.load_state_dict(saved[0])
    return _train(net, opt, range(STEPS // 2 + 1, STEPS + 1), rank, P)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_parameter_groups_match_torch_optim(rank_pool, kind):
    """Two groups (their own lr and weight decay; for SGD weight decay 0 selects another program): 25 steps on 2
    ranks, saved, continued on 4: the same parameters as torch.optim with the same groups on the whole batch."""
    first = rank_pool(2).run(_grouped_on_rank, kind)
    params, sd, net_sd, fast = first[0]
    assert len(fast) == 2 and all(any(f.startswith("fused_collective") for f in fs) for fs in fast), fast
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3, 4]]
    assert sd["param_groups"][1]["weight_decay"] == 0.0 and sd["param_groups"][0]["weight_decay"] > 0
    ref_net = Net()
    cls = torch.optim.AdamW if kind == "adam" else torch.optim.SGD
    ref = cls(_groups(ref_net, kind), **HP[kind])
    snapshot = None
    for step in range(1, STEPS + 1):
        ref.zero_grad()
        _loss(ref_net, step, slice(None)).backward()
        ref.step()
        if step == STEPS // 2:
            snapshot = [p.detach().clone() for p in ref_net.parameters()]
    for p, q in zip(params, snapshot):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    for r, got in enumerate(rank_pool(4).run(_grouped_on_rank, kind, (sd, net_sd))):
        for p, q in zip(got, ref_net.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{kind} rank {r}: {m}")


def test_frozen_parameters_are_left_alone():
    """requires_grad=False parameters passed to the optimizer are skipped, as torch.optim does (a zero gradient
    would still apply weight decay to them); they have no state; freezing later is refused with a message."""
    net, ref = Net(), Net()
    for m in (net, ref):
        m.l1.requires_grad_(False)
    frozen = [p.detach().clone() for p in net.l1.parameters()]
    opt = DistributedAdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(1, 6):
        for o, m in ((opt, net), (ropt, ref)):
            o.zero_grad()
            _loss(m, step, slice(None)).backward()
            o.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(p, q) for p, q in zip(net.l1.parameters(), frozen))
    sd = opt.state_dict()
    live = [i for i, p in enumerate(net.parameters()) if p.requires_grad]  # s, l2.weight, l2.bias
    assert sorted(sd["state"]) == live == [0, 3, 4] and sd["param_groups"][0]["params"] == [0, 1, 2, 3, 4]
    other = Net()
    other.l1.requires_grad_(False)
    again = DistributedAdamW(other.parameters(), lr=1e-2, weight_decay=0.1)
    again.load_state_dict(sd)
    assert torch.equal(again.state_dict()["state"][4]["exp_avg"], sd["state"][4]["exp_avg"])
    net.l1.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"requires_grad of parameter\(s\) \[1\] of group 0 changed"):
        opt.step()
    with pytest.raises(ValueError, match="parameter group 1 has no parameter that requires grad"):
        DistributedAdam([{"params": [net.s]}, {"params": [net.l1.bias]}])


def _dtensor_refused() -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    p = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
    try:
        DistributedAdam([p])
    except TypeError as e:
        return str(e)
    return "accepted"


def test_dtensor_parameters_are_refused_saying_what_works(rank_pool):
    for msg in rank_pool(2).run(_dtensor_refused):
        assert "is a DTensor" in msg and "torch.optim.Adam" in msg and "init_process_group('cocosync')" in msg
