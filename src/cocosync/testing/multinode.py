"""Several torchrun agents on this host, as the nodes of one job: on loopback (every agent on 127.0.0.1, sharing
/dev/shm), or on two simulated machines (`twohosts.sh`: a network namespace, an address and a private /dev/shm each).

`run_nodes(module_args, nnodes=2, nproc_per_node=K)` starts one agent per node with a c10d rendezvous, waits for all
with a timeout (a hang fails, it does not stall), kills every agent's process group on the way out, and returns each
node's exit code and output. An agent is `cocosync train --nnodes` (torch's elastic agent in that process, its ranks
forked warm: ~2.3 s less wall time for a 2-node test job here) or, with `launcher="torchrun"`, torchrun's command.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from cocosync.runtime.comm.shm import SHM_DIR
from cocosync.shadowsync.job.node_launch import torchrun_args
from cocosync.shadowsync.job.rank_start import parse_title
from cocosync.testing.launch import free_port
from cocosync.testing.sockets import process_tree

#: how start_nodes starts a node: torchrun's command, or `cocosync train --nnodes`
LAUNCHERS = ("torchrun", "cocosync")

__all__ = ["LAUNCHERS", "TWOHOSTS_ENV", "NodeRun", "run_nodes", "start_nodes", "wait_nodes", "worker_pids",
           "twohosts_script", "twohosts_available", "kill_machine", "semaphores", "remove_semaphores_since",
           "train_records", "until_trained", "machines_ended", "check_node_1_joined"]

#: the environment variable naming the script that makes two simulated machines (network namespaces)
TWOHOSTS_ENV = "COCOSYNC_TWOHOSTS"


@dataclass
class NodeRun:
    """One agent's exit code (None: killed at the timeout) and its combined output."""

    node: int
    returncode: int | None
    output: str


def twohosts_script() -> Path | None:
    """The twohosts.sh tool $COCOSYNC_TWOHOSTS names (the test suite sets it to the team's tool), or None."""
    p = os.environ.get(TWOHOSTS_ENV)
    return Path(p) if p and Path(p).is_file() else None


def twohosts_available() -> bool:
    """True when two simulated machines can be made here (root, iproute2): `twohosts.sh check` and `up` succeed."""
    script = twohosts_script()
    if script is None or shutil.which("ip") is None:
        return False
    for cmd in ("check", "up"):
        if subprocess.run(["bash", str(script), cmd], capture_output=True, timeout=30).returncode != 0:
            return False
    return True


def _agent_cmd(module_args: Sequence[str], nnodes: int | str, node: int, nproc: int, endpoint: str, run_id: str,
               local_addr: str, launcher: str) -> list[str]:
    # --local-addr: the address the workers' store and MASTER_ADDR use (torchrun would resolve the hostname, which
    # names another interface, or none inside a network namespace)
    if launcher == "cocosync":
        if list(module_args[:2]) != ["-m", "cocosync.shadowsync"]:
            raise ValueError(f"launcher='cocosync' runs `-m cocosync.shadowsync ...`, not {list(module_args[:2])}")
        return [sys.executable, "-m", "cocosync_start", "train", "--nnodes", str(nnodes), "--node-rank", str(node),
                "--nproc-per-node", str(nproc), "--rdzv-endpoint", endpoint, "--local-addr", local_addr,
                *module_args[2:]]
    return [sys.executable, "-m", "torch.distributed.run",
            *torchrun_args(nnodes, node, nproc, endpoint, local_addr, run_id), *module_args]


