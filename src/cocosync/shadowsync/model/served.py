"""What this process serves to torch.distributed.rpc callers, by server index: RPC functions are module-level, so
the objects they act on live in module state; a call for an index not (yet) served here says so."""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Served"]

T = TypeVar("T")


class Served(Generic[T]):
    """server index -> the object answering its RPCs in this process."""

    def __init__(self, kind: str, call: str):
        self.kind, self.call = kind, call  # e.g. "embedding server", "a lookup" (for the error)
        self._by_index: dict[int, T] = {}

    def serve(self, index: int, obj: T) -> None:
        self._by_index[index] = obj

    def items(self) -> list[tuple[int, T]]:
        """What this process serves, by index."""
        return sorted(self._by_index.items(), key=lambda kv: kv[0])

    def __getitem__(self, index: int) -> T:
        obj = self._by_index.get(index)
        if obj is None:
            raise LookupError(f"{self.kind} {index} is not served by this process (served here: "
                              f"{sorted(self._by_index)}; {self.call} arrived before the server's set-up finished, "
                              "or went to the wrong worker)")
        return obj
