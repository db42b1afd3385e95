"""rollout/engine/start_up.py: engine start-ups in one process take turns."""

import threading

from rollout.engine import start_up


def test_start_ups_take_turns():
    inside, entered_second = threading.Event(), threading.Event()
    release = threading.Event()

    def first():
        with start_up.engine_start_up("first", None):
            inside.set()
            release.wait(10)

    def second():
        with start_up.engine_start_up("second", None) as second_start_up:
            assert second_start_up.name == "second"
            entered_second.set()

    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=second)
    b.start()
    assert not entered_second.wait(0.5), "a second start-up ran while the first was running"
    release.set()
    a.join()
    b.join()
    assert entered_second.is_set()
    assert start_up.current_start_up() is None
