"""Run under torchrun by test_backend.py: a rank that stays away past the group's timeout is named by the others."""

import datetime
import sys
import time

import torch
import torch.distributed as dist

import cocosync  # noqa: F401 - registers the backend
from cocosync.runtime.comm.shm import CollectiveTimeout

dist.init_process_group("cocosync", timeout=datetime.timedelta(seconds=3))
r = dist.get_rank()
dist.all_reduce(torch.ones(4))  # both ranks: the shared-memory communicator exists
if r == 1:
    time.sleep(8)  # silent past the timeout
    sys.exit(0)
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(4))
except CollectiveTimeout as e:
    print(f"named after {time.monotonic() - t0:.1f}s: {e}")
    sys.exit(0)
print("no timeout")
sys.exit(1)
