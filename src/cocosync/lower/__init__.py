"""Lowering: Program -> Plan of ordered steps (kernels, collectives, fused collectives, overlap groups)."""

from cocosync.lower.lower import lower
from cocosync.lower.plan import Collective, FusedCollective, Kernel, Overlap, Plan, Step
from cocosync.lower.run_plan import CompiledPlan, compile_plan, compile_scheduled

__all__ = ["lower", "Plan", "Step", "Kernel", "Collective", "FusedCollective", "Overlap", "compile_plan",
           "compile_scheduled", "CompiledPlan"]
