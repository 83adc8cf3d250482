"""A job's fixed cost: what the launcher and a rank import before their first example (BENCHMARKS.md, "A job's fixed
cost"). torch.distributed.checkpoint (~1.5 s of CPU a process) waits for the first save or read, and scoring needs no
sklearn (~2.4 s). That checkpoints still save and load is every resume test's business."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch.distributed.checkpoint", "sklearn")


def test_the_launcher_and_a_rank_import_no_checkpoint_library_or_sklearn_at_start():
    code = ("import sys\n"
            "import cocosync.shadowsync.cli.train, cocosync.shadowsync.job.launch, cocosync.shadowsync.job.rank\n"
            "import cocosync.shadowsync.__main__, cocosync.shadowsync.metrics\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"imported at start: {out.stdout.strip()}"

