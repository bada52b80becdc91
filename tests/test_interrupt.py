"""Ctrl-C inside a stop_requests block: the first asks the loop to stop, the second stops it at once."""

import os
import signal
import threading

import pytest

from mpipe_tune.interrupt import stop_requests


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


def test_the_first_ctrl_c_is_a_request_and_the_second_raises():
    with stop_requests() as stop:
        ctrl_c()
        assert stop.requested and not stop.forced
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
        assert stop.forced
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # outside the block Ctrl-C means what it always did
        ctrl_c()


def test_off_the_main_thread_ctrl_c_keeps_its_meaning():
    seen = {}

    def body():
        with stop_requests() as stop:
            seen["handler"] = signal.getsignal(signal.SIGINT)
            seen["requested"] = stop.requested

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert seen == {"handler": signal.default_int_handler, "requested": False}
