"""What each vLLM worker changes in NIXL and vLLM's NIXL connector (app/engine/nixl_worker.py)."""

import os
import threading

import pytest

from app.engine.nixl_worker import keep_cores_across


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move a thread between")
def test_a_constructor_that_pins_its_thread_leaves_it_on_the_cores_it_had():
    class PinsItsThread:  # what vLLM's NIXL connector worker does on CPU
        def __init__(self, core):
            os.sched_setaffinity(0, {core})
            self.core = core

    keep_cores_across(PinsItsThread)
    keep_cores_across(PinsItsThread)  # a second import wraps vLLM's constructor, not the wrapper
    seen = {}

    def build():  # in a thread of its own: the test process's thread keeps its cores whatever happens
        before = os.sched_getaffinity(0)
        seen["built"] = PinsItsThread(max(before)).core
        seen["cores"] = (before, os.sched_getaffinity(0))

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    before, after = seen["cores"]
    assert seen["built"] == max(before) and after == before
    assert not hasattr(PinsItsThread.__init__.__wrapped__, "__wrapped__")
