"""The autotuner: legal schedules of a program (space), the oracle's check (oracle), timing on ranks (measure), a
cost model (cost), the choice and its cache (tuner), `cocosync tune` (cli)."""

from cocosync.tune.tuner import TuneResult, autotune

__all__ = ["autotune", "TuneResult"]
