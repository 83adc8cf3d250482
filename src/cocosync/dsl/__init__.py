"""The cocosync DSL: declarations, ops (computation and communication) and the Program IR."""

from cocosync.dsl.ir import Group, Node, Program
from cocosync.dsl.ops import *  # noqa: F403 - the op constructors are the language
from cocosync.dsl.ops import PUBLIC as _OPS
from cocosync.dsl.types import (
                                FLAT,
                                DslError,
                                Layout,
                                LayoutKind,
                                Local,
                                ReduceOp,
                                Replicated,
                                Sliced,
                                bfloat16,
                                float16,
                                float32,
)

__all__ = ["Node", "Program", "Group", "DslError", "Layout", "LayoutKind", "Local", "Replicated", "Sliced", "FLAT",
           "ReduceOp", "float32", "float16", "bfloat16", *_OPS]
