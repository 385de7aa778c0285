"""Starting the engine freezes what loading left (gc.freeze), so full collections no longer
walk the tokenizer's and the libraries' objects while the loop serves (they stalled it and
the device for 100-200 ms at 256 clients)."""

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
