"""schedule="auto": the optimizer times the schedules that keep its state sliced inside the job, runs the fastest,
caches the choice, and trains exactly as torch.optim does under whichever schedule it runs."""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.optim.test_optim import STEPS, Net, _make, _reference, _train


def _auto_on_rank(cache: str, force: str | None = None):
    import torch.distributed as dist

    os.environ["COCOSYNC_CACHE_DIR"] = cache
    os.environ["COCOSYNC_KERNELS"] = "eager"  # the choice, not kernel compilation, is under test
    rank, P = dist.get_rank(), dist.get_world_size()
    runs = []
    for attempt in range(2):
        if force is not None and attempt == 1:  # the cache names another candidate: the optimizer runs that one
            dist.barrier()
            if rank == 0:
                path = next((Path(cache) / "tune").glob("*.json"))
                entry = json.loads(path.read_text())
                entry["chosen"] = force
                path.write_text(json.dumps(entry))
            dist.barrier()
        net = Net()
        opt = _make("adam", net.parameters(), schedule="auto")
        (choice,) = opt.schedule_choices
        runs.append((_train(net, opt, range(1, STEPS + 1), rank, P), choice.candidate.name, choice.cached,
                     dict(choice.medians), opt.compiled.fast_steps))
    return runs


@pytest.mark.parametrize("force", [None, "split+reorder+as_slice"])
def test_auto_schedule_times_caches_and_trains_like_torch(rank_pool, tmp_path, force):
    cache = tmp_path / "cache"
    got = rank_pool(2).run(_auto_on_rank, str(cache), force)
    ref = _reference("adam", {})
    (first, second), other = got[0], got[1]
    _, name, cached, medians, _ = first
    assert not cached and name == min(medians, key=medians.__getitem__)
    # every candidate kept m and v sliced; the program as written (state replicated) is not among them
    assert "split+reorder+as_slice+fuse" in medians and "as written" not in medians
    assert all(c.startswith("split+reorder+as_slice") for c in medians)
    assert [r[1] for r in other] == [r[1] for r in got[0]]  # the ranks run the same plan
    entries = list((cache / "tune").glob("*.json"))
    assert len(entries) == 1 and json.loads(entries[0].read_text())["world"] == 2
    _, name2, cached2, medians2, fast2 = second
    assert cached2 and not medians2 and name2 == (force or name)
    if force:
        assert not any(s.startswith("fused_collective") for s in fast2), fast2
    for r in (0, 1):
        for run in got[r]:
            for p, q in zip(run[0], ref):
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_auto_schedule_is_refused_misspelled():
    with pytest.raises(ValueError, match=r"schedule='fastest'; expected one of standard, auto"):
        _make("adam", Net().parameters(), schedule="fastest")
