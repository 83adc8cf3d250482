"""Data-parallel training without DDP: `torchrun --nproc-per-node 2 -m cocosync.examples.dp_train`.

DistributedAdamW averages the gradients and updates the weights in one fused shared-memory collective per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cocosync.optim import DistributedAdamW


def main(steps: int = 10) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = DistributedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(dist.get_rank())  # this rank's batches
    for step in range(steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 1, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}, grad norm {float(opt.last_grad_norm):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