def start_nodes(module_args: Sequence[str], *, nnodes: int | str = 2, nproc_per_node: int = 2, two_hosts: bool = False,
                env: dict | None = None, cwd: str | os.PathLike | None = None, launcher: str = "cocosync",
                node_args: Sequence[Sequence[str]] = (), port: int | None = None,
                only: Sequence[int] | None = None) -> list[subprocess.Popen]:
    """Start `torchrun ... <module_args>` (e.g. ["-m", "cocosync.shadowsync", "--examples", "4000"]) as `nnodes`
    agents, output piped; with `two_hosts` (nnodes must be 2) on the simulated machines A and B of twohosts.sh.
    `launcher`: "torchrun" (torchrun's command: each rank exec'd cold, in a session of its own) or "cocosync"
    (`cocosync train --nnodes`: the same agent in-process, its ranks forked warm in its session; job/node_launch.py).
    `nnodes` may be a range of machines ("1:2": the job starts with those of `only` and the others join it).
    `node_args[i]`: more arguments for node i alone (a machine started with other options). `port` (with `only`:
    the nodes to start, e.g. a machine started again in a running job): the rendezvous port (default: a free one)."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}: expected one of {LAUNCHERS}")
    port = free_port() if port is None else port
    run_id = f"cocosync-{os.getpid()}-{port}"
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COCOSYNC_RUN_ID": run_id,
                **(env or {})}
    procs: list[subprocess.Popen] = []
    for node in range(int(str(nnodes).split(":")[-1])) if only is None else only:
        node_env = dict(base_env)
        args = [*module_args, *(node_args[node] if node < len(node_args) else ())]
        if two_hosts:
            if str(nnodes).split(":")[-1] != "2":
                raise ValueError("two_hosts runs exactly 2 nodes (twohosts.sh has hosts A and B)")
            script = twohosts_script()
            host = "AB"[node]
            iface = f"{os.environ.get('TWOHOSTS_PREFIX', 'cc')}v{host}"
            node_env.update(GLOO_SOCKET_IFNAME=iface, TP_SOCKET_IFNAME=iface)
            a, mine = (subprocess.run(["bash", str(script), "addr", h], capture_output=True, text=True,
                                      check=True).stdout.strip() for h in ("A", host))
            cmd = ["bash", str(script), "run", host,
                   *_agent_cmd(args, nnodes, node, nproc_per_node, f"{a}:{port}", run_id, mine, launcher)]
        else:
            cmd = _agent_cmd(args, nnodes, node, nproc_per_node, f"127.0.0.1:{port}", run_id,
                             "127.0.0.1", launcher)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=node_env,
                                      cwd=cwd, start_new_session=True))
    return procs


def wait_nodes(procs: list[subprocess.Popen], timeout: float) -> list[NodeRun]:
    """Wait for every agent (at most `timeout` seconds in all); whatever is left then is killed, with its workers."""
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    codes: list[int | None] = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                codes.append(p.returncode)
            except subprocess.TimeoutExpired:
                _kill_group(p)
                out, _ = p.communicate()
                codes.append(None)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
                p.communicate()
    return [NodeRun(i, c, o) for i, (c, o) in enumerate(zip(codes, outputs))]


def run_nodes(module_args: Sequence[str], *, nnodes: int = 2, nproc_per_node: int = 2, timeout: float = 300.0,
              two_hosts: bool = False, env: dict | None = None, cwd: str | os.PathLike | None = None,
              launcher: str = "cocosync", node_args: Sequence[Sequence[str]] = ()) -> list[NodeRun]:
    """`start_nodes` then `wait_nodes`: each node's exit code and output."""
    procs = start_nodes(module_args, nnodes=nnodes, nproc_per_node=nproc_per_node, two_hosts=two_hosts, env=env,
                        cwd=cwd, launcher=launcher, node_args=node_args)
    return wait_nodes(procs, timeout)


def worker_pids(agent_pid: int, module: str = "cocosync.shadowsync") -> dict[int, int]:
    """RANK -> pid of the workers running `module` under an agent (read from /proc): torchrun's, or the ranks
    `cocosync train --nnodes` forked warm (known by their title)."""
    out = {}
    for pid in process_tree(agent_pid):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            cmd = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        titled = parse_title(cmd.split("\0")[0])
        if titled is not None:
            out[titled[0]] = pid
        elif module in cmd and "RANK" in env and "torch.distributed.run" not in cmd:
            out[int(env["RANK"])] = pid
    return out


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL the agent and every process under it (torchrun starts its workers in sessions of their own)."""
    kill_machine(p.pid)


def kill_machine(pid: int) -> None:
    """kill -9 of a node's command `pid` and every process under it: the loss of a whole machine."""
    for q in [*process_tree(pid), pid]:
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass


def semaphores() -> set[str]:
    """multiprocessing's named semaphores in /dev/shm (a killed machine's processes leave theirs behind)."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith("sem.mp-")}


def remove_semaphores_since(before: set[str]) -> None:
    """Remove the semaphores made since `before` (`semaphores()`): on loopback, the ones a machine killed whole left
    in the /dev/shm it shares with the others (on a real machine they go with it)."""
    for name in semaphores() - before:
        try:
            os.unlink(f"{SHM_DIR}/{name}")
        except FileNotFoundError:
            pass


def train_records(out: str | os.PathLike) -> list[dict]:
    """The `train` records a job has written to `out`/metrics.jsonl so far (a line still being written left out)."""
    path = Path(out) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x) for x in lines if x.strip().endswith("}") and '"event": "train"' in x]


def until_trained(procs: Sequence[subprocess.Popen], out: str | os.PathLike, examples: float, poll: float = 0.1,
                  timeout: float = 150.0) -> None:
    """Wait until the job writing to `out` has trained `examples`: an AssertionError if an agent of `procs` ended
    first, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (recs := train_records(out)) or recs[-1]["examples"] < examples:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
            f"the job did not train {examples:,.0f} examples (agents alive: {[p.poll() is None for p in procs]})"
        time.sleep(poll)


@contextlib.contextmanager
def machines_ended(procs: list[subprocess.Popen], before: set[str] | None = None) -> Iterator[None]:
    """On the way out, however a test went: every machine of `procs` (a list the body may add to) still up killed
    whole, and (with `before`: `semaphores()` before the machines started) the semaphores that killed machines left
    in the shared /dev/shm removed."""
    try:
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                kill_machine(p.pid)
        if before is not None:
            remove_semaphores_since(before)


def check_node_1_joined(summary: dict, started: float, within: float = 10.0) -> None:
    """A job of two machines x two trainers in whose node 1's place a machine joined (after node 1's loss, or awaited
    since the start): its summary names the join, and each of trainers 2 and 3 read its own rows (up to its cut),
    took the model from node 0's trainers, trained, and trained within `within` s of its command's start
    (`started`, time.time())."""
    s = summary
    assert [j["node"] for j in s["joined_nodes"]] == [1] and [x["node"] for x in s["lost_nodes"]] == [1], s
    assert sorted(r["trainer"] for r in s["restarts"]) == [2, 3], s["restarts"]
    for r in s["restarts"]:
        assert r["read_own_rows"] and r["state_from"] in (0, 1) and r["examples"] > 0, r
        assert r["joined"] - started < within, r["joined"] - started
