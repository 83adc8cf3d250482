"""Baselines for the data-parallel benchmarks, written the way a careful PyTorch user would write them today.

- ``GradBuckets``: DDP-style gradient buckets (flat buffers in reverse parameter order, ~25 MB each, the
  parameters' ``.grad`` are views into them as with ``DDP(gradient_as_bucket_view=True)``), averaged with one async
  gloo ``all_reduce`` per bucket.
- ``ForeachLAMB``: LAMB (You et al.; torch has none) with ``torch._foreach_*`` ops, the equations of
  ``cocosync.programs.lamb.lamb_reference``; the trust ratio per parameter tensor (the paper's layer-wise LAMB) or,
  with ``per_tensor=False``, one ratio over all parameters (what ``DistributedLAMB`` computes: its program's norms
  are over the flat vector).
- ``small_transformer``: the small causal-free transformer LM used for the full-train-step comparison.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["GradBuckets", "ForeachLAMB", "foreach_lamb_step", "small_transformer", "adam_fused_ok"]


def adam_fused_ok() -> bool:
    """True when torch.optim.Adam(fused=True) runs on CPU tensors in this torch (it does since torch 2.4)."""
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    try:
        torch.optim.Adam([p], fused=True).step()
        return True
    except (RuntimeError, ValueError):  # pragma: no cover - older torch
        return False


class GradBuckets:
    """Flat gradient buckets of about `bucket_bytes` each; ``p.grad`` of every parameter becomes a view of its bucket.

    ``all_reduce_mean()`` launches one async gloo all_reduce per bucket (all in flight at once, as DDP's reducer does
    when the backward pass has finished), waits for all, and divides by the world size."""

    def __init__(self, params: Iterable[torch.nn.Parameter], bucket_bytes: int = 25 << 20, group=None):
        params = [p for p in params if p.requires_grad]
        self.group = group
        self.buffers: list[torch.Tensor] = []
        bucket: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):  # DDP fills buckets in reverse order (gradients become ready back to front)
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self._make(bucket)
                bucket, size = [], 0
        if bucket:
            self._make(bucket)

    def _make(self, bucket: list[torch.nn.Parameter]) -> None:
        buf = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype)
        offset = 0
        for p in bucket:
            view = buf[offset:offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            offset += p.numel()
        self.buffers.append(buf)

    def all_reduce_mean(self) -> None:
        world = dist.get_world_size(self.group)
        works = [dist.all_reduce(b, group=self.group, async_op=True) for b in self.buffers]
        for w in works:
            w.wait()
        torch._foreach_div_(self.buffers, float(world))


def foreach_lamb_step(params: list[torch.Tensor], grads: list[torch.Tensor], ms: list[torch.Tensor],
                      vs: list[torch.Tensor], *, step: int, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                      eps: float = 1e-6, weight_decay: float = 0.0, per_tensor: bool = True) -> None:
    """One LAMB step over lists of tensors, in place, with torch._foreach ops:

    m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2;  r = (m / c1) / (sqrt(v / c2) + eps) + wd w;
    w <- w - lr * (||w|| / ||r||) r   (ratio 1 when either norm is 0).

    per_tensor: the norms (and the ratio) per tensor; False: over all the tensors together (one ratio)."""
    if not params:
        return
    b1, b2 = betas
    torch._foreach_lerp_(ms, grads, 1 - b1)
    torch._foreach_mul_(vs, b2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
    denom = torch._foreach_div(vs, 1 - b2 ** step)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    r = torch._foreach_div(ms, 1 - b1 ** step)
    torch._foreach_div_(r, denom)
    del denom
    if weight_decay:
        torch._foreach_add_(r, params, alpha=weight_decay)
    w_norm = torch.stack(torch._foreach_norm(params))
    r_norm = torch.stack(torch._foreach_norm(r))
    if not per_tensor:
        w_norm, r_norm = w_norm.norm().reshape(1), r_norm.norm().reshape(1)
    ratio = torch.where((w_norm > 0) & (r_norm > 0), w_norm / r_norm, torch.ones_like(w_norm))
    scale = ratio * -lr
    if per_tensor:
        torch._foreach_mul_(r, list(scale.unbind()))
    else:
        torch._foreach_mul_(r, scale[0])
    torch._foreach_add_(params, r)


class ForeachLAMB(torch.optim.Optimizer):
    """LAMB as a torch optimizer built on ``foreach_lamb_step``: one trust ratio per parameter tensor, or with
    ``per_tensor=False`` one per parameter group."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, *, per_tensor: bool = True):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"ForeachLAMB: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay} (need lr, eps, weight_decay >= 0 and betas in [0, 1))")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, per_tensor=per_tensor))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ps, gs, ms, vs = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                ps.append(p)
                gs.append(p.grad)
                ms.append(st["exp_avg"])
                vs.append(st["exp_avg_sq"])
            if ps:
                step = self.state[ps[0]]["step"]
                foreach_lamb_step(ps, gs, ms, vs, step=step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                  weight_decay=group["weight_decay"], per_tensor=group["per_tensor"])
        return loss


class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.0, batch_first=True,
                                                      norm_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class SmallTransformer(torch.nn.Module):
    """Token + position embeddings, `layers` pre-norm encoder layers, a final norm and an LM head."""

    def __init__(self, *, vocab: int, d: int, layers: int, seq: int, heads: int = 4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = torch.nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def small_transformer(*, vocab: int = 1024, d: int = 256, layers: int = 2, seq: int = 64, seed: int = 0,
                      heads: int = 4) -> SmallTransformer:
    """The same weights on every rank (seeded)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return SmallTransformer(vocab=vocab, d=d, layers=layers, seq=seq, heads=heads)
