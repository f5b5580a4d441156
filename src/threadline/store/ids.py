"""Fresh random ids for records the store draws (runs, messages, events, operations)."""

from __future__ import annotations

import os
import random

_ids = random.Random()  # seeded from os.urandom; reseeded in a forked child, so no two processes share it
os.register_at_fork(after_in_child=_ids.seed)
_bits = _ids.getrandbits


def new_id(prefix: str = "") -> str:
    """A fresh random id such as ``run_4f0c…`` (128 random bits in hex; without a prefix, the bits alone).

    Ids need to be unique, not secret: a generator seeded from ``os.urandom`` draws them without a system
    call each (several per turn)."""
    return f"{prefix}_{_bits(128):032x}" if prefix else f"{_bits(128):032x}"
