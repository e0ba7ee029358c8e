"""A stand-in inference engine: a prefix-cached KV block store that publishes real KV events.

Each engine keeps an LRU cache of KV blocks keyed by vLLM-style chained block hashes. Serving
a prompt reuses the longest cached prefix of its complete blocks (those are the prefix hits
the engine reports), stores the rest, evicts least-recently-used blocks when full, and
publishes what changed on a ZMQ socket in vLLM's wire format (kv-events.md §3-§5): a
3-frame message ``[topic, seq (8-byte big-endian), msgpack batch]`` whose batch is
``[ts, [events...], data_parallel_rank]`` and whose events are ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` maps, as vLLM 0.33 emits them. kv-select subscribes
to that socket and indexes the blocks, exactly as it would with vLLM.

The socket is an XPUB bound to 127.0.0.1: it speaks PUB to kv-select's SUB and also reports
the subscription, so the engine can wait until the selector listens before its first event
(the ZMQ slow-joiner problem) instead of sleeping and hoping.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from typing import Any, Sequence

import msgpack
import zmq

_ROOT = b"kv-select-example-root"


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the complete blocks (parent hash + tokens), unsigned 64-bit, like
    vLLM's integer block hashes: a block's hash identifies its whole prefix."""
    hashes: list[int] = []
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(parent + struct.pack(f"<{block_size}I", *block), digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        parent = digest
    return hashes


class KvEventPublisher:
    """vLLM's framing on an XPUB socket bound to ``tcp://127.0.0.1:<random port>``."""

    def __init__(self, dp_rank: int = 0) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.LINGER, 1000)
        # Without this, a second subscriber (the server re-registering the worker) would
        # not be reported and wait_for_subscriber could not see it.
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._seq = 0
        self._dp_rank = dp_rank

    def wait_for_subscriber(self, timeout_s: float) -> bool:
        """Whether a subscription arrived within ``timeout_s`` (kv-select's listener
        subscribes to everything: an empty-prefix subscribe frame ``b"\\x01"``)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self._socket.poll(int(left * 1000) + 1, zmq.POLLIN):
                frame = self._socket.recv()
                if frame[:1] == b"\x01":
                    return True
        return False

    def publish(self, events: list[dict[str, Any]]) -> None:
        payload = msgpack.packb([time.time(), events, self._dp_rank], use_bin_type=True)
        self._socket.send_multipart([b"", self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def close(self) -> None:
        self._socket.close()
        self._context.term()


class Engine:
    """The engine a Ray actor wraps (``ray.remote(Engine)``); also usable without Ray."""

    def __init__(self, worker_id: int, block_size: int, capacity_blocks: int, prefill_s_per_block: float) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.capacity = capacity_blocks
        self.prefill_s_per_block = prefill_s_per_block
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._publisher = KvEventPublisher()
        self.served = 0

    def endpoint(self) -> str:
        return self._publisher.endpoint

    def wait_for_subscriber(self, timeout_s: float) -> bool:
        return self._publisher.wait_for_subscriber(timeout_s)

    def serve(self, token_ids: list[int]) -> dict[str, int]:
        """Prefills ``token_ids``: reuses the cached prefix, computes (sleeps for) the rest,
        publishes the stored and evicted blocks. Returns the prefix hit in blocks."""
        chain = block_hashes(token_ids, self.block_size)
        hit = 0
        while hit < len(chain) and chain[hit] in self._cache:
            hit += 1
        new = chain[hit:]
        evicted: list[int] = []
        keep = set(chain)
        while len(self._cache) + len(new) > self.capacity:
            oldest = next((h for h in self._cache if h not in keep), None)
            if oldest is None:
                break  # the prompt alone is larger than the cache: keep what fits
            del self._cache[oldest]
            evicted.append(oldest)
        # Touch the chain leaf first, so the prefix is the most recently used part and
        # eviction takes leaves before the prefixes other prompts share (as vLLM frees
        # blocks in reverse order).
        for h in reversed(chain):
            self._cache[h] = None
            self._cache.move_to_end(h)
        events: list[dict[str, Any]] = []
        if evicted:
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"})
        if new:
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": new,
                    "parent_block_hash": chain[hit - 1] if hit else None,
                    "token_ids": token_ids[hit * self.block_size : len(chain) * self.block_size],
                    "block_size": self.block_size,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
        if events:
            self._publisher.publish(events)
        time.sleep(self.prefill_s_per_block * len(new))
        self.served += 1
        return {"hit_blocks": hit, "prompt_blocks": len(chain), "worker_id": self.worker_id}

    def clear(self) -> None:
        """Drops every cached block and says so (``AllBlocksCleared``), as an engine reset."""
        self._cache.clear()
        self._publisher.publish([{"type": "AllBlocksCleared"}])

    def stats(self) -> dict[str, int]:
        return {"worker_id": self.worker_id, "served": self.served, "cached_blocks": len(self._cache)}

    def close(self) -> None:
        self._publisher.close()
