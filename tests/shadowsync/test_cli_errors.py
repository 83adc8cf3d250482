"""Bad input at the CLI: one or two lines naming the input, what was wrong and what would be right; no traceback
(unless --debug); usage errors exit 2; nothing is spawned."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from cocosync.cli import main as cli


def _train(tmp_path, *args: str):
    return CliRunner().invoke(cli, ["train", "--no-progress", "--out", str(tmp_path / "run"), *args])


def _config(tmp_path, text: str, name: str = "c.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _one_error(res, *needles: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
    for n in needles:
        assert n in res.output, res.output


def test_missing_data_file_is_named_before_anything_runs(tmp_path):
    res = _train(tmp_path, "--data", str(tmp_path / "nope.tsv"))
    _one_error(res, "nope.tsv", "no such file")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_toml_syntax_error_names_the_file_and_line(tmp_path):
    cfg = _config(tmp_path, "trainers = 2\nexamples = = 5\n")
    _one_error(_train(tmp_path, "--config", cfg), "c.toml", "TOML syntax error", "line 2")


@pytest.mark.parametrize("text, needle", [
    ('[sync]\nalpha = "0.5"\n', "sync.alpha='0.5' is invalid"),
    ("out_dir = 5\n", "out_dir=5 is invalid"),
    ("[sync]\nblock_lr = inf\n", "sync.block_lr=inf is invalid"),
    ("checkpoint = 1\n", "checkpoint=1 is invalid"),
    ("seed = 1.5\n", "seed=1.5 is invalid"),
    ("sync = 5\n", "sync=5 is invalid: expected a [sync] table"),
    ("model = 3\n", "model=3 is invalid: expected a [model] table"),
    ("timeout = 0\n", "timeout=0 is invalid"),
])
def test_wrong_typed_or_non_finite_values_are_named(tmp_path, text, needle):
    _one_error(CliRunner().invoke(cli, ["train", "--no-progress", "--config", _config(tmp_path, text)]), needle)


def _bad_checkpoint(tmp_path, kind: str):
    if kind == "old file":
        path = tmp_path / "checkpoint.pt"
        path.write_bytes(b"\x80\x02junk")
        return path, "one-file format"
    path = tmp_path / "ckpt"
    path.mkdir()
    if kind == "empty dir":
        return path, "no checkpoint there"
    (path / "meta.json").write_text("{not json")
    return path, "unreadable meta.json"


@pytest.mark.parametrize("kind", ["old file", "empty dir", "bad meta"])
def test_bad_checkpoints_are_one_line(tmp_path, kind):
    ckpt, needle = _bad_checkpoint(tmp_path, kind)
    _one_error(CliRunner().invoke(cli, ["eval", str(ckpt)]), needle, str(ckpt))
    _one_error(_train(tmp_path, "--resume", str(ckpt)), needle)


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("COCOSYNC_DEBUG", "0")  # --debug sets it in this process; restored afterwards
    cfg = _config(tmp_path, '[sync]\nalpha = "0.5"\n')
    res = CliRunner().invoke(cli, ["--debug", "train", "--no-progress", "--config", cfg])
    assert res.exit_code != 0 and res.exception is not None and "sync.alpha" in str(res.exception)


def test_a_missing_eval_data_file_is_named(tmp_path):
    res = _train(tmp_path, "--eval-data", str(tmp_path / "held-out.tsv"))
    _one_error(res, "held-out.tsv", "no such file")


def test_eval_data_scores_on_that_file(tmp_path):
    import json

    from cocosync.shadowsync.data.synth import EVAL, write_synthetic

    held = tmp_path / "held.tsv"
    write_synthetic(held, 1500, seed=0, split=EVAL)
    res = _train(tmp_path, "--eval-data", str(held), "--examples", "6000", "--eval-examples", "20000", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_examples_scored"] == 1500  # the file's rows, not a synthetic draw of 20000


def test_the_multi_node_entry_point_outside_torchrun_says_how_to_launch_it(monkeypatch):
    from cocosync.shadowsync.cli.rank import main

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    res = CliRunner().invoke(main, ["--examples", "1000"])
    _one_error(res, "one rank of a torchrun job", "torchrun --nnodes N", "cocosync train --nnodes N")


@pytest.mark.parametrize("args, needle", [
    (["--eval-every", "0"], "eval_every=0 is invalid"),
    (["--checkpoint-every", "0"], "checkpoint_every=0 is invalid"),
    (["--stop-after", "-5"], "stop_after=-5 is invalid"),
])
def test_single_machine_checkpoint_and_eval_options_are_checked(tmp_path, args, needle):
    _one_error(_train(tmp_path, *args), needle)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("args, needle", [
    (["--bottom-mlp", "64,x"], "--bottom-mlp"),
    (["--embedding-dim", "8", "--bottom-mlp", "32,16"], "its last width must equal embedding_dim=8"),
    (["--table-size", "0"], "table_size"),
    (["--num-dense", "5"], "synthetic data has 13 dense / 26 sparse features but num_dense=5"),
])
def test_model_and_data_sizes_on_the_command_line_are_checked(tmp_path, args, needle):
    _one_error(_train(tmp_path, *args), needle)


def test_model_and_data_sizes_on_the_command_line_shape_the_model(tmp_path):

    res = _train(tmp_path, "--trainers", "1", "--examples", "4000", "--eval-examples", "500", "--batch-size", "64",
                 "--embedding-dim", "4", "--bottom-mlp", "12,4", "--top-mlp", "6", "--table-size", "300",
                 "--sync", "none")
    assert res.exit_code == 0, res.output
    import json

    from cocosync.shadowsync.checkpoint import read_tensors

    meta = json.loads((tmp_path / "run" / "checkpoints" / "seen-4000" / "meta.json").read_text())
    assert meta["config"]["model"] == {"embedding_dim": 4, "bottom_mlp": [12, 4], "top_mlp": [6], "init_ctr": 0.04}
    assert meta["config"]["data_options"] == {"table_size": 300}
    ckpt = read_tensors(tmp_path / "run")
    assert ckpt["emb.0.weight"].shape == (26 * 300, 4)  # 26 tables of 300 rows, 4 wide, on one server
    bottom = 13 * 12 + 12 + 12 * 4 + 4  # the bottom MLP: 13 dense features -> 12 -> 4
    top = (4 + 27 * 26 // 2) * 6 + 6 + 6 + 1  # [bottom output, 351 pairwise dots] -> 6 -> 1
    assert ckpt["trainer.0.flat"].numel() == bottom + top


def test_a_damaged_or_non_finite_checkpoint_is_refused_naming_the_tensor(tmp_path):
    """A few bytes flipped inside tensor data (which loads without complaint) fail the tensor's CRC-32; a NaN in the
    weights is refused by name, for `cocosync eval` and `--resume` alike."""
    import torch.distributed.checkpoint as dcp

    from cocosync.shadowsync.checkpoint import read_tensors

    res = _train(tmp_path, "--trainers", "1", "--examples", "4000", "--eval-examples", "500", "--batch-size", "64",
                 "--table-size", "300", "--sync", "none")
    assert res.exit_code == 0, res.output
    ckpt = tmp_path / "run" / "checkpoints" / "seen-4000"
    good = read_tensors(ckpt)
    data = max(ckpt.glob("*.distcp"), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    for i in range(4):
        raw[len(raw) // 2 + i] ^= 0x5A  # the middle of the file: inside the embedding shard's bytes
    data.write_bytes(bytes(raw))
    _one_error(CliRunner().invoke(cli, ["eval", str(ckpt)]), "is damaged", "emb.0.weight")
    # found by the rank loading that shard: the job fails naming it
    resumed = _train(tmp_path, "--resume", str(ckpt), "--epochs", "2")
    assert resumed.exit_code == 1, resumed.output
    assert "is damaged" in resumed.output and "emb.0.weight" in resumed.output, resumed.output
    nan = tmp_path / "nan"
    good["trainer.0.flat"][3] = float("nan")
    dcp.save(good, checkpoint_id=str(nan), no_dist=True)  # no checksums: what an altered checkpoint may look like
    (nan / "meta.json").write_text((ckpt / "meta.json").read_text())
    _one_error(CliRunner().invoke(cli, ["eval", str(nan)]), "'trainer.0.flat' holds 1 non-finite value")


def test_a_run_that_does_not_fit_dev_shm_is_refused_before_it_starts(tmp_path):
    """The tables of the default run need ~19 MiB of shared memory: in a private 16 MiB /dev/shm (a mount namespace)
    `cocosync train` says what it needs and what there is, before any rank starts."""
    import subprocess
    import sys

    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m is not permitted here (needs root): no private /dev/shm")
    out = tmp_path / "run"
    run = (f"mount -t tmpfs -o size=16m tmpfs /dev/shm && {sys.executable} -m cocosync_start train --no-progress "
           f"--examples 100000 --out {out}")
    res = subprocess.run(["unshare", "-m", "sh", "-c", run], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "needs about 19.7 MiB of shared memory" in res.stderr and "16.0 MiB free of 16.0 MiB" in res.stderr
    assert "Traceback" not in res.stderr and not (out / "logs").exists()


def test_a_binary_eval_file_is_refused_before_training(tmp_path):
    held = tmp_path / "held.bin"
    held.write_bytes(bytes(range(256)) * 400)
    _one_error(_train(tmp_path, "--eval-data", str(held), "--examples", "6000"), "--eval-data", str(held))
    with_lines = tmp_path / "held2.bin"  # more than the reader's 1000-line grace: 'not a Criteo-format file'
    with_lines.write_bytes(b"\x00\x01\xff garbage\n" * 3000)
    _one_error(_train(tmp_path, "--eval-data", str(with_lines), "--examples", "6000"), "cannot be scored on",
               "malformed")
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started


def test_eval_examples_on_the_command_line_win_over_the_config_files_eval_rows(tmp_path):
    from cocosync.shadowsync.cli.options import config_from_options
    from cocosync.shadowsync.data.sources import build_configs

    cfg = config_from_options(_config(tmp_path, "[data_options]\neval_rows = 777\n"), None, {"eval_examples": 1234})
    assert build_configs(cfg)[0].eval_rows == 1234
    cfg = config_from_options(_config(tmp_path, "[data_options]\neval_rows = 777\n"), None, {})
    assert build_configs(cfg)[0].eval_rows == 777  # the file's, when the command line says nothing


def test_a_data_file_shorter_than_the_budget_trains_on_all_of_it_or_is_refused_before_training(tmp_path):
    """--examples caps a plain file, it does not pad it; without --eval-data a file with no rows after the budget has
    no held-out set, which is said before training (it used to be found after it)."""
    import json

    from cocosync.shadowsync.data.synth import EVAL, write_synthetic

    data, held = tmp_path / "small.tsv", tmp_path / "held.tsv"
    write_synthetic(data, 3000, seed=1)
    write_synthetic(held, 500, seed=1, split=EVAL)
    res = _train(tmp_path, "--data", str(data), "--eval-data", str(held), "--examples", "20000", "--trainers", "1",
                 "--sync", "none", "--batch-size", "64")
    assert res.exit_code == 0, res.output
    assert "has 3,000 lines, fewer than --examples 20,000: training on all 3,000" in res.output
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["examples"] == 3000
    _one_error(_train(tmp_path, "--data", str(data), "--examples", "20000", "--out", str(tmp_path / "other")),
               "has 3,000 lines", "no rows are left after the budget", "--eval-data")


def test_a_directory_as_data_and_tables_beyond_the_machine_are_one_line(tmp_path):
    _one_error(_train(tmp_path, "--data", str(tmp_path)), "is a directory", "Criteo-format TSV file")
    _one_error(_train(tmp_path, "--table-size", "4000000000"), "needs about", "TiB of shared memory")


def test_the_algorithm_alone_may_stand_for_the_sync_table(tmp_path):
    from cocosync.shadowsync.cli.options import config_from_options

    assert config_from_options(_config(tmp_path, 'sync = "shadow-ma"\n'), None, {}).sync.algorithm == "shadow-ma"


def test_paths_with_markup_characters_are_printed_as_given(tmp_path):
    """rich markup in a path is text: '[/y]' used to raise MarkupError, '[red]' was printed stripped."""
    _one_error(_train(tmp_path, "--data", str(tmp_path / "x[/y].tsv")), "x[/y].tsv", "no such file")
    out = tmp_path / "o[red]x"
    res = CliRunner().invoke(cli, ["train", "--no-progress", "--out", str(out), "--trainers", "1", "--examples", "4000",
                                   "--eval-examples", "1000", "--sync", "none", "--timeout", "100"])
    assert res.exit_code == 0, res.output
    assert f"{out}/metrics.jsonl" in res.output and f"cocosync eval {out}/checkpoints/seen-4000" in res.output
    # the finished run: a resume has nothing to train (it used to rewrite summary.json with an empty session), and
    # would not inherit the session's --timeout
    summary = (out / "summary.json").read_text()
    _one_error(_train(tmp_path, "--resume", str(out)), "nothing left to train", "has seen 4,000 examples")
    assert (out / "summary.json").read_text() == summary
    from cocosync.shadowsync.cli.options import config_from_options

    assert config_from_options(None, str(out), {}).timeout is None
    assert config_from_options(None, str(out), {"timeout": 50.0}).timeout == 50.0


def test_a_file_with_other_columns_is_scored_on_its_rows_after_the_budget(tmp_path):
    """Without --eval-data the held-out set is the file's rows after the budget, whatever its column counts (it used
    to demand the synthetic data's 13/26 columns)."""
    import random

    rng = random.Random(0)
    data = tmp_path / "narrow.tsv"
    data.write_text("".join("\t".join([str(int(rng.random() < 0.3)), *(str(rng.randint(0, 9)) for _ in range(3)),
                                        *(f"{rng.randint(0, 99):08x}" for _ in range(2))]) + "\n"
                            for _ in range(6000)))
    res = _train(tmp_path, "--data", str(data), "--num-dense", "3", "--num-sparse", "2", "--examples", "4000",
                 "--trainers", "1", "--sync", "none", "--eval-examples", "2000", "--json")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "run" / "summary.json").exists() and "eval NE" in res.output


