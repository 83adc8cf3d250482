"""A machine joining in a lost (or awaited) one's place (job/node_join.py), its parts alone: who holds each shard, the
claims of lost machines' places in the job's store, one after another (and why one is refused), and the agreements a
claim holds until its trainers have joined. The whole join runs in tests/shadowsync/test_lost_machine.py and
test_growing_job.py."""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

from cocosync.runtime.comm.topology import Topology
from cocosync.shadowsync.job.loss_across import holders
from cocosync.shadowsync.job.membership import JOINING, JOINING_SINCE, Membership, loss_batches, record_node_loss
from cocosync.shadowsync.job.node_join import (
    ABANDONED,
    ADMITTED,
    claim_node,
    join_machines,
    joined,
    joined_nodes,
    settle_join,
    taken_in,
)
from cocosync.shadowsync.job.roles import Roles


def _store() -> dist.Store:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    return dist.PrefixStore("cocosync/", master)


def test_a_lost_machines_shards_are_dealt_out_over_the_machines_left():
    assert holders(2, 1, [[1]]) == {0: 0, 1: 0}
    assert holders(4, 2, [[1, 2]]) == {0: 0, 1: 0, 2: 0, 3: 3, 4: 0, 5: 3, 6: 3, 7: 3}
    assert holders(3, 1, []) == {0: 0, 1: 1, 2: 2}


def test_each_later_loss_deals_out_what_its_machines_held_and_leaves_the_other_shards_where_they_are():
    # node 1 lost: its shard to node 0 (the first of three holding one each); then node 3: to node 2, which holds
    # fewer than node 0 now
    assert holders(4, 1, [[1]]) == {0: 0, 1: 0, 2: 2, 3: 3}
    assert holders(4, 1, [[1], [3]]) == {0: 0, 1: 0, 2: 2, 3: 2}
    # then node 2, holding its own shard and node 3's: both to node 0, the only one left
    assert holders(4, 1, [[1], [3], [2]]) == {0: 0, 1: 0, 2: 0, 3: 0}
    # the same machines lost in other losses may place the shards apart: every machine deals the losses the trainers
    # recorded (Membership.loss_batch)
    assert holders(5, 1, [[1, 2]]) == {0: 0, 1: 0, 2: 3, 3: 3, 4: 4}
    assert holders(5, 1, [[2], [1]]) == {0: 0, 1: 3, 2: 0, 3: 3, 4: 4}


def test_a_machine_claims_the_first_lost_place_while_the_trainers_read_their_own_rows():
    store = _store()
    assert claim_node(store, 3, 2, "h") == (None, "no machine of the job is lost or awaited")
    store.set("lost-node/2", "{}")
    store.set("lost-node/1", "{}")
    node, why = claim_node(store, 3, 2, "a")  # (the first place free)
    assert (node, why) == (1, "")
    assert int(store.add(JOINING, 0)) == 2  # its two trainers hold the agreements until they join
    joined(store, 2)
    joined(store, 2)  # (once per trainer)
    joined(store, 3)
    assert int(store.add(JOINING, 0)) == 0
    node, why = claim_node(store, 3, 2, "b")  # (the machines of the job's start: node 0 alone now)
    assert (node, why) == (2, "")
    node, why = claim_node(store, 3, 2, "c")
    assert node is None and why == "every lost or awaited machine's place has been taken", why
    assert [(j.node, j.host, j.seq) for j in joined_nodes(store, 3)] == [(1, "a", 1), (2, "b", 2)]
    store = _store()  # (one machine at a time)
    for n in (1, 2):
        store.set(f"lost-node/{n}", "{}")
    assert claim_node(store, 3, 2, "a") == (1, "")
    node, why = claim_node(store, 3, 2, "b")  # (node 1's trainers have not joined yet)
    assert node is None and why.startswith("another machine is joining it now"), why


def test_a_machine_that_comes_too_late_or_to_an_ending_job_is_refused():
    store = _store()
    store.set("lost-node/1", "{}")
    store.set("agree/phase1/any", "1")
    assert claim_node(store, 2, 2, "h") == (None, "the trainers left have read their own rows and share out the "
                                                  "lost ones' (too late to join)")
    store = _store()
    store.set("lost-node/1", "{}")
    store.set("agree/end/epoch", "0")
    assert claim_node(store, 2, 2, "h") == (None, "the job is ending")


def test_the_machines_in_the_job_after_a_join_and_who_holds_each_shard():
    store = _store()
    roles = Roles(Topology(rank=0, world_size=6, local_rank=0, local_world_size=2, node=0), 1, 0)
    store.set("lost-node/1", "{}")
    assert join_machines(store, roles) == ([0, 2], {0: 0, 1: 0, 2: 2})
    store.set("lost-node/2", "{}")
    assert join_machines(store, roles) == ([0], {0: 0, 1: 0, 2: 0})
    assert claim_node(store, 3, 1, "h")[0] == 1
    assert join_machines(store, roles) == ([0, 1], {0: 0, 1: 0, 2: 0})  # (it holds no shard)
    joined(store, 1)
    assert claim_node(store, 3, 1, "h")[0] == 2
    assert join_machines(store, roles) == ([0, 1, 2], {0: 0, 1: 0, 2: 0})
    assert join_machines(store, roles, upto=1) == ([0, 1], {0: 0, 1: 0, 2: 0})  # (as the first join made it)


