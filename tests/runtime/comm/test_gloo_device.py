"""The `gloo-shared` backend: every group a process makes runs on its one gloo device (one I/O thread instead of one
per group), and collectives issued from several threads on several groups at once give gloo's results."""

import os
import threading

import pytest
import torch
import torch.distributed as dist

from cocosync.runtime.comm import gloo_device
from cocosync.shadowsync.thread_cpu import native_thread_cpu
from cocosync.testing.launch import RankPool

GROUPS = 4


def _io_threads() -> int:
    return sum(name == "gloo_tcp_loop" for name, _ in native_thread_cpu().values())


def _groups_in_threads(mode: str) -> dict:
    """Make GROUPS groups over both ranks, then run different collectives on all of them at once, one thread each,
    every result checked against what gloo must give; the I/O threads the groups added."""
    os.environ["COCOSYNC_GLOO_DEVICE"] = mode
    rank, n = dist.get_rank(), dist.get_world_size()
    before = _io_threads()
    groups = [dist.new_group(list(range(n)), backend=gloo_device.BACKEND) for _ in range(GROUPS)]
    added = _io_threads() - before
    errors: list[str] = []

    def work(i: int, g) -> None:
        try:
            for step in range(30):
                x = torch.full((1000 * (i + 1),), float(rank + step + i))
                dist.all_reduce(x, group=g)
                assert torch.equal(x, torch.full_like(x, float(sum(r + step + i for r in range(n))))), "all_reduce"
                # uneven all_to_all: rank r sends r + p + 1 values to peer p, each equal to 100 r + p
                sizes = [rank + p + 1 for p in range(n)]
                send = torch.cat([torch.full((s,), 100.0 * rank + p) for p, s in enumerate(sizes)])
                recv_sizes = [p + rank + 1 for p in range(n)]
                recv = torch.empty(sum(recv_sizes))
                dist.all_to_all_single(recv, send, recv_sizes, sizes, group=g)
                want = torch.cat([torch.full((s,), 100.0 * p + rank) for p, s in enumerate(recv_sizes)])
                assert torch.equal(recv, want), "all_to_all_single"
                b = torch.tensor([float(rank * 7 + step)])
                dist.broadcast(b, group_src=step % n, group=g)
                assert b.item() == (step % n) * 7 + step, "broadcast"
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(f"group {i}: {e!r}")

    threads = [threading.Thread(target=work, args=(i, g)) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors += [f"{t.name}: still running after 60 s" for t in threads if t.is_alive()]  # a hang fails too
    for g in groups:
        dist.destroy_process_group(g)
    return {"added": added, "errors": errors}


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout=90) as p:
        yield p


@pytest.mark.parametrize("mode, added", [("shared", 1), ("per-group", GROUPS)])
def test_groups_share_one_io_thread_and_give_gloos_results(pool, mode, added):
    for r, res in enumerate(pool.run(_groups_in_threads, mode)):
        assert not res["errors"], (r, res["errors"])
        # shared: the first group makes the process's device and its one thread; per-group: a device per group
        assert res["added"] == added, (mode, r, res["added"])


def test_a_bad_setting_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("COCOSYNC_GLOO_DEVICE", "one")
    with pytest.raises(ValueError, match="COCOSYNC_GLOO_DEVICE='one'.*'shared'.*'per-group'"):
        gloo_device.shared()
