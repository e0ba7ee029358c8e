"""The stand-in engine's KV events, checked through kv-select's index (no Ray needed): what
the engine stores, evicts and clears is what the selector ends up indexing, under the
engine's own block hashes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

import kv_select
from driver import start_server, stop_server
from engine import Engine, block_hashes

BLOCK = 4
WAIT_S = 10.0


@pytest.fixture
def kv() -> Iterator[kv_select.Client]:
    binary = os.environ.get("KV_SELECT_SERVER") or str(
        Path(__file__).resolve().parents[2] / "target" / "debug" / "select-server"
    )
    process, url, log_dir = start_server(binary)
    try:
        with kv_select.Client(url) as client:
            yield client
    finally:
        stop_server(process, log_dir)


def wait_for(what: str, cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT_S}s waiting for {what}")
        time.sleep(0.02)


def cached(kv: kv_select.Client, prompt: list[int]) -> int:
    (row,) = kv.overlap_scores(token_ids=prompt).workers
    return row.device_blocks


def test_block_hashes_chain_like_vllms() -> None:
    a = block_hashes(list(range(1, 14)), BLOCK)
    assert len(a) == 3, "complete blocks only"
    b = block_hashes(list(range(1, 9)) + [99, 98, 97, 96], BLOCK)
    assert a[:2] == b[:2] and a[2] != b[2], "a block's hash covers its whole prefix"
    assert all(0 <= h < 2**64 for h in a)


def test_stores_evictions_and_clears_reach_the_index(kv: kv_select.Client) -> None:
    engine = Engine(1, BLOCK, capacity_blocks=4, prefill_s_per_block=0.0)
    try:
        record = kv.upsert_worker(
            1, endpoint="ray://engine-1", block_size=BLOCK, kv_events_endpoint=engine.endpoint()
        )
        assert record.schedulable, record.not_schedulable_reasons
        assert engine.wait_for_subscriber(WAIT_S), "kv-select subscribed to the engine"

        a = list(range(1, 13))  # 3 blocks
        assert engine.serve(a) == {"hit_blocks": 0, "prompt_blocks": 3, "worker_id": 1}
        wait_for("a's 3 blocks indexed", lambda: cached(kv, a) == 3)
        (partition,) = kv.dump().values()
        indexed = [b["block_hash"] for e in partition.events for b in e["event"]["data"]["stored"]["blocks"]]
        assert indexed == block_hashes(a, BLOCK), "indexed under the engine's block hashes"
        assert engine.serve(a)["hit_blocks"] == 3

        # 3 + 2 blocks in a cache of 4: a's leaf block goes, its shared prefix stays.
        b = [50, 51, 52, 53, 54, 55, 56, 57]
        assert engine.serve(b)["hit_blocks"] == 0
        wait_for("b stored and a's leaf removed", lambda: (cached(kv, b), cached(kv, a)) == (2, 2))
        assert kv.select(token_ids=a).overlap.gpu == 2 * BLOCK

        engine.clear()
        wait_for("AllBlocksCleared applied", lambda: (cached(kv, a), cached(kv, b)) == (0, 0))
        assert engine.stats() == {"worker_id": 1, "served": 3, "cached_blocks": 0}
    finally:
        engine.close()
