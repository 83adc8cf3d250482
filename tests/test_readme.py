"""The snippets of the README and the manual (docs/) run as written on 2 processes."""

import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


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


def test_readme_config_file_is_every_default(tmp_path):
    """The manual's TOML example loads, and holds every TrainConfig field at its default."""
    from cocosync.shadowsync.config import TrainConfig, config_to_dict, load_train_config

    section = (DOCS / "shadowsync.md").read_text()
    path = tmp_path / "run.toml"
    path.write_text(re.search(r"```toml\n(.*?)```", section, re.S).group(1))
    loaded = config_to_dict(load_train_config(path))
    default = config_to_dict(TrainConfig())
    assert {k: v for k, v in loaded.items() if k not in ("model", "data_options")} == {
        k: v for k, v in default.items() if k not in ("model", "data_options")}
    assert loaded["model"]["bottom_mlp"] == [64, 16] and loaded["data_options"]["table_size"] == 10000


def test_readme_schedule_snippet_runs(tmp_path):
    section = (DOCS / "dsl.md").read_text().split("## Schedules: the algorithm once", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "torchrun --nproc-per-node 2" in code and "compile_scheduled" in code
    script = tmp_path / "adam_schedule.py"
    end = "dist.destroy_process_group()"
    script.write_text(code.replace(end, f"assert w.abs().sum() > 0  # every rank moved w\n{end}"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "FusedAllReduce" in res.stdout or "fused" in res.stdout.lower(), res.stdout[-2000:]
