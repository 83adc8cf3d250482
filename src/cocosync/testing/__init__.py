"""Helpers for multi-rank tests and benchmarks: RankPool (persistent local ranks on gloo at 127.0.0.1) and spawn."""

from cocosync.testing.launch import RankFailure, RankPool, free_port, spawn

__all__ = ["RankPool", "RankFailure", "spawn", "free_port"]