def test_lookup_transport_options_are_checked_in_the_units_the_user_typed(tmp_path):
    _one_error(_train(tmp_path, "--exchange-interval", "0"), "--exchange-interval 0 ms is invalid",
               "milliseconds in (0, 1000]")
    _one_error(_train(tmp_path, "--exchange-interval", "5000"), "--exchange-interval 5000 ms is invalid")
    _one_error(_train(tmp_path, "--hot-sync-interval", "0"), "--hot-sync-interval 0 ms is invalid")
    _one_error(_train(tmp_path, "--hot-rows", "-1"), "hot_rows=-1 is invalid", "integer >= 0")
    _one_error(_train(tmp_path, "--hot-staleness", "-2"), "--hot-staleness -2.0 is invalid", "updates per use")
    res = _train(tmp_path, "--lookup-transport", "smoke")
    assert res.exit_code == 2 and "smoke" in res.output and "exchange" in res.output


@pytest.mark.parametrize(("args", "named"), [
    (["--rdzv-endpoint", "127.0.0.1:notaport"], "--rdzv-endpoint '127.0.0.1:notaport' is invalid"),
    (["--node-rank", "2"], "--node-rank 2 is invalid with --nnodes 2: expected 0 .. 1"),
    (["--local-addr", "999.1.1.1"], "--local-addr '999.1.1.1' does not resolve to an address"),
    (["--nnodes", "0:2"], "expected N >= 1 machines, or MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes", "3:2"], "expected N >= 1 machines, or MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes", "1:2:3"], "expected N >= 1 machines, or MIN:MAX"),
    (["--nnodes", "two"], "'two' is not a number of machines: expected N or MIN:MAX"),
    (["--nnodes", "1:2", "--node-rank", "2"], "--node-rank 2 is invalid with --nnodes 1:2: expected 0 .. 1"),
])
def test_a_bad_multi_machine_option_is_one_line_naming_it(tmp_path, args, named):
    res = CliRunner().invoke(cli, ["train", "--nnodes", "2", *args, "--out", str(tmp_path / "run")])
    assert res.exit_code == 2 and named in res.output, res.output
    assert "Traceback" not in res.output


