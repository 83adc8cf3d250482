"""Which TCP sockets a process tree listens on, read from /proc (Linux): for tests that every listening socket of a
run is on the loopback address; which of them are the ranks of a ShadowSync job."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

from cocosync.shadowsync.job.rank_start import parse_title

__all__ = ["process_tree", "listening_sockets", "job_ranks"]


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (those alive now)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def _addr(hex_addr: str) -> tuple[str, int]:
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        host = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(ip, 16)))
    else:  # /proc prints IPv6 as four little-endian 32-bit words
        host = socket.inet_ntop(socket.AF_INET6, b"".join(struct.pack("<I", int(ip[i:i + 8], 16))
                                                          for i in range(0, 32, 8)))
    return host, int(port, 16)


def _listening_inodes() -> dict[int, tuple[str, int]]:
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # TCP_LISTEN
                out[int(f[9])] = _addr(f[1])
    return out


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket the processes listen on."""
    listening = _listening_inodes()
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in listening:
                    found.append((pid, *listening[inode]))
    return found


def job_ranks(pid: int) -> dict[int, int]:
    """local rank -> pid of the ranks of the ShadowSync job under process `pid` (`cocosync train`, torchrun): the
    processes of its tree running `-m cocosync.shadowsync`, numbered by their LOCAL_RANK, or, forked warm from the
    fork server, titled so (shadowsync/job/rank_start.py)."""
    out = {}
    for p in process_tree(pid)[1:]:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        titled = parse_title(cmd[0].decode(errors="replace"))
        if titled is not None:
            out[titled[1]] = p
        elif b"cocosync.shadowsync" in cmd:
            for var in env:
                if var.startswith(b"LOCAL_RANK="):
                    out[int(var.split(b"=", 1)[1])] = p
    return out
