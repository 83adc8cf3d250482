"""The user-facing example script runs under torchrun on 2 processes and reports each of its 10 steps."""

import re
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dp_train_example_runs_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "cocosync.examples.dp_train"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", res.stdout)]
    assert len(losses) == 10, res.stdout
    norms = [float(x) for x in re.findall(r"grad norm ([0-9.]+)", res.stdout)]
    assert all(n > 0 for n in norms), res.stdout
