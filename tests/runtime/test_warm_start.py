"""Ranks forked from the warm fork server (runtime/warm_start.py): preloaded, handed their launcher's environment of
the moment (not the server's, which is the first launch's), and started without running the launcher's main module."""

import json
import os
import subprocess
import sys
import textwrap
import time
from multiprocessing import forkserver
from pathlib import Path

import pytest

from cocosync.runtime.warm_start import WARM_MODULES, adopt_environment
from cocosync.testing.launch import RankPool
from cocosync_start import EARLY_ENV, starts_ranks

_PROBE = "COCOSYNC_WARM_PROBE"


def _what_a_rank_sees():
    return {"probe": os.environ.get(_PROBE), "gone": os.environ.get(_PROBE + "_GONE"), "parent": os.getppid(),
            "rank": os.environ["RANK"], "preloaded": [m for m in WARM_MODULES if m not in sys.modules]}


def test_pool_ranks_fork_from_one_preloaded_server_with_the_environment_of_their_start(monkeypatch):
    seen = []
    for value in ("first", "second"):
        monkeypatch.setenv(_PROBE, value)
        if value == "first":
            monkeypatch.setenv(_PROBE + "_GONE", "set before the first pool only")
        else:
            monkeypatch.delenv(_PROBE + "_GONE")
        with RankPool(2, timeout=60) as pool:
            seen.append(pool.run(_what_a_rank_sees))
    server = forkserver._forkserver._forkserver_pid
    for value, ranks in zip(("first", "second"), seen):
        assert [r["probe"] for r in ranks] == [value, value]
        assert [r["rank"] for r in ranks] == ["0", "1"]  # the pool's own keys win over the launcher's
        assert all(r["parent"] == server != os.getpid() for r in ranks)  # forked by the one server, not spawned
        assert all(r["preloaded"] == [] for r in ranks), "a warm module failed to import in the server"
    assert [r["gone"] for r in seen[0]] == ["set before the first pool only"] * 2
    assert [r["gone"] for r in seen[1]] == [None, None]  # removed since the server started: gone in the rank too


