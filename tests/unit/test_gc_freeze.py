"""Starting the engine freezes what loading left (gc.freeze), so full collections no longer
walk the tokenizer's and the libraries' objects while the loop serves (they stalled it and
the device for 100-200 ms at 256 clients), and sets the collector's thresholds
(`--gc-threshold`) for as long as it runs."""

from __future__ import annotations

import gc

from tests.conftest import make_stories_engine


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_engine_start_freezes_what_loading_left(stories_path):
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    loaded_before = [object()]  # stands for an object made while loading
    assert _tracked(loaded_before)
    eng = make_stories_engine(stories_path, 256)
    try:
        assert gc.get_freeze_count() > 0
        assert not _tracked(loaded_before)  # in the permanent generation: never collected
        made_after = [object()]
        assert _tracked(made_after)  # what serving makes is collected as usual
        out = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "temperature": 0})
        assert len(out["output_ids"]) == 2
    finally:
        eng.shutdown()
        gc.unfreeze()


def test_engine_sets_the_gc_thresholds_while_it_runs_and_restores_them(stories_path):
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        eng = make_stories_engine(stories_path, 256)
        try:
            assert gc.get_threshold() == (50000, 10, 10)  # the default --gc-threshold
        finally:
            eng.shutdown()
        assert gc.get_threshold() == (700, 10, 10)  # the embedding program's again
        eng = make_stories_engine(stories_path, 256, gc_threshold=None)
        try:
            assert gc.get_threshold() == (700, 10, 10)  # None: left as the process has them
        finally:
            eng.shutdown()
        eng = make_stories_engine(stories_path, 256, gc_threshold=[2000])
        try:
            assert gc.get_threshold() == (2000, 10, 10)
        finally:
            eng.shutdown()
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def test_gc_threshold_is_validated():
    import pytest

    from pyserve.config import ServerArgs, ServerArgsError

    assert ServerArgs(gc_threshold=[1000, 5]).gc_threshold == (1000, 5)
    for bad in ([], [1, 2, 3, 4], [-1], [1.5], [True]):
        with pytest.raises(ServerArgsError, match="--gc-threshold: got"):
            ServerArgs(gc_threshold=bad)
