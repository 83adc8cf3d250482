"""cocosync: communication off the critical path of distributed PyTorch training.

The DSL (CoCoNeT): declare tensors with layouts, mix computation and communication in one Program,
run it under the reference interpreter (`interpret`) or on real ranks (`compile`); rewrite it with a
`Schedule` and run the lowered plan (`compile_scheduled`). Importing cocosync registers the "cocosync"
torch.distributed backend (runtime.comm.backend).
"""

from cocosync.dsl import *  # noqa: F403 - the language is the public API
from cocosync.dsl import __all__ as _dsl_all
from cocosync.interp import interpret
from cocosync.lower import lower
from cocosync.runtime.comm.backend import register as _register_backend
from cocosync.runtime.executor import (
           compile,  # noqa: A004 - mirrors the paper's vocabulary
           compile_plan,
           compile_scheduled,
)
from cocosync.schedule import Schedule, ScheduleError
from cocosync.tune.tuner import autotune

_register_backend()  # dist.init_process_group("cocosync")

__version__ = "0.1.0"
__all__ = [*_dsl_all, "interpret", "compile", "Schedule", "ScheduleError", "lower", "compile_plan",
           "compile_scheduled", "autotune", "__version__"]
