"""Lowering: Program -> Plan of ordered steps (kernels, collectives, fused collectives, overlap groups), as plain
data; runtime.executor runs a plan (`cocosync.compile_plan`)."""

from cocosync.lower.lower import lower
from cocosync.lower.plan import Collective, FusedCollective, Kernel, Overlap, Plan, Step

__all__ = ["lower", "Plan", "Step", "Kernel", "Collective", "FusedCollective", "Overlap"]
