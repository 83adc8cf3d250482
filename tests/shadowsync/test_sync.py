"""Each sync algorithm against a hand computation of its equations on small tensors (2 real ranks on gloo)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from cocosync.shadowsync.config import SYNC_ALGORITHMS, ConfigError, SyncConfig
from cocosync.shadowsync.sync import BMUF, EASGD, FlatParams, ModelAveraging, NoSync, ShadowThread, make_sync


def _x(rank: int) -> torch.Tensor:
    return torch.tensor([1.0, -2.0, 3.0]) * (rank + 1) + torch.tensor([0.5, 0.0, -1.0])


# ---------------------------------------------------------------- local (no collective)
def test_flat_params_views_keep_values_and_share_memory():
    lin = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in lin.parameters()]
    fp = FlatParams(lin.parameters())
    assert len(fp) == 8
    for p, b in zip(lin.parameters(), before):
        assert torch.equal(p, b) and p.is_leaf
    fp.flat.add_(1.0)
    assert torch.equal(lin.weight, before[0] + 1)
    g = fp.flatten_grads([torch.ones(2, 3), None])
    assert g.tolist() == [1.0] * 6 + [0.0, 0.0]


def test_easgd_matches_equations():
    alpha = 0.25
    x = torch.tensor([1.0, 2.0, -4.0])
    c = torch.tensor([0.0, 4.0, 4.0])
    x_ref = x - alpha * (x - c)
    c_ref = c + alpha * (x - c)
    algo = EASGD(x, SyncConfig(algorithm="fr-easgd", alpha=alpha), center=c)
    assert algo.sync() == 1
    assert torch.allclose(x, x_ref) and torch.allclose(c, c_ref)
    assert algo.sync(active=False) == 0


def test_easgd_two_trainers_share_one_center():
    cfg = SyncConfig(algorithm="shadow-easgd", alpha=0.5)
    c = torch.zeros(2)
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 4.0])
    EASGD(a, cfg, center=c).sync()  # a -> [1,0], c -> [1,0]
    EASGD(b, cfg, center=c).sync()  # diff = b - c = [-1,4]: b -> [0.5,2], c -> [0.5,2]
    assert a.tolist() == [1.0, 0.0] and b.tolist() == [0.5, 2.0] and c.tolist() == [0.5, 2.0]


def test_easgd_alpha_defaults_to_two_over_t_in_the_shadow_and_reaches_the_update():
    """shadow-easgd: min(0.5, 2/T) (0.5 up to T=4, 0.25 at 8, 0.125 at 16; BENCHMARKS.md); fr-easgd 0.5 at every T;
    a value set wins; make_sync hands the job's T to EASGD, whose update uses it (not 0.5)."""
    shadow, fr = SyncConfig(algorithm="shadow-easgd"), SyncConfig(algorithm="fr-easgd")
    assert [shadow.alpha_for(t) for t in (1, 2, 4, 8, 16)] == [0.5, 0.5, 0.5, 0.25, 0.125]
    assert [fr.alpha_for(t) for t in (2, 8, 16)] == [0.5, 0.5, 0.5]
    assert SyncConfig(algorithm="shadow-easgd", alpha=0.9).alpha_for(16) == 0.9
    x, c = torch.tensor([8.0, 0.0]), torch.zeros(2)
    algo = make_sync(x, shadow, center=c, trainers=8)
    assert isinstance(algo, EASGD) and algo.alpha == 0.25
    algo.sync()
    assert x.tolist() == [6.0, 0.0] and c.tolist() == [2.0, 0.0]  # a quarter of the way, each
    for bad in (0, 1.5, "0.5", float("nan")):
        with pytest.raises(ConfigError, match="sync.alpha"):
            SyncConfig(algorithm="shadow-easgd", alpha=bad)


def test_none_changes_nothing_and_make_sync_dispatches():
    x = torch.ones(3)
    assert NoSync(x, SyncConfig(algorithm="none")).sync() == 1 and x.tolist() == [1.0] * 3
    assert isinstance(make_sync(x, SyncConfig(algorithm="shadow-ma")), ModelAveraging)
    assert isinstance(make_sync(x, SyncConfig(algorithm="fr-bmuf")), BMUF)
    assert isinstance(make_sync(x, SyncConfig(algorithm="fr-easgd"), center=torch.zeros(3)), EASGD)
    with pytest.raises(ValueError, match="center"):
        make_sync(x, SyncConfig(algorithm="shadow-easgd"))


