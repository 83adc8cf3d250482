"""Dense synchronization algorithms (one module each) and the shadow-thread wrapper.

Foreground vs shadow is a mode of the caller, not a copy of each algorithm: foreground calls `sync()` every
k iterations inside the training loop, shadow runs it in a `ShadowThread`.
"""

from .base import FlatParams, NoSync, SyncAlgorithm, make_sync
from .bmuf import BMUF
from .easgd import EASGD
from .ma import ModelAveraging
from .shadow import ShadowThread

__all__ = ["FlatParams", "SyncAlgorithm", "NoSync", "make_sync", "EASGD", "ModelAveraging", "BMUF", "ShadowThread"]
