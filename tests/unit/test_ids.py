"""``new_id``: 128 random bits per id, and a forked child never draws the ids its parent draws next."""

from __future__ import annotations

import os
import re

import pytest

from threadline.store.aggregate import new_id


def test_ids_are_128_bits_of_hex_after_their_prefix_and_do_not_repeat() -> None:
    ids = [new_id("run") for _ in range(10_000)]
    assert all(re.fullmatch(r"run_[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert re.fullmatch(r"[0-9a-f]{32}", new_id())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX only")
def test_a_forked_child_draws_other_ids_than_its_parent() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first ids, to the parent
        try:
            os.write(write, " ".join(new_id() for _ in range(4)).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        child = os.read(read, 1024).decode().split()
    finally:
        os.close(read)
    parent = [new_id() for _ in range(4)]  # what an unreseeded child would have drawn too
    assert len(child) == 4 and not set(child) & set(parent)