def test_a_join_is_taken_in_or_given_up_by_whichever_says_so_first():
    """The machines in the job admit a join before they make its groups; its trainers give it up once the trainers
    there have read their own rows with no admission. Whoever comes first settles it for everyone, and a join given
    up is no machine in the job (its place stays lost, and is not claimed again)."""
    roles = Roles(Topology(rank=0, world_size=6, local_rank=0, local_world_size=2, node=0), 1, 0)
    store = _store()
    store.set("lost-node/1", "{}")
    store.set("lost-node/2", "{}")
    assert claim_node(store, 3, 1, "h")[0] == 1
    membership = Membership(store, roles, 1, timeout=5.0)
    assert settle_join(store, 1, ADMITTED) == ADMITTED
    assert taken_in(membership, 1)
    assert settle_join(store, 1, ABANDONED) == ADMITTED  # (too late to give it up)
    joined(store, 1)
    assert claim_node(store, 3, 1, "h")[0] == 2
    store.set("agree/phase1/any", "1")  # the trainers there have read their own rows; node 2 was not admitted
    assert not taken_in(membership, 2)
    assert settle_join(store, 2, ADMITTED) == ABANDONED  # (a machine in the job that comes to admit it skips it)
    assert [j.node for j in joined_nodes(store, 3)] == [1]
    assert [j.node for j in joined_nodes(store, 3, abandoned=True)] == [1, 2]
    assert join_machines(store, roles)[0] == [0, 1]
    assert claim_node(store, 3, 1, "h")[0] is None
    # neither: the trainers there still read their own rows and no machine admitted it within the timeout
    quick = Membership(store, roles, 1, timeout=0.2)
    store.delete_key("agree/phase1/any")
    with pytest.raises(TimeoutError, match="node 3's place"):
        taken_in(quick, 3)


def test_a_claimed_join_holds_the_agreements_until_its_trainers_have_joined():
    store = _store()
    roles = Roles(Topology(rank=0, world_size=4, local_rank=0, local_world_size=2, node=0), 0, 0)
    membership = Membership(store, roles, 1, timeout=30.0)
    store.set(JOINING_SINCE, str(time.time()))
    store.add(JOINING, 1)
    for t in range(roles.trainers):
        store.set(f"agree/end/{t}", "0")
    decided: list[int | None] = []
    waiter = threading.Thread(target=lambda: decided.append(membership.agree("end", 0)))
    waiter.start()
    time.sleep(0.3)
    assert not decided  # every trainer is there, but a joining one is not yet
    joined(store, 1)
    waiter.join(10)
    assert decided == [0]
    # a claim whose trainers never came holds them no longer than the membership's timeout
    store2 = _store()
    late = Membership(store2, roles, 1, timeout=0.2)
    store2.set(JOINING_SINCE, str(time.time() - 1.0))
    store2.add(JOINING, 2)
    for t in range(roles.trainers):
        store2.set(f"agree/phase1/{t}", "0")
    assert late.agree("phase1", 0) == 0


def test_the_first_trainer_to_handle_a_loss_of_machines_decides_its_machines_for_every_machine():
    """Machines lost moments apart may be seen apart: the first word on each loss is every trainer's."""
    store = _store()
    roles = Roles(Topology(rank=0, world_size=8, local_rank=0, local_world_size=2, node=0), 1, 0)
    seen_here, seen_there = Membership(store, roles, 1, timeout=5.0), Membership(store, roles, 1, timeout=5.0)
    assert seen_here.loss_batch(1, [2, 1]) == [1, 2]
    assert seen_there.loss_batch(1, [1]) == [1, 2]  # (node 2 is handled with node 1 there too)
    assert seen_there.loss_batch(2, [3]) == [3] and seen_here.loss_batch(2, []) == [3]
    assert loss_batches(store) == [[1, 2], [3]]
    assert not seen_here.wait_for_node_loss(0, timeout=0.1)
    store.add("node-losses", 1)
    assert seen_here.wait_for_node_loss(0, timeout=0.1) and not seen_here.wait_for_node_loss(1, timeout=0.1)


def test_a_machine_is_counted_lost_once_it_is_recorded_whole():
    """A machine whose record is under way (its claim set, its trainers not yet) is not among the machines lost,
    whatever its place: the trainers left deal out the shards of the machines recorded whole."""
    store = _store()
    roles = Roles(Topology(rank=0, world_size=8, local_rank=0, local_world_size=2, node=0), 1, 0)
    membership = Membership(store, roles, 1, timeout=5.0)
    assert record_node_loss(store, roles, 3, 3.0)
    store.set("lost-node/1", json.dumps({"time": 0.0, "silent_s": 3.0}))  # (node 1's record under way)
    assert [n.node for n in membership.lost_nodes()] == [3]
    assert [(x.trainer, x.node) for x in membership.losses()] == [(3, 3)]
    assert record_node_loss(store, roles, 2, 3.1) and not record_node_loss(store, roles, 2, 3.2)
    assert [n.node for n in membership.lost_nodes()] == [2, 3]
