"""FlatParams: CoCoNeT's "scattered tensors" -- many parameters of any shapes as views of two flat buffers.

One flat buffer holds every parameter (concatenated in order, then zero padding up to a multiple of the world
size), another the gradients in the same layout; both are allocated in the shared-memory arena when there is
one, so the fused collectives read and write them in place. Each ``p.data`` and ``p.grad`` is rebound to its view:
autograd accumulates into an existing ``.grad`` in place, so gradients land in the flat buffer with no copy per
step, and the optimizer's all-gather writes the new parameters straight into the tensors the model reads.

Someone may replace a view behind our back (``model.zero_grad()`` sets ``.grad`` to None by default, after which
backward allocates a fresh gradient; ``p.data = t``): `sync` notices, copies the values into the flat buffer and
rebinds the view. That costs one copy for that step only.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["FlatParams"]

Alloc = Callable[[int, torch.dtype], torch.Tensor]


def _plain_alloc(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(n, dtype=dtype)


class FlatParams:
    """Flat parameter and gradient buffers for `params`, with each parameter's ``.data``/``.grad`` a view of them.

    Args:
        params: the parameters (one dtype, on CPU, dense).
        multiple: the flat length is padded with zeros up to a multiple of this (the world size).
        alloc: ``alloc(numel, dtype)`` -> a new 1-D tensor (e.g. ``arena.empty``; collective then: every rank
            builds its FlatParams with the same parameter shapes in the same order).
    """

    def __init__(self, params: Sequence[torch.Tensor], multiple: int = 1, alloc: Alloc | None = None,
                 param_alloc: Alloc | None = None):
        params = list(params)
        if not params:
            raise ValueError("FlatParams: no parameters")
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) != 1:
            raise TypeError(f"FlatParams: all parameters must have one dtype, got {dtypes}; convert the model "
                            "(model.to(dtype)) or use one optimizer per dtype")
        bad = [i for i, p in enumerate(params) if p.device.type != "cpu" or p.is_sparse or not p.is_floating_point()]
        if bad:
            p = params[bad[0]]
            raise TypeError(f"FlatParams: parameter {bad[0]} is {p.dtype} on {p.device} (sparse={p.is_sparse}); "
                            "expected dense floating-point CPU tensors")
        if multiple < 1:
            raise ValueError(f"FlatParams: multiple={multiple} must be >= 1")
        alloc = alloc or _plain_alloc
        self.params = params
        self.dtype = params[0].dtype
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for k in self.numels:
            self.offsets.append(self.offsets[-1] + k)
        self.numel = self.offsets[-1]  # without padding
        self.padded = -(-self.numel // multiple) * multiple
        self.flat = (param_alloc or alloc)(self.padded, self.dtype)  # param_alloc: e.g. one copy per node
        self.grad = alloc(self.padded, self.dtype)
        self.flat.zero_()
        self.grad.zero_()
        self._pviews = [self.view(self.flat, i) for i in range(len(params))]
        self._gviews = [self.view(self.grad, i) for i in range(len(params))]
        with torch.no_grad():
            for p, pv, gv in zip(params, self._pviews, self._gviews):
                pv.copy_(p.data)
                if p.grad is not None:
                    gv.copy_(p.grad)
                p.data = pv
                p.grad = gv

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's view of a flat buffer (shape of the parameter)."""
        return flat[self.offsets[i]:self.offsets[i + 1]].view(self.shapes[i])

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat (unpadded or padded) tensor as one view per parameter."""
        return [self.view(flat, i) for i in range(len(self.params))]

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """An unpadded flat tensor, zero-padded to the flat length."""
        if flat.numel() != self.numel:
            raise ValueError(f"expected {self.numel} elements, got {flat.numel()}")
        return torch.cat([flat.reshape(-1), flat.new_zeros(self.padded - self.numel)])

    @staticmethod
    def _same(t: torch.Tensor | None, view: torch.Tensor) -> bool:
        return (t is not None and t.data_ptr() == view.data_ptr() and t.dtype == view.dtype
                and t.shape == view.shape and t.stride() == view.stride())

    @torch.no_grad()
    def sync(self) -> None:
        """Make every ``p.data``/``p.grad`` a view of the flat buffers again, copying values someone put elsewhere
        (a None gradient counts as zeros)."""
        for p, pv, gv in zip(self.params, self._pviews, self._gviews):
            if not self._same(p.data, pv):
                pv.copy_(p.data)
                p.data = pv
            if not self._same(p.grad, gv):
                if p.grad is None:
                    gv.zero_()
                else:
                    if p.grad.is_sparse:
                        raise TypeError("sparse gradients are not supported")
                    gv.copy_(p.grad)
                p.grad = gv

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero all gradients at once, keeping ``p.grad`` the views of the flat buffer."""
        self.grad.zero_()
        for p, gv in zip(self.params, self._gviews):
            if not self._same(p.grad, gv):
                p.grad = gv
