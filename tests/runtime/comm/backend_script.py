"""Run under torchrun by test_backend.py: the cocosync backend's collectives, and DDP on it against DDP on gloo."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powerSGD
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import cocosync  # noqa: F401 - registers the backend

dist.init_process_group(sys.argv[1] if len(sys.argv) > 1 else "cocosync")
r, P = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "cocosync", dist.get_backend()
pg = dist.group.WORLD

t = torch.arange(10.) + r
dist.all_reduce(t)
assert torch.equal(t, torch.arange(10.) * P + sum(range(P))), t
assert pg._shm is not None, "the shared-memory communicator is not in use"
t = torch.full((4,), float(r), dtype=torch.bfloat16)
dist.all_reduce(t, op=dist.ReduceOp.AVG)
assert torch.allclose(t.float(), torch.full((4,), (P - 1) / 2)), t
t = torch.full((3,), float(r) + 2)
dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)  # not a shared-memory op: through gloo
assert torch.equal(t, torch.full((3,), 6.0)), t
t = torch.tensor([r], dtype=torch.int64)  # not a shared-memory dtype: through gloo
dist.all_reduce(t)
assert t.item() == sum(range(P))
t = torch.full((3,), float(r))
dist.broadcast(t, src=1)
assert torch.equal(t, torch.ones(3))
outs = [torch.empty(2) for _ in range(P)]
dist.all_gather(outs, torch.full((2,), float(r)))
assert [o[0].item() for o in outs] == [float(i) for i in range(P)]
o = torch.empty(2 * P)
dist.all_gather_into_tensor(o, torch.full((2,), float(r)))
assert torch.equal(o, torch.arange(P).repeat_interleave(2).float()), o
o = torch.empty(2)
dist.reduce_scatter_tensor(o, torch.arange(2.0 * P))
assert torch.equal(o, (torch.arange(2.0 * P) * P)[2 * r:2 * r + 2]), o
t = torch.full((4,), float(r) + 1)
dist.reduce(t, dst=0)
assert torch.equal(t, torch.full((4,), float(sum(range(1, P + 1))) if r == 0 else float(r) + 1)), t
ts = [torch.full((3,), float(r)), torch.full((2,), 2.0 * r)]
dist.all_reduce_coalesced(ts)
assert torch.equal(ts[0], torch.full((3,), float(sum(range(P))))) and torch.equal(ts[1], 2 * ts[0][:2]), ts
work = dist.all_reduce(torch.ones(5), async_op=True)
work.wait()
assert work.get_future().value() is not None
dist.barrier()

gloo = dist.new_group(backend="gloo")
sub = dist.new_group(ranks=list(range(P)), backend="cocosync")  # a group of ranks on this node: shared memory too
t = torch.full((6,), float(r) + 1)
dist.all_reduce(t, group=sub)
assert sub._shm is not None and torch.equal(t, torch.full((6,), float(sum(range(1, P + 1))))), t


def train(group, hook=None, **ddp_kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = DDP(model, process_group=group, **ddp_kw)
    if hook == "fp16":
        ddp.register_comm_hook(group or dist.group.WORLD, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        ddp.register_comm_hook(powerSGD.PowerSGDState(process_group=group or dist.group.WORLD,
                                                      matrix_approximation_rank=1, start_powerSGD_iter=2),
                               powerSGD.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + r)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        if step % 3 == 1:  # gradient accumulation without communication, then a synchronized step
            with ddp.no_sync():
                torch.nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


for kw in ({}, {"gradient_as_bucket_view": True}, {"static_graph": True}, {"hook": "fp16"}, {"hook": "powersgd"}):
    a, b = train(None, **kw), train(gloo, **kw)
    assert torch.allclose(a, b, rtol=0, atol=1e-6), (kw, (a - b).abs().max())

# torch.distributed.checkpoint (its object collectives go through this group's Python API)
ckpt = sys.argv[2] if len(sys.argv) > 2 else "/tmp/cocosync-dcp"
dcp.save({"w": torch.full((4,), 7.0)}, checkpoint_id=ckpt)
loaded = {"w": torch.zeros(4)}
dcp.load(loaded, checkpoint_id=ckpt)
assert torch.equal(loaded["w"], torch.full((4,), 7.0))

torch.manual_seed(0)
model = torch.nn.Linear(32, 8)
zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
for step in range(3):
    model.zero_grad()
    model(torch.randn(4, 32, generator=torch.Generator().manual_seed(step + 10 * r))).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    zero.step()
w = model.weight.detach().clone()
dist.all_reduce(w, op=dist.ReduceOp.MAX)
assert torch.equal(w, model.weight.detach()), "ranks' weights differ after ZeroRedundancyOptimizer"
dist.destroy_process_group()
print(f"backend ok on rank {r}")
