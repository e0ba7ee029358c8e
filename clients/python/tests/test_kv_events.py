"""The client with KV events on: what an engine publishes shows in selections, overlap
scores and the dump, and a booking on a worker without the prefix carries the ``kv_hint``
naming the worker that has it."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import msgpack
import pytest
import zmq

import kv_select
from conftest import Server

BLOCK = 4
PROMPT = list(range(1, 13))  # 3 blocks
WAIT_S = 10.0


class Publisher:
    """A vLLM-framed KV-event publisher: ``[topic, seq, msgpack [ts, events, rank]]`` on an
    XPUB bound to loopback, which also tells when kv-select has subscribed."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.seq = 0

    def wait_for_subscriber(self) -> None:
        assert self.socket.poll(int(WAIT_S * 1000), zmq.POLLIN), "kv-select subscribed"
        assert self.socket.recv()[:1] == b"\x01"

    def store(self, hashes: list[int], tokens: list[int]) -> None:
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                 "token_ids": tokens, "block_size": BLOCK, "medium": "GPU", "lora_name": None}
        payload = msgpack.packb([time.time(), [event], None])
        self.socket.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.socket.close()
        self.context.term()


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    p = Publisher()
    yield p
    p.close()


def wait_for(what: str, cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_published_blocks_steer_selection_and_hints(server_factory: Callable[..., Server], publisher: Publisher) -> None:
    server = server_factory(kv_events=True)
    with kv_select.Client(server.url) as c:
        source = c.upsert_worker(
            1,
            endpoint="http://10.0.0.1:8000",
            block_size=BLOCK,
            kv_events_endpoint=publisher.endpoint,
            router_hint_worker_type="decode",
            router_hint_source_control_endpoints={0: "tcp://10.0.0.1:5600"},
        )
        assert source.schedulable, source.not_schedulable_reasons
        missing = c.upsert_worker(2, endpoint="http://10.0.0.2:8000", block_size=BLOCK)
        assert missing.lifecycle == "incomplete"
        assert "kv_events endpoint is required for dp_rank 0" in missing.not_schedulable_reasons
        c.patch_worker(2, kv_events_endpoint="tcp://127.0.0.1:1", router_hint_worker_type="decode")
        publisher.wait_for_subscriber()

        publisher.store([1001, 1002, 1003], PROMPT)
        wait_for("the stored blocks indexed", lambda: c.overlap_scores(token_ids=PROMPT).workers[0].device_blocks == 3)
        scores = c.overlap_scores(token_ids=PROMPT)
        assert [(w.worker_id, w.device_blocks) for w in scores.workers] == [(1, 3), (2, 0)]
        (partition,) = c.dump().values()
        assert [b["block_hash"] for e in partition.events for b in e["event"]["data"]["stored"]["blocks"]] == [
            1001,
            1002,
            1003,
        ]

        chosen = c.select(token_ids=PROMPT)
        assert (chosen.worker_id, chosen.overlap.gpu, chosen.overlap.dp) == (1, 12, {0: 12})
        assert chosen.effective_prefill_tokens == 0

        # Booked on the worker without the prefix: the hint names the one that has it.
        with c.select_and_reserve(
            selection_id="hinted", token_ids=PROMPT, pinned_worker={"worker_id": 2, "dp_rank": 0}
        ) as handle:
            assert handle.selection is not None
            hint = handle.selection.kv_hint
            assert hint is not None
            assert (hint.protocol_version, hint.message_id) == ("0.1", "hinted")
            (action,) = hint.actions
            assert (action.action_type, action.payload["source_control_endpoint"]) == (
                "kv.fetch",
                "tcp://10.0.0.1:5600",
            )
            assert len(action.payload["block_hashes"]) == 3
        assert c.select(token_ids=PROMPT, pinned_worker={"worker_id": 2, "dp_rank": 0}).kv_hint is None, (
            "/select never carries a hint"
        )
