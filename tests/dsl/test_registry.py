"""Every op is defined once (dsl.registry) and has every rule it needs: an interpreter rule, an executor rule, a
printer form, a kernel line where generated kernels compute it, a wire code where a collective implements it."""

from __future__ import annotations

import pytest
import torch

from cocosync import interp
from cocosync.dsl.ir import Node
from cocosync.dsl.printer import expr_str
from cocosync.dsl.registry import OPS, OpKind, names
from cocosync.dsl.types import Replicated
from cocosync.runtime.comm.headers import COLLECTIVES
from cocosync.runtime.reference import stage
from cocosync.runtime.steps import codegen

COMPUTED = [op for op, d in OPS.items() if d.kind is not OpKind.LEAF]


def _node(op: str) -> Node:
    x = Node("input", (), (("kind", "tensor"),), (4,), torch.float32, Replicated, "x")
    y = Node("input", (), (("kind", "tensor"),), (4,), torch.float32, Replicated, "y")
    return Node(op, (x, y), (), (4,), torch.float32, Replicated, f"{op}1")


@pytest.mark.parametrize("op", COMPUTED)
def test_every_op_has_its_rules(op):
    assert op in interp.RULES, f"interpreter: no rule for {op}"
    assert op in stage.RULES, f"executor (runtime.reference.stage): no rule for {op}"
    d = OPS[op]
    printed = expr_str(_node(op))
    assert (d.symbol and f" {d.symbol} " in printed) or printed.startswith(f"{op}("), printed
    if d.collective is not None:
        assert d.collective in COLLECTIVES, f"{op}: collective {d.collective!r} has no wire code"
    if d.communicates or d.kind is OpKind.SLICE:
        assert op in stage.COMM_RULES


@pytest.mark.parametrize("op", names(lambda d: d.in_kernels))
def test_kernel_ops_have_a_source_line(op):
    node = _node(op)
    if op == "cast":
        node = Node("cast", node.args[:1], (("to", torch.bfloat16),), (4,), torch.bfloat16, Replicated, "c")
    line = codegen.line_of(node, {id(a): a.name for a in node.args})
    assert any(a.name in line for a in node.args), line


def test_no_rule_table_has_an_op_the_registry_lacks():
    for table in (interp.RULES, stage.RULES, stage.COMM_RULES):
        assert set(table) <= set(OPS), set(table) - set(OPS)


def test_a_missing_rule_fails(monkeypatch):
    """The check above catches an op added to the registry and forgotten elsewhere."""
    from cocosync.dsl.registry import OpDef

    monkeypatch.setitem(OPS, "frobnicate", OpDef(name="frobnicate", kind=OpKind.ELEMENTWISE))
    with pytest.raises(AssertionError, match="no rule for frobnicate"):
        test_every_op_has_its_rules("frobnicate")


def test_derived_sets_match_the_passes():
    from cocosync.schedule.fuse import FUSABLE
    from cocosync.schedule.overlap import UNCHUNKABLE
    from cocosync.schedule.reorder import MOVABLE

    assert set(FUSABLE) == {"update", "norm", "segment_norm", "reduce_tensor", "scatter"}
    assert set(MOVABLE) == {"update", "norm", "segment_norm", "reduce_tensor", "send"}
    assert set(UNCHUNKABLE) == {"norm", "segment_norm", "reduce_tensor"}
    assert not OPS["scatter"].communicates and OPS["all_reduce"].communicates