def test_single_process_ma_and_bmuf_are_well_defined():
    x = torch.tensor([1.0, 2.0])
    assert ModelAveraging(x, SyncConfig(algorithm="fr-ma")).sync() == 1 and x.tolist() == [1.0, 2.0]
    bmuf = BMUF(x, SyncConfig(algorithm="fr-bmuf"))  # default momentum 0 for one trainer
    assert bmuf.momentum == 0.0
    x.add_(1.0)
    bmuf.sync()
    assert x.tolist() == [2.0, 3.0]  # block_lr 1, no momentum: BMUF is plain averaging


# ---------------------------------------------------------------- 2 ranks (gloo)
def _ma_rank():
    x = _x(dist.get_rank())
    n = ModelAveraging(x, SyncConfig(algorithm="fr-ma")).sync()
    return x.tolist(), n


def test_ma_matches_mean(rank_pool):
    ref = ((_x(0) + _x(1)) / 2).tolist()
    for x, n in rank_pool(2).run(_ma_rank):
        assert x == pytest.approx(ref) and n == 2


def _bmuf_rank(momentum, lr, nesterov):
    r = dist.get_rank()
    x = torch.zeros(3)
    algo = BMUF(x, SyncConfig(algorithm="fr-bmuf", block_momentum=momentum, block_lr=lr, nesterov=nesterov))
    out = []
    for step in (1, 2):
        x.add_(_x(r) * step)  # local training moves the replica
        n = algo.sync()
        out.append((x.tolist(), algo.global_params.tolist(), algo.delta.tolist(), n))
    return out


@pytest.mark.parametrize("nesterov", [False, True])
def test_bmuf_matches_equations(rank_pool, nesterov):
    m, lr = 0.5, 0.8
    g, d, start = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    local = [torch.zeros(3), torch.zeros(3)]
    ref = []
    for step in (1, 2):
        for r in (0, 1):
            local[r] = local[r] + _x(r) * step
        avg = (local[0] + local[1]) / 2
        d = m * d + lr * (avg - start)  # classic: start == g; Nesterov: the look-ahead the block began at
        g = g + d
        x = g + m * d if nesterov else g.clone()
        start = x.clone()
        local = [x.clone(), x.clone()]
        ref.append((x, g.clone(), d.clone()))
    for rank_out in rank_pool(2).run(_bmuf_rank, m, lr, nesterov):
        for (x, g_, d_, n), (xr, gr, dr) in zip(rank_out, ref):
            assert x == pytest.approx(xr.tolist()) and g_ == pytest.approx(gr.tolist())
            assert d_ == pytest.approx(dr.tolist()) and n == 2


def _done_protocol_rank(method):
    """rank 0 trains for 3 rounds, rank 1 for 1: both must run the same number of collectives and stop together."""
    r = dist.get_rank()
    x = torch.zeros(4)  # trainers start from common parameters (the trainer guarantees it)
    algo = make_sync(x, SyncConfig(algorithm=f"fr-{method}"))
    rounds, counts = 0, []
    my_rounds = 3 if r == 0 else 1
    while True:
        if rounds < my_rounds:
            x.add_(r + 1.0)  # local training
        n = algo.sync(active=rounds < my_rounds)
        counts.append(n)
        rounds += 1
        if n == 0:
            return counts, x.tolist()


@pytest.mark.parametrize("method", ["ma", "bmuf"])
def test_finished_trainer_keeps_joining_until_all_are_done(rank_pool, method):
    (c0, x0), (c1, x1) = rank_pool(2).run(_done_protocol_rank, method)
    assert c0 == c1 == [2, 1, 1, 0]
    assert x0 == pytest.approx(x1)  # the final round leaves every trainer on the same (global) model


def _shadow_ma_rank():
    """Shadow thread syncing while a 'worker' keeps adding +1: no worker update may be lost (delta write-back)."""
    r = dist.get_rank()
    x = torch.zeros(1000)
    done = threading.Event()
    iters = [0]
    shadow = ShadowThread(ModelAveraging(x, SyncConfig(algorithm="shadow-ma")), interval=0.0,
                          is_active=lambda: not done.is_set(), iterations=lambda: iters[0]).start()
    steps = 200 if r == 0 else 100
    for _ in range(steps):
        x.add_(1.0)
        iters[0] += 1
        time.sleep(0.001)
    done.set()
    assert shadow.join(30) and shadow.error is None
    return x.mean().item(), shadow.active_syncs, shadow.algorithm.syncs


