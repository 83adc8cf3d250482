"""The C++ loops (runtime/comm/native) behind ShmCommunicator's all_reduce: the same protocol and bits as its
Python path, which stays the reference and the fallback wherever a loop does not apply (other ops or dtypes, a
workspace too small, a peer's arena tensor read in place)."""

from __future__ import annotations

import torch

from cocosync.reduce_op import ReduceOp
from cocosync.runtime.comm.headers import Header, header, validate
from cocosync.runtime.comm.reduction import split_bounds
from cocosync.runtime.comm.shm import HEADER_FIELD, HEADER_WORDS, SEQ_FIELD, SLOT_WORDS

__all__ = ["NativeLoops", "NATIVE_DTYPES", "NATIVE_OPS"]

#: what the native one-shot all_reduce takes: dtypes (-> header code), ops (-> whether the sum is scaled by 1/world)
#: and its spin budget (past it, it waits as the Python path does)
NATIVE_DTYPES = {dt: header("all_reduce", dt, 0, ReduceOp.SUM, 0, 0, 0, (0, 0))[1]
                 for dt in (torch.float32, torch.bfloat16, torch.float16)}
NATIVE_OPS = {ReduceOp.SUM: False, ReduceOp.MEAN: True}
NATIVE_OPS_CODE = {op: header("all_reduce", torch.float32, 0, op, 0, 0, 0, (0, 0))[3] for op in NATIVE_OPS}
NATIVE_SPINS = 4096


class NativeLoops:
    """ShmCommunicator's native all_reduce paths (a mixin: they run on its flags, workspaces and topology)."""

    def _native_one_shot(self, name: str, x: torch.Tensor, target: torch.Tensor, op: ReduceOp) -> bool:
        """The one-shot all_reduce through the C++ loop (runtime/comm/native): the same protocol and bits as
        begin_call + reduce_ranges, which it falls back to (False) where it does not apply: other ops or dtypes, a
        workspace too small (growing it is collective: every rank sees the same and takes the Python path)."""
        if op not in NATIVE_OPS or x.dtype not in NATIVE_DTYPES or not target.is_contiguous():
            return False
        workspace = self._workspaces[self._calls % 2]
        if workspace is None or workspace.region_bytes < x.numel() * x.element_size():
            return False
        one_shot = self._bind_native(name, x, op)
        seq = self.flags.seq + 1
        scale = NATIVE_OPS[op] and 1.0 / self.world
        status = one_shot.run(seq, NATIVE_DTYPES[x.dtype], NATIVE_OPS_CODE[op], workspace.base,
                                    workspace.region_bytes, x, target, scale or 1.0, NATIVE_OPS[op], NATIVE_SPINS)
        self.flags.seq = seq
        self._calls += 1
        if status == 1:  # a peer is late: wait as the Python path does (it names a dead or stalled peer)
            self.flags.wait(SEQ_FIELD, seq, name)
            status = one_shot.finish(seq, workspace.base, workspace.region_bytes, target, x.numel(), scale or 1.0,
                                     NATIVE_OPS[op])
        if status == 2:
            hdrs = [Header(*h[:len(Header._fields)]) for h in self.flags.headers(seq)]
            validate(name, seq, hdrs, self.local_rank, self.groups.local_ranks_global)  # raises, naming the ranks
        return True

    def _native_three_phase(self, name: str, x: torch.Tensor, op: ReduceOp) -> bool:
        """The three-phase all_reduce of flat x in place through the C++ loop: the protocol and bits of
        _all_reduce_three_phase on one node, which it falls back to (False) for an arena x (its peers read it in
        place), a workspace too small, or other ops and dtypes."""
        if op not in NATIVE_OPS or x.dtype not in NATIVE_DTYPES:
            return False
        workspace = self._workspaces[self._calls % 2]
        if workspace is None or workspace.region_bytes < x.numel() * x.element_size() or self.arena.locate(x):
            return False
        one_shot = self._bind_native(name, x, op)
        seq = self.flags.seq + 1
        scale = 1.0 / self.world if NATIVE_OPS[op] else 1.0
        nbytes = x.numel() * x.element_size()
        args = (seq, NATIVE_DTYPES[x.dtype], NATIVE_OPS_CODE[op], workspace.base, workspace.region_bytes, x, scale,
                NATIVE_OPS[op], NATIVE_SPINS, nbytes >= self.stream_ws_bytes, nbytes >= self.stream_result_bytes)
        self.flags.seq = seq
        self._calls += 1
        status = one_shot.three_phase(0, *args)
        if status == 1:  # late peers: wait as the Python path does (naming a dead or stalled one), then go on
            self.flags.wait(SEQ_FIELD, seq, name)
            status = one_shot.three_phase(1, *args)
        if status in (2, 4):
            hdrs = [Header(*h[:len(Header._fields)]) for h in self.flags.headers(seq)]
            validate(name, seq, hdrs, self.local_rank, self.groups.local_ranks_global)  # 2: raises, naming the ranks
        if status == 4:  # a peer's vector is an arena tensor its peers read in place: go on as the Python path
            ranges = [[b] for b in split_bounds(x.numel(), self.local_size)]
            self._all_reduce_three_phase(name, x, ranges, op, self._call(name, seq, hdrs, x, x, workspace))
            return True
        self.flags.seq = seq + 1
        if status == 3:
            self.flags.wait(SEQ_FIELD, seq + 1, name + " (reduced slices published)")
            one_shot.three_phase(2, *args)
        return True

    def _bind_native(self, name: str, x: torch.Tensor, op: ReduceOp):
        if self.flags.broken is not None:
            self.flags._check_usable(name)
        if self._one_shot is None:
            template = header(name, x.dtype, 0, op, -1, -1, -1, (self.chunk_bytes, self.one_shot_bytes))
            self._one_shot = self._native.OneShot(self.flags.words.ctypes.data, SLOT_WORDS, self.local_rank,
                                                  self.local_size, SEQ_FIELD, HEADER_FIELD, HEADER_WORDS, template)
        return self._one_shot