def test_a_machine_shape_without_a_trainer_is_refused_before_the_rendezvous(tmp_path):
    """EASGD's sync server takes the second process of a 2-process machine: refused at once, naming the count."""
    res = subprocess.run([sys.executable, "-m", "cocosync_start", "train", "--nnodes", "2", "--nproc-per-node", "2",
                          "--sync", "shadow-easgd", "--out", str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--nproc-per-node=2 leaves no trainer" in res.stderr and "expected nproc-per-node >= 3" in res.stderr
    assert "Traceback" not in res.stderr and "waiting for" not in res.stderr


def test_a_config_nested_thousands_deep_is_one_line_and_yaml_configs_are_read(tmp_path):
    deep = _config(tmp_path, '{"a":' * 100_000 + "1" + "}" * 100_000, "deep.json")
    _one_error(_train(tmp_path, "--config", deep), "nested too deeply", "deep.json")
    from cocosync.shadowsync.config import load_train_config

    cfg = load_train_config(_config(tmp_path, "trainers: 3\nsync:\n  algorithm: shadow-ma\n", "run.yaml"))
    assert cfg.trainers == 3 and cfg.sync.algorithm == "shadow-ma"


def test_a_truncated_gzip_file_is_one_line_naming_it(tmp_path):
    import gzip

    full = tmp_path / "full.tsv.gz"
    with gzip.open(full, "wt") as f:
        f.write("".join(f"{i % 2}\t" + "\t".join(["1"] * 13 + ["a"] * 26) + "\n" for i in range(20_000)))
    cut = tmp_path / "cut.tsv.gz"
    cut.write_bytes(full.read_bytes()[:2000])
    _one_error(_train(tmp_path, "--data", str(cut), "--examples", "10000"), "cut.tsv.gz",
               "truncated or damaged gzip file")


def test_an_out_directory_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    res = CliRunner().invoke(cli, ["train", "--no-progress", "--out", str(tmp_path / "afile" / "run")])
    _one_error(res, "cannot be written", "afile")
    ro = tmp_path / "ro"  # a read-only file system, where this machine lets a test mount one
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        return
    try:
        res = CliRunner().invoke(cli, ["train", "--no-progress", "--out", str(ro / "run")])
        _one_error(res, "cannot be written: Read-only file system")
    finally:
        subprocess.run(["umount", str(ro)])


def test_a_run_that_finished_says_so_and_only_a_stopped_one_says_stopped(tmp_path):
    from cocosync.shadowsync.data.synth import write_synthetic

    write_synthetic(tmp_path / "train.tsv", 20_000, 0)
    write_synthetic(tmp_path / "eval.tsv", 2_000, 1)
    common = ["train", "--no-progress", "--data", str(tmp_path / "train.tsv"), "--eval-data",
              str(tmp_path / "eval.tsv"), "--examples", "20000", "--eval-examples", "2000"]
    done = subprocess.run([sys.executable, "-m", "cocosync_start", *common, "--out", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stopped" not in done.stderr  # (it said 'stopped at --stop-after' with no --stop-after given)
    import json

    seen = json.loads((tmp_path / "a" / "summary.json").read_text())["examples"]
    assert seen == 20_000 or f"finished, {20_000 - seen:,} examples short of the budget" in done.stderr
    stopped = subprocess.run([sys.executable, "-m", "cocosync_start", *common, "--out", str(tmp_path / "b"),
                              "--stop-after", "8000"], capture_output=True, text=True, timeout=240)
    assert stopped.returncode == 0 and "stopped at --stop-after; continue with" in stopped.stderr


def test_a_multi_machine_option_on_one_machine_is_named_as_ignored(tmp_path):
    res = _train(tmp_path, "--hot-rows", "1000000000", "--examples", "2000", "--eval-examples", "500", "-T", "1")
    assert res.exit_code == 0, res.output
    assert "--hot-rows: this option applies across machines (--nnodes)" in res.output


def test_a_checkpoint_into_a_full_disk_is_one_line_and_keeps_the_last_whole_one(tmp_path):
    disk = tmp_path / "disk"  # a 6 MB file system: room for one checkpoint of this run (~3.8 MB), not two
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small file system here (needs root)")
    try:
        run = disk / "run"
        args = ["--table-size", "2000", "--examples", "20000", "--eval-examples", "1000", "-T", "1",
                "--checkpoint-every", "10000", "--out", str(run)]
        done = subprocess.run([sys.executable, "-m", "cocosync_start", "train", "--no-progress", *args],
                              capture_output=True, text=True, timeout=240)
        assert done.returncode != 0
        err = [line for line in done.stderr.splitlines() if not line.startswith("E1")]
        assert any("cannot write checkpoint" in line and "seen-20000': No space left on device" in line
                   and "the last whole checkpoint is kept" in line for line in err), done.stderr[-3000:]
        assert "JSONDecodeError" not in done.stderr.split("error: training failed")[-1]
        kept = sorted(p.name for p in (run / "checkpoints").iterdir())  # the partial seen-20000 is gone
        assert len(kept) == 2 and kept[0] == "latest" and kept[1].startswith("seen-10")  # (marks: batch boundaries)
        assert (run / "checkpoints" / "latest").read_text().strip() == kept[1]
    finally:
        subprocess.run(["umount", str(disk)])


@pytest.mark.parametrize("args,needles", [
    (["--trainers", "2", "--min-trainers", "2", "--max-restarts", "1"],
     ["--max-restarts 1", "does not go on without a lost trainer", "--min-trainers 2 of 2"]),
    (["--trainers", "2", "--sync", "shadow-dssync", "--max-restarts", "1"], ["--max-restarts 1", "DS-Sync"]),
    (["--trainers", "2", "--max-restarts", "-1"], ["max_restarts=-1", "from 0 to 100"]),
])
def test_restarts_a_job_cannot_use_are_refused_naming_why(tmp_path, args, needles):
    _one_error(_train(tmp_path, "--examples", "10000", *args), *needles)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("args,named", [(["--lookup-transport", "rpc"], "--lookup-transport rpc"),
                                        (["--sync", "shadow-easgd", "--nproc-per-node", "4"],
                                         "--sync shadow-easgd")])
def test_restarts_are_refused_across_machines_where_a_trainer_cannot_be_started_again(tmp_path, args, named):
    res = _train(tmp_path, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29555", *args,
                 "--max-restarts", "1", "--examples", "10000")
    _one_error(res, "--max-restarts 1", "started again where the job goes on without it", named)


@pytest.mark.parametrize("args,named", [(["--sync", "shadow-easgd", "--nproc-per-node", "4"], "--sync shadow-easgd"),
                                        (["--lookup-transport", "rpc"], "--lookup-transport rpc"),
                                        (["--shard-mirror-interval", "200"], "--shard-mirror-interval 200"),
                                        (["--max-restarts", "1"], "--max-restarts 1")])
def test_a_range_of_machines_is_refused_where_a_machine_cannot_join_the_running_job(tmp_path, args, named):
    res = _train(tmp_path, "--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29557", *args,
                 "--examples", "10000")
    _one_error(res, "--nnodes 1:2" if "restarts" not in named else "a range of machines (--nnodes 1:2)", named)


def test_the_shard_mirror_is_refused_beyond_two_machines(tmp_path):
    res = _train(tmp_path, "--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29556",
                 "--shard-mirror-interval", "200", "--examples", "10000")
    _one_error(res, "--shard-mirror-interval 200", "the other of two machines", "--nnodes 3")
