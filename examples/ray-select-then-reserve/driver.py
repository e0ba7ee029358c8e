"""Ray select-then-reserve: a local Ray cluster, engine actors that publish real KV events,
and a driver that routes a shared-prefix workload through kv-select.

Per request, the kv-select run does what the contract's Ray story describes:

1. ``POST /select`` with a ``selection_id``: which engine? (books nothing)
2. send the prompt to that engine's actor (model invocation stays Ray's business)
3. ``POST /reservations`` replay form: book exactly what step 1 chose; if the cached
   selection is gone (``NotFound.no_pending_selection``), book with the explicit form
4. ``prefill_complete`` once the actor has prefilled, then free (the handle's ``async with``
   frees also when the actor raised)

The same workload then runs round-robin (explicit reservations on the next engine) on
emptied caches. The engines report their own prefix hits, so the hit ratios printed are
what the engines measured, not what the selector predicted.

    python driver.py --server-binary ../../target/release/select-server
    python driver.py --url http://127.0.0.1:8092     # a server you started (KV events on)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import ray

import kv_select
from engine import Engine

MODEL = "example-llm"
_LISTENING = re.compile(r"kv-select listening addr=127\.0\.0\.1:(\d+)")


@dataclass
class RunResult:
    policy: str
    requests: int
    hit_blocks: int
    prompt_blocks: int
    replays: int
    explicit: int
    seconds: float
    requests_per_worker: dict[int, int] = field(default_factory=dict)
    peak_active_per_worker: dict[int, int] = field(default_factory=dict)
    freed: bool = False

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


def workload(args: argparse.Namespace) -> list[list[int]]:
    """``requests`` prompts: one of ``prefixes`` shared system prompts, then a unique suffix."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    return [
        rng.choice(prefixes) + [rng.randrange(1, 50_000) for _ in range(args.suffix_tokens)]
        for _ in range(args.requests)
    ]


async def run(
    policy: str,
    prompts: list[list[int]],
    client: kv_select.AsyncClient,
    engines: dict[int, Any],
    concurrency: int,
) -> RunResult:
    worker_ids = sorted(engines)
    result = RunResult(policy, len(prompts), 0, 0, 0, 0, 0.0)
    result.requests_per_worker = {w: 0 for w in worker_ids}
    result.peak_active_per_worker = {w: 0 for w in worker_ids}
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: list[int]) -> None:
        rid = f"{policy}-{i}"
        async with slots:
            if policy == "kv-select":
                selection = await client.select(selection_id=rid, model_name=MODEL, token_ids=prompt)
                worker = selection.worker_id
                served = engines[worker].serve.remote(prompt)  # the engine starts right away
                try:
                    handle = await client.reserve(rid, model_name=MODEL)
                    result.replays += 1
                except kv_select.NotFound as missing:
                    if not missing.no_pending_selection:
                        raise
                    handle = await client.reserve_explicit(
                        rid,
                        worker,
                        model_name=MODEL,
                        token_ids=prompt,
                        effective_prefill_tokens=selection.effective_prefill_tokens,
                    )
                    result.explicit += 1
            else:
                worker = worker_ids[i % len(worker_ids)]
                served = engines[worker].serve.remote(prompt)
                handle = await client.reserve_explicit(
                    rid, worker, model_name=MODEL, token_ids=prompt, effective_prefill_tokens=len(prompt)
                )
                result.explicit += 1
            async with handle:
                answer = await served
                await handle.prefill_complete()
                await handle.output_block()
            result.hit_blocks += answer["hit_blocks"]
            result.prompt_blocks += answer["prompt_blocks"]
            result.requests_per_worker[worker] += 1

    async def watch_loads(done: asyncio.Event) -> None:
        while not done.is_set():
            for partition in await client.loads(model_name=MODEL):
                for row in partition.loads:
                    peak = result.peak_active_per_worker
                    peak[row.worker_id] = max(peak.get(row.worker_id, 0), row.active_requests)
            try:
                await asyncio.wait_for(done.wait(), 0.02)
            except asyncio.TimeoutError:
                pass

    started = time.monotonic()
    done = asyncio.Event()
    watcher = asyncio.create_task(watch_loads(done))
    try:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        done.set()
        await watcher
    result.seconds = time.monotonic() - started
    result.freed = await all_freed(client)
    return result


async def all_freed(client: kv_select.AsyncClient) -> bool:
    """Every rank of the model idle: no live reservation, no prefill or decode load left."""
    partitions = await client.loads(model_name=MODEL)
    rows = [row for p in partitions for row in p.loads]
    return bool(rows) and all(
        (r.active_requests, r.potential_prefill_tokens, r.potential_decode_blocks) == (0, 0, 0) for r in rows
    ) and all(p.pending_count == 0 for p in partitions)


