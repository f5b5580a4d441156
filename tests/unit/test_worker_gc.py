"""``threadline worker`` tunes the collector once start-up is done (docs/operations.md, Throughput)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from threadline.cli.worker import GC_YOUNGEST_THRESHOLD, tune_gc


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_tuning_freezes_what_exists_and_collects_the_youngest_generation_less_often(restored_gc: None) -> None:
    alive = [[n] for n in range(1000)]  # tracked containers that exist at tuning time
    frozen = tune_gc()
    assert frozen == gc.get_freeze_count() >= len(alive)
    first = alive[0]
    assert gc.is_tracked(first) and not any(o is first for o in gc.get_objects(generation=2)), "frozen"
    assert gc.get_threshold()[0] == GC_YOUNGEST_THRESHOLD > 700
