"""Runtime, in two layers.

- `runtime.comm`: transport, which knows nothing of the DSL: topology and process groups, the shared-memory arena,
  the call headers, chunk reductions, the collectives (`ShmCommunicator`) and the fused collectives built on them.
- plan execution, in layers: `reference/` (stage: what one stage means on this rank, the reference every fast form
  is tested against; prune), `steps/` on it (one module per fast step kind: kernel, matmul, fused collective with
  its analysis, overlap), then `executor` (`compile`, `compile_plan`) and `profile` on both.
"""

from cocosync.runtime.executor import CompiledPlan, CompiledProgram, compile, compile_plan, compile_scheduled

__all__ = ["compile", "compile_plan", "compile_scheduled", "CompiledProgram", "CompiledPlan"]
