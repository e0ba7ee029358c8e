"""Publishes a scripted KV-event sequence with SGLang's own publisher module.

Loads sglang/srt/disaggregation/kv_events.py by file (the package __init__ needs torch),
stubbing the one name it imports from the runtime, binds on 127.0.0.1 only, publishes, and
keeps the replay socket alive until stdin closes (the Rust test closes it when done).

argv: <site-packages dir> <pub port> <replay port>
"""

import importlib.util
import sys
import threading
import time
import types


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main():
    site, pub_port, replay_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for pkg in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"):
        module = types.ModuleType(pkg)
        module.__path__ = []
        sys.modules[pkg] = module
    runtime = types.ModuleType("sglang.srt.runtime_context")
    runtime.get_parallel = lambda: None
    sys.modules["sglang.srt.runtime_context"] = runtime
    load("sglang.srt.utils.network", f"{site}/sglang/srt/utils/network.py")
    kv = load(
        "sglang.srt.disaggregation.kv_events",
        f"{site}/sglang/srt/disaggregation/kv_events.py",
    )

    publisher = kv.ZmqEventPublisher(
        attn_dp_rank=0,
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kv@w1",
    )
    # Slow joiner: let the test's SUB connect. If the first batches are still lost, the
    # listener sees a gap and replays them from this publisher's ROUTER.
    time.sleep(1.0)
    script = [
        [kv.BlockStored(block_hashes=[1, 2], parent_block_hash=None,
                        token_ids=[1, 2, 3, 4, 5, 6, 7, 8], block_size=4, lora_id=None,
                        medium="GPU")],
        [kv.BlockStored(block_hashes=[-3], parent_block_hash=2,
                        token_ids=[9, 10, 11, 12], block_size=4, lora_id=None,
                        medium="CPU_PINNED")],
        [kv.BlockRemoved(block_hashes=[2], medium="GPU")],
        [kv.AllBlocksCleared()],
        [kv.BlockStored(block_hashes=[401], parent_block_hash=None,
                        token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
                        cache_salt="tenant-a", session_id="s1")],
    ]
    for events in script:
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
    print("published", flush=True)

    # A SUB that connected late (its reconnect backoff can exceed the sleep above on a busy
    # machine) missed everything and could not even see a gap. Keep publishing empty
    # batches: the first one it receives reveals the gap, and the listener replays the
    # script from the ROUTER. The test ignores empty batches.
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    deadline = time.time() + 60
    while not done.wait(timeout=0.2) and time.time() < deadline:
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[]))
    publisher.shutdown()


if __name__ == "__main__":
    main()
