"""Call numbering (echo_vllm.numbering): the one counter the vLLM tracker,
the emulation and training's chains share."""

import pytest

from echo_vllm.numbering import NO_PASS, CallCounter, CallSlot


def _pass(counter, n, **start):
    counter.start(**start)
    return [counter.next() for _ in range(n)]


def test_indices_restart_per_pass_and_the_count_is_learned():
    c = CallCounter()
    first = _pass(c, 3)
    assert [s.index for s in first] == [0, 1, 2] and not any(s.last_call for s in first)
    assert [s.first_of_forward for s in first] == [True, False, False]
    assert c.start() == 3 and c.calls_per_pass == 3  # learned when the pass closed
    second = [c.next() for _ in range(3)]
    assert [s.last_call for s in second] == [False, False, True]
    # a later pass with another count does not replace the learned one
    _pass(c, 5)
    assert c.end() == 5 and c.calls_per_pass == 3


def test_declared_counts_and_calls_outside_a_pass():
    c = CallCounter(calls_per_pass=2)
    assert c.next() is NO_PASS  # before any pass: no index, nothing counted
    assert [s.last_call for s in _pass(c, 2)] == [False, True]
    assert c.end() == 2 and c.next() is NO_PASS and c.end() is None
    # a pass that declares its own count (training's chains)
    assert [s.last_call for s in _pass(c, 4, calls=4)] == [False, False, False, True]
    c.calls_per_pass += 1  # a count that grows while the pass runs (the backward chain)
    assert c.next().last_call
    # a resumed pass continues its numbering
    assert [s.index for s in _pass(c, 2, at=7)] == [7, 8]


def test_an_empty_pass_teaches_nothing():
    c = CallCounter()
    c.start()
    assert c.end() == 0 and c.calls_per_pass is None


def test_side_calls_take_no_number():
    """A side call (outside the residual stream) gets the pass's position
    without taking it: the next residual call has the index it would have
    had without it, and the pass's count is the residual calls'."""
    c = CallCounter()
    assert c.side() is NO_PASS
    c.start()
    a, side, b = c.next(), c.side(), c.next()
    assert (a.index, side.index, b.index) == (0, 1, 1) and not side.last_call and not side.first_of_forward
    assert c.end() == 2 and c.calls_per_pass == 2
    c.start()
    c.next()
    assert not c.side().last_call and c.next().last_call


@pytest.mark.parametrize("fields, named", [((-1,), "index=-1"), ((3.5,), "index=3.5"), ((float("nan"),), "index=nan"),
                                           ((True,), "index=True"), (("3",), "index='3'"),
                                           ((3, "no"), "last_call='no'"), ((3, False, 1), "first_of_forward=1")])
def test_a_slot_the_policy_would_misread_is_refused_by_name(fields, named):
    """-1 and 3.5 were compared as positions (-1: Echo at first_exact_calls=0,
    never carrying), "no" read as the last call, "3" failed inside the policy."""
    with pytest.raises(ValueError, match=f"CallSlot {named}"):
        CallSlot(*fields)


def test_every_slot_the_counter_gives_is_valid():
    c = CallCounter(2)
    assert _pass(c, 3)[-1] == CallSlot(2, False, False) and CallSlot(2**40).index == 2**40 and NO_PASS.index is None