def test_shadow_ma_keeps_every_worker_update(rank_pool):
    (m0, a0, s0), (m1, a1, s1) = rank_pool(2).run(_shadow_ma_rank)
    # sum of all updates is conserved by averaging: (200 + 100) / 2 per element, and both end equal. Within 2:
    # the worker's add_ and the write-back's add_ may meet on an element (Hogwild: rare, at most one update
    # each), while a write-back that overwrote x (x = average) would drop every update made during a sync
    assert abs(m0 - 150.0) <= 2.0 and m0 == pytest.approx(m1)
    assert a0 >= 2 and s0 == s1  # both ranks ran the same number of collectives


def test_shadow_thread_surfaces_errors():
    class Boom(NoSync):
        def _sync(self, active):
            raise RuntimeError("peer vanished")

    sh = ShadowThread(Boom(torch.zeros(2), SyncConfig(algorithm="none")), interval=0.0, is_active=lambda: True)
    sh.start()
    assert sh.join(5)
    assert isinstance(sh.error, RuntimeError)


def test_bmuf_default_block_momentum_is_measured_rule_of_trainers_and_block_length():
    """1 - 1/sqrt(T) in shadow mode; foreground scaled by 1 - 1/every (none for one-iteration blocks); a value set
    wins; one trainer gets none (T=1 runs no sync: changes_nothing_alone)."""
    import math

    from cocosync.shadowsync.sync.factory import changes_nothing_alone

    shadow = SyncConfig(algorithm="shadow-bmuf")
    assert shadow.momentum_for(1) == 0.0 and changes_nothing_alone(shadow)
    assert math.isclose(shadow.momentum_for(2), 1 - 1 / math.sqrt(2))
    assert math.isclose(shadow.momentum_for(16), 0.75)
    assert SyncConfig(algorithm="fr-bmuf", every=1).momentum_for(8) == 0.0
    assert math.isclose(SyncConfig(algorithm="fr-bmuf").momentum_for(8), (1 - 1 / math.sqrt(8)) * (1 - 1 / 8))
    assert math.isclose(SyncConfig(algorithm="fr-bmuf", every=4).momentum_for(4), 0.5 * 0.75)
    assert SyncConfig(algorithm="shadow-bmuf", block_momentum=0.9).momentum_for(8) == 0.9
    assert not changes_nothing_alone(SyncConfig(algorithm="shadow-bmuf", block_momentum=0.5))


def test_foreground_sync_period_is_the_measured_default_unless_set():
    """fr-bmuf syncs every 8 iterations, fr-ma and fr-easgd every 4 (T=8 measurements, BENCHMARKS.md); a value set
    wins, for every algorithm; the shadow algorithms and none have no period (1); 0, a float or a string is refused."""
    assert {alg: SyncConfig(algorithm=alg).iterations_per_sync for alg in SYNC_ALGORITHMS} == {
        **{alg: 1 for alg in SYNC_ALGORITHMS}, "fr-bmuf": 8, "fr-ma": 4, "fr-easgd": 4}
    assert SyncConfig(algorithm="fr-bmuf", every=1).iterations_per_sync == 1
    assert SyncConfig(algorithm="fr-dssync", every=3).iterations_per_sync == 3
    for bad in (0, -2, 2.5, "4", True):
        with pytest.raises(ConfigError, match="sync.every"):
            SyncConfig(algorithm="fr-ma", every=bad)


def test_replica_lr_scale_is_one_unless_set_and_refuses_bad_values():
    """1 by default for every algorithm (1/sqrt(T) helped shadow-bmuf at 400k examples and hurt it at 1.6M:
    BENCHMARKS.md); a value set wins; 0, a negative, a string or NaN is refused naming the field."""
    for alg in ("shadow-bmuf", "shadow-ma", "shadow-easgd", "fr-bmuf", "fr-ma", "shadow-dssync", "none"):
        assert SyncConfig(algorithm=alg).replica_lr_scale == 1.0, alg
    assert SyncConfig(algorithm="shadow-bmuf", replica_lr_scale=0.25).replica_lr_scale == 0.25
    for bad in (0, -1.0, "0.5", float("nan"), None):
        with pytest.raises(ValueError, match="sync.replica_lr_scale"):
            SyncConfig(replica_lr_scale=bad)
