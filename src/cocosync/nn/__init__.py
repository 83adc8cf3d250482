"""Model-parallel layers users adopt without writing DSL: each forward is a compiled DSL plan with the paper's
schedule, each backward a torch.autograd.Function (Megatron's rules): MegatronMLP's backward is a second DSL plan
(dX's all_reduce split and overlapped like the forward's); the linear layers and PipelineSend use torch ops and the
plan's communicator.

- ColumnParallelLinear / RowParallelLinear: tensor-parallel linear layers (nn.parallel).
- MegatronMLP: the Megatron MLP block, matmul -> all_reduce -> bias + dropout + residual overlapped (nn.mlp).
- PipelineSend: a pipeline stage boundary that sends only each rank's slice and all-gathers on the next stage
  (nn.pipeline).
"""

from cocosync.nn.mlp import MegatronMLP, mlp_backward_program, mlp_program
from cocosync.nn.parallel import ColumnParallelLinear, RowParallelLinear
from cocosync.nn.pipeline import PipelineSend, pipeline_send_program

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "MegatronMLP", "PipelineSend", "mlp_program",
           "mlp_backward_program", "pipeline_send_program"]
