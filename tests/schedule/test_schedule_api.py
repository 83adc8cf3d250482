"""The chaining Schedule API: user nodes as handles, printable directives, replay."""

import cocosync as cs
from cocosync import Local
from cocosync.schedule import AsSlice, Fuse, Reorder, Schedule, Split, replay


def test_user_nodes_are_handles_across_passes():
    g, w, m = cs.Tensor("g", 8, layout=Local), cs.Tensor("w", 8), cs.Tensor("m", 8)
    g1 = cs.all_reduce(g, "mean")
    m_sum = m * 0.9 + g1
    m1 = cs.update(m, m_sum)
    w_next = w - m1 * 0.1
    p = cs.Program("mom", [g, w, m], [cs.update(w, w_next), m1])
    s = Schedule(p)
    rs, ag = s.split(g1)
    s.reorder([m_sum, m_sum.args[0], m1, w_next, w_next.args[1]], ag)
    s.as_slice([m])
    s.fuse([st.name for st in s.program.stages])
    assert [type(d) for d in s.directives] == [Split, Reorder, AsSlice, Fuse]
    assert str(s).splitlines()[1:3] == ["  split(all_reduce1)", "  reorder([add1, mul1, m_new, sub1, mul2], "
                                        "all_reduce1_ag)"]
    assert s.program.stage(m_sum).layout == cs.Sliced(0)  # the user's node still resolves after three passes
    assert str(replay(p, s.directives)) == str(s.program)
    assert str(Schedule(p, s.directives).program) == str(s.program)
