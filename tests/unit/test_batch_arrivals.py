"""The scheduler's record of which calls it has received in part (workaround whole-batch-admission)."""

from types import SimpleNamespace

from rollout.engine.runtime import BatchArrivals


def requests(*rids):
    return [SimpleNamespace(rid=rid) for rid in rids]


def test_a_call_is_partly_received_until_its_last_request_arrives():
    arrivals = BatchArrivals()
    arrivals.expect(["a", "b", "c"])
    assert not arrivals.partly_received
    arrivals.received(requests("a"))
    assert arrivals.partly_received
    arrivals.received(requests("b"))
    assert arrivals.partly_received
    arrivals.received(requests("c"))
    assert not arrivals.partly_received


def test_other_requests_and_calls_sent_whole_leave_nothing_to_wait_for():
    arrivals = BatchArrivals()
    first = arrivals.expect(["a", "b"])
    arrivals.received(requests("x", None) + [SimpleNamespace()] + requests("a", "b"))
    assert not arrivals.partly_received
    arrivals.withdraw(first)  # after its requests arrived: nothing left to forget
    arrivals.expect(["c"])
    arrivals.received(requests("c", "a"))  # "a" is no longer awaited
    assert not arrivals.partly_received


def test_a_call_withdrawn_before_sending_everything_is_no_longer_waited_for():
    arrivals = BatchArrivals()
    failed = arrivals.expect(["a", "b"])
    waiting = arrivals.expect(["c", "d"])
    arrivals.received(requests("a", "c"))
    arrivals.withdraw(failed)
    assert arrivals.partly_received  # "d" is still on its way
    arrivals.received(requests("b", "d"))
    assert not arrivals.partly_received
    arrivals.withdraw(waiting)


def test_an_empty_call_is_never_waited_for():
    arrivals = BatchArrivals()
    arrivals.expect([])
    arrivals.received(requests("a"))
    assert not arrivals.partly_received
