"""The party's turn (secure_vfl.federation.network._Turn): which thread runs a party's code over
the network. Real threads, no network; every wait here is bounded, so a broken rule fails the
test rather than hanging it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from secure_vfl.errors import TransportError
from secure_vfl.federation.network import _Turn

SECONDS = 10.0  # what a thread gets before the test calls it stuck


def _thread(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _until(condition: Callable[[], bool]) -> None:
    end = time.monotonic() + SECONDS
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_delivery_waits_for_the_home_threads_first_wait_and_runs_in_line() -> None:
    turn = _Turn(SECONDS)
    log: list[str] = []
    acted: list[bool] = []
    first = _thread(lambda: acted.append(turn.act(lambda: log.append("A"), SECONDS)))
    time.sleep(0.2)
    assert log == []  # nobody has waited yet: the party may still be setting up
    with turn.entered():  # the home thread claims the turn...
        time.sleep(0.1)
        second = _thread(lambda: acted.append(turn.act(lambda: log.append("B"), SECONDS)))
        time.sleep(0.2)
        assert log == []  # ...and holds it between its waits
        assert turn.wait(lambda: len(log) == 2, SECONDS)  # both act while it waits, in order
    first.join(SECONDS)
    second.join(SECONDS)
    assert log == ["A", "B"] and acted == [True, True]


def test_waits_end_in_the_order_of_a_call_stack() -> None:
    """The home thread's wait is ready while a delivery it let in still waits (a reply sent
    detached, say): the home thread runs on only once the inner wait has ended, as on one
    thread the inner call would return first."""
    turn = _Turn(SECONDS)
    outer, inner = threading.Event(), threading.Event()
    log: list[str] = []

    def handler() -> None:
        log.append("inner starts")
        assert turn.wait(inner.is_set, SECONDS)
        log.append("inner ends")

    with turn.entered():
        parked = turn.park(outer.is_set)
        delivery = _thread(lambda: turn.act(handler, SECONDS))
        _until(lambda: log == ["inner starts"])
        outer.set()
        turn.poke()

        def release_inner() -> None:
            time.sleep(0.3)
            log.append("inner released")
            inner.set()
            turn.poke()

        _thread(release_inner)
        assert turn.resume(parked)
        log.append("outer resumes")
    delivery.join(SECONDS)
    assert log == ["inner starts", "inner released", "inner ends", "outer resumes"]


def test_a_due_wait_goes_before_the_deliveries_in_line() -> None:
    turn = _Turn(SECONDS)
    log: list[str] = []
    with turn.entered():
        ready = threading.Event()
        parked = turn.park(ready.is_set)
        blocker = threading.Event()
        # One delivery holds the turn; another queues behind it.
        _thread(lambda: turn.act(lambda: (log.append("A"), blocker.wait(SECONDS)), SECONDS))
        _until(lambda: log == ["A"])
        _thread(lambda: turn.act(lambda: log.append("B"), SECONDS))
        time.sleep(0.1)
        ready.set()  # due while A holds the turn and B is in line
        blocker.set()
        turn.resume(parked)
        log.append("home")
        time.sleep(0.1)
        assert log == ["A", "home"]  # B waits for the home thread's next wait
        assert turn.wait(lambda: "B" in log, SECONDS)
    assert log == ["A", "home", "B"]


def test_another_thread_takes_the_turn_while_the_home_thread_waits_and_gives_it_back() -> None:
    turn = _Turn(SECONDS)
    log: list[str] = []

    def guest() -> None:
        with turn.entered():
            log.append("guest")
            assert turn.wait(lambda: True, SECONDS)  # a wait of its own, nested
            log.append("guest again")

    with turn.entered():
        done = threading.Event()
        parked = turn.park(done.is_set)
        _thread(guest).join(SECONDS)
        assert log == ["guest", "guest again"]
        done.set()
        assert turn.resume(parked)  # the turn is free again: the home thread takes it
        delivery = _thread(lambda: turn.act(lambda: log.append("delivery"), SECONDS))
        time.sleep(0.1)
        assert "delivery" not in log  # the home thread holds it again
        assert turn.wait(lambda: "delivery" in log, SECONDS)
    delivery.join(SECONDS)


def test_a_delivery_that_cannot_get_the_turn_in_time_or_after_closing_is_not_acted_on() -> None:
    turn = _Turn(SECONDS)
    acted: list[str] = []
    with turn.entered():
        start = time.monotonic()
        assert not turn.act(lambda: acted.append("late"), 0.2)  # the home thread never waits
        assert 0.15 < time.monotonic() - start < SECONDS
        result: list[bool] = []
        waiting = _thread(lambda: result.append(turn.act(lambda: acted.append("x"), SECONDS)))
        time.sleep(0.1)
        turn.close()
        waiting.join(SECONDS)
    assert result == [False] and acted == []
    with pytest.raises(TransportError, match="closed"):
        _run_as_guest(turn)


def test_another_thread_gives_up_on_the_turn_the_home_thread_does_not_free() -> None:
    turn = _Turn(0.2)
    with turn.entered():
        start = time.monotonic()
        with pytest.raises(TransportError, match=r"did not come within 0\.2 s"):
            _run_as_guest(turn)
        assert time.monotonic() - start < SECONDS


def _run_as_guest(turn: _Turn) -> None:
    errors: list[BaseException] = []

    def guest() -> None:
        try:
            with turn.entered():
                pass
        except BaseException as error:
            errors.append(error)

    _thread(guest).join(SECONDS)
    if errors:
        raise errors[0]
