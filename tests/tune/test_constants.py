"""Hand-tuned constants decided by measurement: `cocosync tune one-shot` times the two all_reduce forms, saves the
crossover, and the runtime's communicators take it (an environment variable still wins)."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from cocosync.cli import main
from cocosync.runtime.comm.tuned import constants_path, tuned
from cocosync.testing.launch import RankPool
from cocosync.tune.constants import choose_one_shot, save_constant


def _rows(faster_up_to: int) -> list[dict]:
    sizes = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
    return [{"peer_bytes": s, "one_shot_s": 1.0 if s <= faster_up_to else 3.0, "three_phase_s": 2.0} for s in sizes]


def test_the_crossover_is_the_largest_size_up_to_which_one_shot_always_wins():
    assert choose_one_shot(_rows(256 << 10)) == 256 << 10
    assert choose_one_shot(_rows(0)) == 0
    rows = _rows(4 << 20)
    rows[1]["one_shot_s"] = 5.0  # slower at 64 KB: larger sizes do not count
    assert choose_one_shot(rows) == 16 << 10


def test_saved_constants_are_read_per_local_rank_count_and_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("COCOSYNC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("COCOSYNC_ONE_SHOT_BYTES", raising=False)
    from cocosync.runtime.comm import tuned as module

    module._saved.cache_clear()
    assert tuned("one_shot_bytes", 2, 123) == 123  # no file: the default
    save_constant("one_shot_bytes", 2, 4096)
    module._saved.cache_clear()
    assert json.loads(constants_path().read_text()) == {"one_shot_bytes@2": 4096}
    assert tuned("one_shot_bytes", 2, 123) == 4096 and tuned("one_shot_bytes", 4, 123) == 123
    monkeypatch.setenv("COCOSYNC_ONE_SHOT_BYTES", "77")
    assert tuned("one_shot_bytes", 2, 123) == 77
    module._saved.cache_clear()


def _communicator_threshold() -> int:
    from cocosync.runtime.comm.communicators import shared_communicator

    return shared_communicator().one_shot_bytes


def test_tune_one_shot_measures_saves_and_the_runtime_uses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("COCOSYNC_CACHE_DIR", str(tmp_path))
    out = tmp_path / "one_shot.json"
    res = CliRunner().invoke(main, ["tune", "one-shot", "--repeats", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["chosen"] == choose_one_shot(doc["rows"]) and len(doc["rows"]) == 8
    assert json.loads((tmp_path / "tune" / "constants.json").read_text()) == {"one_shot_bytes@2": doc["chosen"]}
    with RankPool(2, timeout=120, env={"COCOSYNC_CACHE_DIR": str(tmp_path)}) as pool:
        assert pool.run(_communicator_threshold) == [doc["chosen"]] * 2


def test_kernel_bytes_keeps_the_default_unless_another_is_clearly_faster():
    from cocosync.tune.constants import choose_kernel_bytes

    rows = lambda times: [{"kernel_bytes": k << 20, "median_s": t} for k, t in zip((1, 2, 4), times)]  # noqa: E731
    assert choose_kernel_bytes(rows([1.0, 0.98, 0.97]), 2 << 20) == 2 << 20  # 1% better: noise
    assert choose_kernel_bytes(rows([1.0, 1.0, 0.90]), 2 << 20) == 4 << 20
    assert choose_kernel_bytes(rows([0.5, 1.0, 0.9]), 2 << 20) == 1 << 20


def test_tune_kernel_bytes_measures_saves_and_the_fused_collective_reads_it(tmp_path, monkeypatch):
    from cocosync.runtime.comm import tuned as module
    from cocosync.runtime.steps.common import DEFAULT_KERNEL_BYTES, StepOptions, kernel_bytes
    from cocosync.tune.constants import KERNEL_BYTES_CHOICES, choose_kernel_bytes

    monkeypatch.setenv("COCOSYNC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("COCOSYNC_KERNELS", "eager")  # no compile in CI; the sizes are what is measured
    monkeypatch.delenv("COCOSYNC_KERNEL_BYTES", raising=False)
    out = tmp_path / "kb.json"
    res = CliRunner().invoke(main, ["tune", "kernel-bytes", "--repeats", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert [r["kernel_bytes"] for r in doc["rows"]] == list(KERNEL_BYTES_CHOICES)
    assert doc["chosen"] == choose_kernel_bytes(doc["rows"], DEFAULT_KERNEL_BYTES)
    assert json.loads((tmp_path / "tune" / "constants.json").read_text()) == {"kernel_bytes@2": doc["chosen"]}
    module._saved.cache_clear()
    try:
        assert kernel_bytes(StepOptions.make(), 2) == doc["chosen"]  # what the fused collective's runner calls
        assert kernel_bytes(StepOptions.make(kernel_bytes=4096), 2) == 4096  # compile_plan(kernel_bytes=) wins
        monkeypatch.setenv("COCOSYNC_KERNEL_BYTES", "8192")
        assert kernel_bytes(StepOptions.make(), 2) == 8192
    finally:
        module._saved.cache_clear()


def test_eager_work_is_where_the_compiled_kernel_starts_to_win_for_good():
    from cocosync.tune.constants import choose_eager_work

    def rows(wins):
        return [{"numel": n << 10, "compiled_s": 1.0 if w else 2.0, "eager_s": 1.5}
                for n, w in zip((16, 64, 256), wins)]

    assert choose_eager_work(rows([False, True, True]), 3) == 3 * (64 << 10)
    assert choose_eager_work(rows([True, False, True]), 3) == 3 * (256 << 10)  # a loss resets: it must win for good
    assert choose_eager_work(rows([False, False, False]), 2) == 2 * 2 * (256 << 10)  # never: past the largest


def test_tune_eager_work_measures_saves_and_generated_kernels_read_it(tmp_path, monkeypatch):
    from cocosync.dsl import Program, Replicated, Tensor, maximum
    from cocosync.runtime.comm import tuned as module
    from cocosync.runtime.steps.codegen import build_kernel
    from cocosync.runtime.steps.common import StepOptions, eager_work
    from cocosync.tune.constants import EAGER_SIZES, choose_eager_work

    monkeypatch.setenv("COCOSYNC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("COCOSYNC_EAGER_WORK", raising=False)
    out = tmp_path / "ew.json"
    res = CliRunner().invoke(main, ["tune", "eager-work", "--repeats", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert [r["numel"] for r in doc["rows"]] == list(EAGER_SIZES) and doc["stages"] == 3
    assert doc["chosen"] == choose_eager_work(doc["rows"], 3)
    assert json.loads((tmp_path / "tune" / "constants.json").read_text()) == {"eager_work@2": doc["chosen"]}
    module._saved.cache_clear()
    try:
        assert eager_work(StepOptions.make(), 2) == doc["chosen"]  # what the kernel runners pass to build_kernel
        assert eager_work(StepOptions.make(eager_work=600), 2) == 600  # compile_plan(eager_work=) wins
        monkeypatch.setenv("COCOSYNC_EAGER_WORK", "900")
        assert eager_work(StepOptions.make(), 2) == 900
    finally:
        module._saved.cache_clear()
    x = Tensor("x", (4, 8), torch.float32, Replicated)
    y = maximum(x + 1.0, 0.0) + x
    stages = list(Program("p", [x], {"y": y}).stages)
    assert build_kernel(stages, stages[-1:], "eager", eager_work=600).eager_below == 600 // len(stages)
