"""The README's torchrun snippet (DistributedAdam + MegatronMLP) runs as written on 2 processes."""

import re
import socket
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippet() -> str:
    text = README.read_text()
    section = text.split("## Workloads without writing DSL", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_torchrun_snippet_runs(tmp_path):
    code = _snippet()
    assert "torchrun --nproc-per-node 2" in code and "DistributedAdam" in code
    script = tmp_path / "train.py"
    script.write_text(code + "\nassert out.shape == (8, 64)\ndist.destroy_process_group()\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_readme_backend_snippet_runs(tmp_path):
    section = README.read_text().split("## As a torch.distributed backend", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'init_process_group("cocosync")' in code and "DistributedDataParallel" in code
    script = tmp_path / "ddp.py"
    script.write_text(code)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
