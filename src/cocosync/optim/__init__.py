"""Data-parallel optimizers built on the DSL: torch.optim.Optimizer subclasses that average gradients over ranks
(as DDP does) and update the parameters with the fused RS -> sliced update -> AG schedule (state sliced, ZeRO-1).

    opt = DistributedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)   # after init_process_group
    loss.backward(); opt.step(); opt.zero_grad()
"""

from cocosync.optim.adam import DistributedAdam, DistributedAdamW
from cocosync.optim.base import DistributedOptimizer
from cocosync.optim.flat import FlatParams
from cocosync.optim.lamb import DistributedLAMB
from cocosync.optim.sgd import DistributedSGD

__all__ = ["DistributedAdam", "DistributedAdamW", "DistributedLAMB", "DistributedSGD", "DistributedOptimizer",
           "FlatParams"]
