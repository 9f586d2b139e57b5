"""serving.heap: start-up's objects frozen out of the collector's scans; long pauses named."""

import gc
import logging

import pytest

from serving import heap


def test_settle_freezes_what_start_up_left_and_collects_its_garbage_first():  # thawed after (conftest)
    class Node:
        pass

    kept, cycle = [[] for _ in range(100)], Node()  # lists: objects the collector tracks
    cycle.self = cycle  # garbage only the collector frees
    del cycle
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    heap.settle()
    assert gc.get_freeze_count() >= len(kept)
    scanned = {id(o) for o in gc.get_objects()}  # the generations a collection scans; frozen ones are not in them
    assert not any(type(o).__name__ == "Node" for o in gc.get_objects())  # collected, not frozen
    assert not scanned & {id(k) for k in kept}
    # a later full collection leaves them frozen. (The frozen count itself may drop meanwhile: a frozen
    # object whose last reference another thread drops is freed by its refcount, frozen or not.)
    gc.collect()
    scanned = {id(o) for o in gc.get_objects()}
    assert not scanned & {id(k) for k in kept}

@pytest.fixture
def no_callbacks():
    """gc's own callbacks list (the collector holds that object) emptied for the test, then restored."""
    saved = list(gc.callbacks)
    gc.callbacks.clear()
    yield
    gc.callbacks[:] = saved


def test_long_collections_are_logged_at_debug(caplog, no_callbacks):
    with caplog.at_level(logging.DEBUG, logger="serving.heap"):
        assert heap.log_long_pauses(threshold_s=0.0)
        assert not heap.log_long_pauses(threshold_s=0.0)  # once per process
        gc.collect()
    assert "a generation-2 collection paused the host" in caplog.text


def test_no_pause_log_without_debug(no_callbacks):
    logging.getLogger("serving.heap").setLevel(logging.INFO)
    try:
        assert not heap.log_long_pauses()
    finally:
        logging.getLogger("serving.heap").setLevel(logging.NOTSET)
    assert gc.callbacks == []
