"""Publishes KV events with vLLM's own publisher, for the select-server interop test.

vllm/distributed/kv_events.py (vLLM 0.33.0, fetched by vllm_fetch.py) is loaded by file: the
package __init__ imports torch. Its four imports from the rest of vLLM are stubbed; the event
structs, the msgpack encoding, the sequence numbers and the replay socket are vLLM's code.
Both sockets bind 127.0.0.1 only.

Reads one step name per line on stdin, publishes that step's batch, waits until vLLM's
publisher thread has sent it, and answers "ok" on stdout. Exits when stdin closes.

argv: <kv_events.py> <pub port> <replay port, or - for none> [data-parallel rank]
A rank r > 0 makes vLLM bind port + r (and replay port + r), as it does for DP engines.
"""

import importlib.util
import logging
import sys
import time
import types


def stub(name, **attrs):
    module = types.ModuleType(name)
    module.__path__ = []
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def unused(*_args, **_kwargs):
    raise RuntimeError("only needed for tcp://*:0 endpoints")


class KVEventsConfig:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def load(path):
    for package in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"):
        stub(package)
    stub("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    stub("vllm.logger", init_logger=logging.getLogger)
    stub(
        "vllm.utils.network_utils",
        get_ip=unused,
        get_tcp_uri=unused,
        is_valid_ipv6_address=unused,
        split_zmq_path=unused,
    )
    stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main():
    path, pub_port, replay_port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    kv = load(path)

    class LoopbackPublisher(kv.ZmqEventPublisher):
        # vLLM binds only wildcard endpoints and connects to concrete ones; the service's
        # SUB connects, so the engine side must bind, and only on loopback.
        @staticmethod
        def _is_bind_endpoint(endpoint):
            return True

    publisher = LoopbackPublisher(
        data_parallel_rank=rank,
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        replay_endpoint=None if replay_port == "-" else f"tcp://127.0.0.1:{replay_port}",
        topic="kv@interop",
    )

    t0 = list(range(1000, 1008))
    t1 = list(range(1008, 1016))
    gpu = dict(lora_id=None, medium=kv.MEDIUM_GPU, lora_name=None)
    steps = {
        # Two root blocks, then two children chained on the second.
        "root": [kv.BlockStored(block_hashes=[101, 102], parent_block_hash=None, token_ids=t0, block_size=4, **gpu)],
        "child": [
            kv.BlockStored(
                block_hashes=[103, 104],
                parent_block_hash=102,
                token_ids=t1,
                block_size=4,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
                **gpu,
            )
        ],
        # Neither may reach the index: a sliding-window group and a remote block.
        "filtered": [
            kv.BlockStored(
                block_hashes=[201],
                parent_block_hash=None,
                token_ids=list(range(2000, 2004)),
                block_size=4,
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128,
                **gpu,
            ),
            kv.BlockStored(
                block_hashes=[202],
                parent_block_hash=None,
                token_ids=list(range(3000, 3004)),
                block_size=4,
                locality="REMOTE",
                **gpu,
            ),
        ],
        "remove": [kv.BlockRemoved(block_hashes=[104], medium=kv.MEDIUM_GPU)],
        # A LoRA block offloaded to CPU, with a raw-bytes hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
        # and the adapter repeated in extra_keys, as vLLM publishes it.
        "lora": [
            kv.BlockStored(
                block_hashes=[bytes(range(32))],
                parent_block_hash=None,
                token_ids=t0[:4],
                block_size=4,
                lora_id=None,
                medium=kv.MEDIUM_CPU,
                lora_name="adapter-a",
                extra_keys=[("adapter-a",)],
            )
        ],
        "remove-lora": [kv.BlockRemoved(block_hashes=[bytes(range(32))], medium=kv.MEDIUM_CPU)],
        "clear": [kv.AllBlocksCleared()],
    }

    print("ready", flush=True)
    for line in sys.stdin:
        step = line.strip()
        if step not in steps:
            sys.exit(f"unknown step {step!r}")
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=steps[step]))
        # The publisher thread marks a batch done once it is on the PUB socket.
        publisher._event_queue.join()
        print("ok", flush=True)
    publisher.shutdown()


if __name__ == "__main__":
    main()