async def wait_until_index_empty(client: kv_select.AsyncClient, limit_s: float) -> None:
    """After the engines cleared their caches, wait until kv-select's index has applied it
    (its ``/dump`` snapshot holds no block of the model any more)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        partition = (await client.dump()).get(f"{MODEL}:default")
        if partition is None or not partition.events:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"kv-select still indexes blocks {limit_s}s after AllBlocksCleared")


def start_server(binary: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """select-server on 127.0.0.1 with a port the OS picks, KV events on (the default); also
    returns the directory of its log, for the caller to remove once it stopped the server."""
    log_dir = Path(tempfile.mkdtemp(prefix="kv-select-ray-"))
    log = log_dir / "server.log"
    env = dict(os.environ, DYN_ROUTER_USE_KV_EVENTS="true")
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [binary, "--host", "127.0.0.1", "--port", "0"], stdout=sink, stderr=subprocess.STDOUT, env=env
        )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and process.poll() is None:
        m = _LISTENING.search(log.read_text(errors="replace"))
        if m:
            return process, f"http://127.0.0.1:{m.group(1)}", log_dir
        time.sleep(0.02)
    process.kill()
    process.wait(10)
    output = log.read_text(errors="replace")
    shutil.rmtree(log_dir, ignore_errors=True)
    raise RuntimeError(f"select-server did not start:\n{output}")


def stop_server(process: subprocess.Popen[bytes], log_dir: Path) -> None:
    """Stops a server from ``start_server`` and removes its log."""
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
    shutil.rmtree(log_dir, ignore_errors=True)


def table(results: list[RunResult]) -> Iterator[str]:
    yield f"{'policy':<12} {'hit ratio':>9}  {'requests per worker':<22} {'peak active per worker':<24} {'time':>6}"
    for r in results:
        per = "/".join(str(r.requests_per_worker[w]) for w in sorted(r.requests_per_worker))
        peak = "/".join(str(r.peak_active_per_worker.get(w, 0)) for w in sorted(r.requests_per_worker))
        yield f"{r.policy:<12} {r.hit_ratio:>9.3f}  {per:<22} {peak:<24} {r.seconds:>5.1f}s"


async def drive(args: argparse.Namespace, url: str) -> list[RunResult]:
    prompts = workload(args)
    Actor = ray.remote(num_cpus=0)(Engine)
    first_id = 100
    engines = {
        first_id + i: Actor.remote(first_id + i, args.block_size, args.capacity_blocks, args.prefill_ms_per_block / 1000)
        for i in range(args.engines)
    }
    async with kv_select.AsyncClient(url) as client:
        for worker_id, actor in engines.items():
            record = await client.upsert_worker(
                worker_id,
                model_name=MODEL,
                endpoint=f"ray://engine-{worker_id}",
                block_size=args.block_size,
                kv_events_endpoint=await actor.endpoint.remote(),
            )
            if not record.schedulable:
                raise RuntimeError(f"engine {worker_id} not schedulable: {record.not_schedulable_reasons}")
        subscribed = await asyncio.gather(*(a.wait_for_subscriber.remote(10.0) for a in engines.values()))
        if not all(subscribed):
            raise RuntimeError("kv-select did not subscribe to every engine's KV events within 10 s")

        results = [await run("kv-select", prompts, client, engines, args.concurrency)]
        await asyncio.gather(*(a.clear.remote() for a in engines.values()))
        await wait_until_index_empty(client, 10.0)
        results.append(await run("round-robin", prompts, client, engines, args.concurrency))
        for worker_id in engines:
            await client.delete_worker(worker_id)
    await asyncio.gather(*(a.close.remote() for a in engines.values()))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running select-server (with KV events on)")
    where.add_argument("--server-binary", help="start this select-server on a free loopback port")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prefixes", type=int, default=8, help="distinct shared system prompts")
    parser.add_argument("--prefix-tokens", type=int, default=128)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--capacity-blocks", type=int, default=48, help="KV cache size of each engine")
    parser.add_argument("--prefill-ms-per-block", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless every reservation was freed and kv-select's hit ratio beats round-robin",
    )
    args = parser.parse_args()

    server = None
    url = args.url
    if args.server_binary:
        process, url, log_dir = start_server(args.server_binary)
        server = (process, log_dir)
    # Our sockets (the server, the engines' ZMQ publishers) bind 127.0.0.1 only.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        results = asyncio.run(drive(args, url))
    finally:
        ray.shutdown()
        if server is not None:
            stop_server(*server)

    print(
        f"{args.engines} engines, {args.requests} requests, {args.prefixes} shared prefixes of "
        f"{args.prefix_tokens} tokens + {args.suffix_tokens} unique, block size {args.block_size}, "
        f"{args.capacity_blocks} blocks of KV cache per engine, concurrency {args.concurrency}"
    )
    for line in table(results):
        print(line)
    kv, rr = results
    print(f"kv-select: {kv.replays} replayed reservations, {kv.explicit} explicit fallbacks")
    freed = all(r.freed for r in results)
    print(f"every reservation freed: {'yes' if freed else 'NO'}")
    if args.json:
        args.json.write_text(
            json.dumps([asdict(r) | {"hit_ratio": r.hit_ratio} for r in results], indent=2) + "\n"
        )
    if args.check:
        if not freed:
            print("check failed: some reservation was not freed", file=sys.stderr)
            return 1
        if not kv.hit_ratio > rr.hit_ratio:
            print(f"check failed: hit ratio {kv.hit_ratio:.3f} does not beat round-robin {rr.hit_ratio:.3f}", file=sys.stderr)
            return 1
        print("check passed: every reservation freed, kv-select beats round-robin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