def test_adopt_environment_takes_the_launchers_and_keeps_the_ranks_own_keys(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(_PROBE, "the server's stale value")
    monkeypatch.setenv(_PROBE + "_GONE", "only in the server")
    saved = dict(os.environ)
    try:
        launcher = {k: v for k, v in saved.items() if k != _PROBE + "_GONE"} | {"RANK": "0", _PROBE: "the launcher's"}
        adopt_environment(launcher, ["RANK", "NOT_SET_HERE"])
        assert os.environ["RANK"] == "3"  # a rank key: kept
        assert os.environ[_PROBE] == "the launcher's"
        assert _PROBE + "_GONE" not in os.environ
        assert "NOT_SET_HERE" not in os.environ
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.timeout(240)
def test_a_script_without_a_main_guard_trains_on_warm_ranks(tmp_path):
    """A user's script calls run_training at its top level: its ranks must not run the script again (a
    multiprocessing child would, and start the job once more from inside a rank)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        from multiprocessing import forkserver
        from cocosync.shadowsync.job.launch import run_training
        from cocosync.shadowsync.config import TrainConfig

        print("script body ran", file=sys.stderr)
        result = run_training(TrainConfig(examples=3000, eval_examples=1000, trainers=2, progress=False,
                                          out_dir={str(tmp_path / "run")!r}))
        print(json.dumps({{"examples": result.summary["examples"], "server": forkserver._forkserver._forkserver_pid}}))
    """))
    env = {**os.environ, "COCOSYNC_WARM_START": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("script body ran") == 1, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["examples"] == 3000 and out["server"] is not None
    logs = sorted((tmp_path / "run" / "logs").glob("rank*.err"))
    assert len(logs) == 3 and not any("script body ran" in p.read_text() for p in logs)


def _watch(pid):
    from cocosync.runtime.warm_start import die_with

    die_with(pid)
    return os.getpid()


def test_a_forked_rank_dies_with_the_process_it_watches():
    """die_with: the fork server, a warm rank's parent, outlives a killed launcher (each rank holds its liveness
    pipe), so the rank itself watches its launcher."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    pool = RankPool(2, timeout=60)
    try:
        ranks = pool.run_per_rank(_watch, [(launcher.pid,), (os.getpid(),)])
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(ranks[0]):
            time.sleep(0.05)
        assert not _alive(ranks[0])  # watched the killed process: gone
        assert _alive(ranks[1])  # watches this one: still there
    finally:
        pool.close(force=True)
        launcher.kill()


def _alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_EXIT_PROBE = '''
import atexit, os
atexit.register(lambda: open(os.environ["PROBE_MARK"] + ".hook", "w").close())  # an exit hook of a preloaded module


class _AtTeardown:
    def __del__(self, _open=open, _path=os.environ["PROBE_MARK"] + ".teardown"):  # (builtins are gone by then)
        _open(_path, "w").close()


_kept = _AtTeardown()  # released when the interpreter tears its modules down
'''


@pytest.mark.parametrize("quick", [True, False], ids=["server_exit-preloaded", "control-without-it"])
def test_the_fork_server_leaves_without_the_interpreters_teardown(tmp_path, quick):
    """Once its launcher exits, the server runs its preloaded modules' exit hooks and leaves without tearing torch's
    modules down (~0.8 s of CPU while it still held the launcher's stdout and stderr). The control shows the probe
    would see a teardown."""
    (tmp_path / "exit_probe.py").write_text(_EXIT_PROBE)
    mark = tmp_path / "mark"
    modules = ("cocosync.runtime.server_exit", "exit_probe") if quick else ("exit_probe",)
    launcher = textwrap.dedent(f"""
        import os
        from multiprocessing import forkserver
        import cocosync_start
        from cocosync.runtime import warm_start
        cocosync_start.WARM_MODULES = {modules!r}
        p = warm_start.context().Process(target=os.getpid)
        p.start()
        p.join()
        print(forkserver._forkserver._forkserver_pid)
    """)
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])  # the server imports it
    proc = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PROBE_MARK": str(mark), "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    server = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(server)
    assert Path(f"{mark}.hook").exists()  # the probe was preloaded, and its exit hook ran in both cases
    assert Path(f"{mark}.teardown").exists() == (not quick)


@pytest.mark.parametrize("argv, starts", [
    (["train"], True), (["--debug", "train", "--examples", "10"], True), (["demo"], True),
    (["train", "--help"], False), (["train", "-h"], False), (["train", "--nnodes", "2"], False),
    (["train", "--nnodes=2"], False), (["eval", "run"], False), (["bench", "job-start"], False),
    ([], False), (["--help"], False)])
def test_the_command_starts_the_server_early_only_where_it_starts_ranks(argv, starts):
    assert starts_ranks(argv) is starts


def _early_servers(launcher: int) -> list[int]:
    """Processes whose environment says they are a fork server `launcher` started before importing cocosync."""
    mark = f"{EARLY_ENV}={launcher}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours
            pass
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_the_command_starts_its_fork_server_before_cocosync_and_one_refused_at_its_checks_leaves_none(tmp_path):
    """`cocosync train` starts the ranks' fork server before it imports cocosync (torch), so the two import side by
    side; where the command stops at its checks (no such data file) the server dies with it at once, mid-import."""
    proc = subprocess.Popen([sys.executable, "-m", "cocosync_start", "train", "--data", str(tmp_path / "nope.tsv"),
                             "--out", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    servers: list[int] = []
    deadline = time.monotonic() + 60
    while not servers and proc.poll() is None and time.monotonic() < deadline:
        servers = _early_servers(proc.pid)
        time.sleep(0.01)
    assert servers, "no fork server ran while the command was importing cocosync"
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "nope.tsv" in err, err[-2000:]
    deadline = time.monotonic() + 2  # (the server alone would import for ~3 s more)
    while _alive(servers[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(servers[0]), "the fork server outlived the refused command"
