"""Dense synchronization algorithms (one module each) and the shadow-thread wrapper.

Foreground vs shadow is a mode of the caller, not a copy of each algorithm: foreground calls `sync()` every
k iterations inside the training loop, shadow runs it in a `ShadowThread`.
"""

from cocosync.shadowsync.sync.base import FlatParams, NoSync, SyncAlgorithm
from cocosync.shadowsync.sync.bmuf import BMUF
from cocosync.shadowsync.sync.dssync import DSSync
from cocosync.shadowsync.sync.easgd import EASGD
from cocosync.shadowsync.sync.factory import make_sync
from cocosync.shadowsync.sync.ma import ModelAveraging
from cocosync.shadowsync.sync.shadow import ShadowThread

__all__ = ["FlatParams", "SyncAlgorithm", "NoSync", "make_sync", "EASGD", "ModelAveraging", "BMUF", "DSSync",
           "ShadowThread"]
