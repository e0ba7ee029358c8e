"""The blocking client against the real server: every route, every error class, the
reservation handle and the retry rules."""

from __future__ import annotations

import http.server
import json
import pickle
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

import kv_select
from conftest import Server, active_requests, register

TOKENS = list(range(1, 18))  # 4 complete blocks of 4 tokens, and one partial


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rank_load(c: kv_select.Client, worker_id: int, dp_rank: int = 0) -> kv_select.RankLoad:
    for partition in c.loads():
        for row in partition.loads:
            if (row.worker_id, row.dp_rank) == (worker_id, dp_rank):
                return row
    raise AssertionError(f"no load row for worker {worker_id} rank {dp_rank}")


# --- health, readiness, catalog ---


def test_health_and_readiness_follow_the_catalog(client: kv_select.Client) -> None:
    assert client.health() is True
    before = client.ready()
    assert (before.ready, before.schedulable_workers, before.workers) == (False, 0, [])
    register(client, 7)
    after = client.ready()
    assert after.ready and after.schedulable_workers == 1
    assert [w.worker_id for w in after.workers] == [7]


def test_worker_upsert_patch_list_delete(client: kv_select.Client) -> None:
    record = client.upsert_worker(
        7,
        model_name="llama",
        endpoint="http://10.0.0.7:8000",
        block_size=16,
        data_parallel_size=2,
        kv_events_endpoints={0: "tcp://127.0.0.1:5557", 1: "tcp://127.0.0.1:5558"},
        max_num_batched_tokens=8192,
        total_kv_blocks=4096,
        taints={"gpu-a100"},
        topology_domains={"zone": "a"},
        kv_transfer_enforcement="preferred",
        kv_transfer_preferred_weight=0.5,
        router_hint_worker_type="decode",
        router_hint_source_control_endpoints={0: "tcp://127.0.0.1:5600"},
    )
    assert record.schedulable and record.model_name == "llama" and record.routing_group == "default"
    assert record.kv_events_endpoints == {0: "tcp://127.0.0.1:5557", 1: "tcp://127.0.0.1:5558"}
    assert record.router_hint_source_control_endpoints == {0: "tcp://127.0.0.1:5600"}
    assert (record.taints, record.topology_domains) == (["gpu-a100"], {"zone": "a"})
    assert record.data_parallel_start_rank is None, "fields echo what was sent, no defaults"
    assert record.kv_transfer_preferred_weight == 0.5

    incomplete = client.upsert_worker(9, model_name="llama")
    assert incomplete.lifecycle == "incomplete"
    assert incomplete.not_schedulable_reasons == ["endpoint is required", "block_size must be greater than 0"]

    patched = client.patch_worker(7, total_kv_blocks=8192, taints=[])
    assert (patched.total_kv_blocks, patched.taints, patched.max_num_batched_tokens) == (8192, [], 8192)

    register(client, 3)  # model "default"
    assert [w.worker_id for w in client.list_workers()] == [3, 7, 9], "sorted by model, group, id"
    assert [w.worker_id for w in client.list_workers(model_name="llama")] == [7, 9]
    assert client.list_workers(routing_group="other") == []

    deleted = client.delete_worker(9)
    assert deleted.lifecycle == "unschedulable" and deleted.not_schedulable_reasons == []
    with pytest.raises(kv_select.NotFound, match="worker 9 not found"):
        client.delete_worker(9)
    with pytest.raises(kv_select.NotFound):
        client.patch_worker(9, block_size=4)
    with pytest.raises(kv_select.BadRequest) as bad:
        client.upsert_worker(10, data_parallel_size=5000)
    assert (bad.value.status, bad.value.field) == (400, "data_parallel_size")


# --- selection and the select-then-reserve flow ---


def test_select_then_replay_reserve_then_lifecycle(client: kv_select.Client) -> None:
    register(client, 7)
    selection = client.select(selection_id="req-1", token_ids=TOKENS, expected_output_tokens=64)
    assert (selection.selection_id, selection.worker_id, selection.dp_rank) == ("req-1", 7, 0)
    assert selection.endpoint == "http://10.0.0.7:8000" and selection.block_size == 4
    assert selection.effective_prefill_tokens == len(TOKENS)
    assert selection.sequence_hashes is None and selection.worker_load is None
    assert active_requests(client) == 0, "/select books nothing"

    handle = client.reserve("req-1")
    assert (handle.selection_id, handle.worker_id, handle.endpoint) == ("req-1", 7, "http://10.0.0.7:8000")
    assert handle.selection is None
    load = rank_load(client, 7)
    assert (load.active_requests, load.potential_prefill_tokens) == (1, len(TOKENS))

    handle.prefill_complete()
    handle.prefill_complete()  # idempotent while live
    after_prefill = rank_load(client, 7)
    assert after_prefill.potential_prefill_tokens == 0
    handle.output_block()
    handle.output_block(decay_fraction=1.0)
    assert rank_load(client, 7).potential_decode_blocks == after_prefill.potential_decode_blocks + 2

    assert handle.free() is True and handle.freed
    assert handle.free() is False, "a second free is a no-op"
    assert active_requests(client) == 0

    with pytest.raises(kv_select.NotFound) as missing:
        client.reserve("req-1")
    assert missing.value.no_pending_selection, "the cached selection was used up"


def test_missing_pending_selection_falls_back_to_the_explicit_form(client: kv_select.Client) -> None:
    register(client, 7)
    register(client, 8)
    try:
        handle = client.reserve("never-selected")
    except kv_select.NotFound as e:
        assert e.no_pending_selection
        handle = client.reserve_explicit(
            "never-selected", 8, token_ids=TOKENS, effective_prefill_tokens=5, expected_output_tokens=10
        )
    with handle:
        assert (handle.worker_id, handle.dp_rank) == (8, 0)
        assert rank_load(client, 8).potential_prefill_tokens == 5
    assert active_requests(client) == 0


def test_explicit_form_hash_only_prompt_and_its_errors(client: kv_select.Client) -> None:
    register(client, 7, data_parallel_size=2)
    with client.reserve_explicit(
        "req-44", 7, dp_rank=1, sequence_hashes=[21, -22], isl_tokens=40, effective_prefill_tokens=8
    ) as handle:
        assert (handle.worker_id, handle.dp_rank) == (7, 1)
        assert rank_load(client, 7, 1).potential_prefill_tokens == 8
    with pytest.raises(kv_select.NotFound) as unknown:
        client.reserve_explicit("req-45", 99, sequence_hashes=[1], isl_tokens=4)
    assert not unknown.value.no_pending_selection
    assert "schedulable worker 99 not found" in unknown.value.message
    with pytest.raises(kv_select.BadRequest) as too_much:
        client.reserve_explicit("req-45", 7, sequence_hashes=[1], isl_tokens=4, effective_prefill_tokens=9)
    assert too_much.value.field == "effective_prefill_tokens"
    with pytest.raises(kv_select.BadRequest) as no_hashes:
        client.reserve_explicit("req-45", 7, isl_tokens=4)
    assert no_hashes.value.field == "sequence_hashes"


def test_select_and_reserve_books_and_the_handle_frees(client: kv_select.Client) -> None:
    register(client, 7)
    with client.select_and_reserve(
        selection_id="req-43", block_hashes=[11, 12], sequence_hashes=[21, -22], isl_tokens=40
    ) as handle:
        selection = handle.selection
        assert selection is not None
        assert (selection.selection_id, selection.sequence_hashes, selection.isl_tokens) == (
            "req-43",
            [21, -22],
            40,
        ), "negative (>= 2**63) hashes travel as signed integers"
        assert selection.track_prefill_tokens is True
        assert active_requests(client) == 1
        with pytest.raises(kv_select.Conflict, match="already reserved"):
            client.select_and_reserve(selection_id="req-43", token_ids=TOKENS)
    assert active_requests(client) == 0

    generated = client.select_and_reserve(token_ids=TOKENS)
    assert str(uuid.UUID(generated.selection_id)) == generated.selection_id, "the server makes a UUIDv4"
    generated.free()


def test_selection_options_reach_the_server(server_factory: Callable[..., Server]) -> None:
    server = server_factory(["--session-affinity-ttl-secs", "60"])
    with kv_select.Client(server.url) as c:
        register(c, 7, taints=["fast"])
        register(c, 8, total_kv_blocks=1000)

        pinned = c.select(token_ids=TOKENS, pinned_worker={"worker_id": 8, "dp_rank": 0})
        assert pinned.worker_id == 8
        only_7 = c.select(token_ids=TOKENS, allowed_worker_ids={7})
        assert only_7.worker_id == 7
        target = c.select(token_ids=TOKENS, affinity_target={"worker_id": 8})
        assert target.worker_id == 8
        tainted = c.select(token_ids=TOKENS, routing_constraints={"required_taints": ["fast"]})
        assert tainted.worker_id == 7

        advisory = c.select(token_ids=TOKENS, advisory=True, pinned_worker={"worker_id": 8, "dp_rank": 0})
        assert advisory.worker_load is not None
        assert advisory.worker_load.prefill_token_capacity == 10_000_000, "default without max_num_batched_tokens"
        assert advisory.worker_load.total_kv_blocks == 1000

        with pytest.raises(kv_select.BadRequest, match="not in allowed worker set"):
            c.select(token_ids=TOKENS, pinned_worker={"worker_id": 7, "dp_rank": 0}, allowed_worker_ids=[8])

        # A booked session is bound to its worker: later selections of the session follow
        # it, whichever form names the session.
        with c.select_and_reserve(token_ids=TOKENS, session_id="chat-1", allowed_worker_ids=[8]):
            follow = c.select(token_ids=[99, 98, 97, 96, 95], session_context={"session_id": "chat-1"})
            assert follow.worker_id == 8
            with pytest.raises(kv_select.BadRequest, match="session chat-1 is bound to worker 8"):
                c.select_and_reserve(token_ids=TOKENS, session_id="chat-1", allowed_worker_ids=[7])

        override = c.select(
            token_ids=TOKENS,
            router_config_override={"overlap_score_credit": 2.0, "track_prefill_tokens": False},
            priority_jump=1.5,
            strict_priority=1,
            lora_name="adapter",
            cache_salt="tenant-a",
        )
        assert override.worker_id in (7, 8)
        with pytest.raises(kv_select.BadRequest) as bad_override:
            c.select(token_ids=TOKENS, router_config_override={"overlap_score_credit": -1.0})
        assert (bad_override.value.status, bad_override.value.field) == (
            422,
            "router_config_override.overlap_score_credit",
        )


def test_busy_carries_the_queue_rejection_details(server_factory: Callable[..., Server], tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "classes:\n"
        "  - name: default\n"
        "  - name: strict\n"
        "    prefill_busy_threshold: 1\n"
        "    request_queue_limit_per_worker: 0\n"
    )
    server = server_factory(["--router-policy-config", str(policy)])
    with kv_select.Client(server.url) as c:
        register(c, 7, max_num_batched_tokens=100)
        with c.select_and_reserve(token_ids=TOKENS):
            # The default class never queues; the strict one rejects whatever would wait.
            assert c.select(token_ids=TOKENS).worker_id == 7
            with pytest.raises(kv_select.Busy) as busy:
                c.select(token_ids=TOKENS, policy_class="strict")
    assert busy.value.status == 429
    assert busy.value.details == kv_select.QueueRejection(
        policy_class="strict", limit_kind="requests", current=0, limit=0
    )
    assert 'router policy class "strict" queue requests limit reached' in busy.value.message
    # Ray ships a task's exception to the driver by pickling it: nothing may be lost.
    shipped = pickle.loads(pickle.dumps(busy.value))
    assert type(shipped) is kv_select.Busy and shipped.details == busy.value.details
    assert (shipped.status, shipped.message, shipped.path, str(shipped)) == (
        429,
        busy.value.message,
        "/select",
        str(busy.value),
    )


# --- errors ---


def test_error_classes_carry_status_and_message(server_factory: Callable[..., Server]) -> None:
    server = server_factory(["--max-prompt-tokens", "8"])
    with kv_select.Client(server.url) as c:
        with pytest.raises(kv_select.Unavailable, match="no schedulable workers are available") as none:
            c.select(token_ids=TOKENS)
        assert none.value.status == 503
        register(c, 7)
        with pytest.raises(kv_select.Unavailable, match="no schedulable workers for model=other"):
            c.select(model_name="other", token_ids=[1])
        with pytest.raises(kv_select.BadRequest) as mismatch:
            c.select(block_hashes=[1], sequence_hashes=[1, 2], isl_tokens=3)
        assert (mismatch.value.status, mismatch.value.field) == (400, "block_hashes")
        with pytest.raises(kv_select.BadRequest) as shape:
            c.select(token_ids=[1], pinned_worker={"worker_id": 7})  # type: ignore[typeddict-item]
        assert (shape.value.status, shape.value.field) == (422, "pinned_worker.dp_rank")
        with pytest.raises(kv_select.BadRequest) as too_long:
            c.select(token_ids=TOKENS)
        assert too_long.value.status == 413
        with pytest.raises(kv_select.BadRequest) as decay:
            c.output_block("unknown", decay_fraction=2.0)
        assert (decay.value.status, decay.value.field) == (400, "decay_fraction")
        with pytest.raises(kv_select.NotFound, match="reservation unknown not found"):
            c.output_block("unknown")
        with pytest.raises(kv_select.NotFound):
            c.prefill_complete("unknown")
        with pytest.raises(kv_select.NotFound):
            c.free("unknown")
        with pytest.raises(kv_select.Conflict, match="replica sync is disabled"):
            c.register_replica_peer("tcp://127.0.0.1:1")


def test_selection_ids_are_escaped_in_paths(client: kv_select.Client) -> None:
    register(client, 7)
    odd = "tenant/a b?c#d%"
    client.select(selection_id=odd, token_ids=TOKENS)
    with client.reserve(odd) as handle:
        handle.prefill_complete()
        handle.output_block()
        assert handle.selection_id == odd
    assert active_requests(client) == 0


def test_bearer_tokens(server_factory: Callable[..., Server], tmp_path: Path) -> None:
    full, read_only = "f" * 32, "r" * 32
    (tmp_path / "full").write_text(full + "\n")
    (tmp_path / "ro").write_text(read_only + "\n")
    server = server_factory(
        ["--auth-token-file", str(tmp_path / "full"), "--auth-read-only-token-file", str(tmp_path / "ro")]
    )
    with kv_select.Client(server.url) as anonymous:
        assert anonymous.health(), "/health needs no token"
        with pytest.raises(kv_select.Unauthorized) as denied:
            anonymous.loads()
        assert denied.value.status == 401
    with kv_select.Client(server.url, token=read_only) as reader:
        assert reader.loads() == []
        with pytest.raises(kv_select.Forbidden):
            register(reader, 7)
    with kv_select.Client(server.url, token=full) as writer:
        register(writer, 7)
        assert writer.select(token_ids=TOKENS).worker_id == 7


class _Stub(http.server.BaseHTTPRequestHandler):
    """Answers every request with the status and body the test put on the server."""

    def do_GET(self) -> None:
        status, body = self.server.answer  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        self.server.received = (self.headers.get("content-type"), self.rfile.read(length))  # type: ignore[attr-defined]
        self.do_GET()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[http.server.HTTPServer]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def test_answers_outside_the_contract(stub: http.server.HTTPServer) -> None:
    """Statuses and bodies the real server does not produce on demand: a 500 and answers
    that are not the contract's shape."""
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    with kv_select.Client(url, retries=kv_select.Retries(safe=0)) as c:
        stub.answer = (500, b'{"error": "request classifier failed"}')  # type: ignore[attr-defined]
        with pytest.raises(kv_select.ServerError, match="request classifier failed") as failed:
            c.loads()
        assert failed.value.status == 500
        stub.answer = (502, b"<html>bad gateway</html>")  # type: ignore[attr-defined]
        with pytest.raises(kv_select.ServerError, match="bad gateway"):
            c.loads()
        stub.answer = (200, b"not json")  # type: ignore[attr-defined]
        with pytest.raises(kv_select.ProtocolError, match="not JSON"):
            c.loads()
        stub.answer = (200, b'[{"model_name": "m"}]')  # type: ignore[attr-defined]
        with pytest.raises(kv_select.ProtocolError, match="missing field 'routing_group'"):
            c.loads()
        stub.answer = (200, b'[{"worker_id": true, "model_name": "m", "routing_group": "g", "lifecycle": "x"}]')  # type: ignore[attr-defined]
        with pytest.raises(kv_select.ProtocolError, match="worker_id: expected int, got bool"):
            c.list_workers()


def test_bodies_go_as_compact_json(stub: http.server.HTTPServer) -> None:
    """Bare commas between token ids, whatever the httpx version: the server's fast token
    parser takes only those."""
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    with kv_select.Client(url, retries=kv_select.Retries(safe=0)) as c:
        stub.answer = (500, b'{"error": "stub"}')  # type: ignore[attr-defined]
        with pytest.raises(kv_select.ServerError):
            c.select(token_ids=[1, 22, 333], model_name="m\u00e9")
        content_type, body = stub.received  # type: ignore[attr-defined]
    assert content_type == "application/json"
    assert b"[1,22,333]" in body, body
    assert b", " not in body and b": " not in body, body
    assert json.loads(body)["token_ids"] == [1, 22, 333]


# --- the reservation handle ---


def test_handle_frees_when_the_body_raises(client: kv_select.Client) -> None:
    register(client, 7)
    client.select(selection_id="req-1", token_ids=TOKENS)
    with pytest.raises(RuntimeError, match="engine failed"):
        with client.reserve("req-1") as handle:
            assert active_requests(client) == 1
            raise RuntimeError("engine failed")
    assert handle.freed
    assert active_requests(client) == 0
    with pytest.raises(ZeroDivisionError):
        with client.select_and_reserve(token_ids=TOKENS):
            1 / 0
    assert active_requests(client) == 0


def test_handle_exit_tolerates_a_reservation_already_gone(client: kv_select.Client) -> None:
    register(client, 7)
    with client.select_and_reserve(token_ids=TOKENS) as handle:
        client.free(handle.selection_id)
    assert handle.freed
    with client.select_and_reserve(token_ids=TOKENS) as handle:
        client.delete_worker(7)  # its reservations lose their tracker state
    assert handle.freed


def test_a_failed_free_does_not_hide_the_body_exception(server: Server) -> None:
    with kv_select.Client(server.url, retries=kv_select.Retries(safe=0)) as c:
        register(c, 7)
        with pytest.raises(RuntimeError, match="engine failed") as raised:
            with c.select_and_reserve(token_ids=TOKENS) as handle:
                server.stop()
                raise RuntimeError("engine failed")
        assert not handle.freed
        notes = getattr(raised.value, "__notes__", [])
        assert any("freeing reservation" in n for n in notes), notes
        with pytest.raises(kv_select.TransportError) as down:
            handle.free()
        assert down.value.sent is False, "connection refused: the request never left"
        assert pickle.loads(pickle.dumps(down.value)).sent is False


# --- inspection ---


def test_loads_potential_loads_overlap_scores_and_dump(client: kv_select.Client) -> None:
    register(client, 7)
    register(client, 8, model_name="other")
    assert [(p.model_name, p.routing_group) for p in client.loads()] == [("default", "default"), ("other", "default")]
    with client.select_and_reserve(token_ids=TOKENS, pinned_worker={"worker_id": 7, "dp_rank": 0}):
        (partition,) = client.loads(model_name="default")
        assert (partition.pending_count, partition.pending_isl_tokens) == (0, 0)
        assert [(r.worker_id, r.active_requests) for r in partition.loads] == [(7, 1)]

        (potential,) = client.potential_loads(token_ids=TOKENS)
        assert potential.worker_id == 7
        assert potential.potential_decode_blocks == rank_load(client, 7).potential_decode_blocks, (
            "the shared prefix is not counted twice"
        )

        # Approximate mode learned the booked prompt: its 4 blocks are on worker 7.
        scores = client.overlap_scores(token_ids=TOKENS)
        assert (scores.block_size, scores.num_blocks) == (4, 4)
        assert [(w.worker_id, w.device_blocks) for w in scores.workers] == [(7, 4)]
        assert scores.shared_cache.enabled is False
        routed = client.overlap_scores(token_ids=[1], mm_routing_info={"routing_token_ids": TOKENS[:8]})
        assert routed.num_blocks == 2, "multimodal routing tokens win over token_ids"

        dump = client.dump()
        assert set(dump) == {"default:default", "other:default"}
        assert dump["default:default"].block_size == 4 and dump["default:default"].error is None
        stored = [e for e in dump["default:default"].events if e["worker_id"] == 7]
        assert stored and all("stored" in e["event"]["data"] for e in stored)
    with pytest.raises(kv_select.Unavailable):
        client.potential_loads(model_name="nobody", token_ids=TOKENS)
    with pytest.raises(kv_select.BadRequest, match="isl_tokens is required"):
        client.overlap_scores(block_hashes=[1], sequence_hashes=[1])


def test_replica_peers(server_factory: Callable[..., Server]) -> None:
    server = server_factory(["--replica-sync-port", str(free_port())])
    peer = f"tcp://127.0.0.1:{free_port()}"
    with kv_select.Client(server.url) as c:
        assert c.replica_peers() == []
        assert c.register_replica_peer(peer) is True
        assert c.register_replica_peer(peer) is False, "already registered: 200, not 201"
        assert c.replica_peers() == [peer]
        with pytest.raises(kv_select.BadRequest, match="invalid ZMQ endpoint"):
            c.register_replica_peer("udp://x")
        c.deregister_replica_peer(peer)
        assert c.replica_peers() == []
        with pytest.raises(kv_select.NotFound, match="peer not found"):
            c.deregister_replica_peer(peer)


# --- retries ---


def counting_client(url: str, retries: kv_select.Retries) -> tuple[kv_select.Client, list[str]]:
    attempts: list[str] = []
    http = httpx.Client(
        base_url=url,
        timeout=5.0,
        event_hooks={"request": [lambda r: attempts.append(f"{r.method} {r.url.path}")]},
    )
    return kv_select.Client(url, retries=retries, http_client=http), attempts


def test_retries_follow_the_contract_on_a_dead_port() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    fast = kv_select.Retries(safe=2, bookings=1, backoff_s=0.001)
    c, attempts = counting_client(url, fast)
    with pytest.raises(kv_select.TransportError):
        c.loads()
    assert attempts == ["GET /loads"] * 3, "reads: 1 + safe retries"
    attempts.clear()
    with pytest.raises(kv_select.TransportError):
        c.select_and_reserve(token_ids=[1])
    assert len(attempts) == 2, "a booking that never left may be retried"
    attempts.clear()
    for never in (lambda: c.output_block("x"), lambda: c.free("x"), lambda: c.delete_worker(1)):
        with pytest.raises(kv_select.TransportError):
            never()
    assert len(attempts) == 3, "non-idempotent calls are tried once"
    attempts.clear()
    default, default_attempts = counting_client(url, kv_select.Retries(backoff_s=0.001))
    with pytest.raises(kv_select.TransportError):
        default.reserve("x")
    assert len(default_attempts) == 1, "bookings are not retried by default"


def test_a_replay_rejected_with_503_is_retried_until_the_worker_is_back(server: Server) -> None:
    c, attempts = counting_client(server.url, kv_select.Retries(bookings=20, backoff_s=0.05, max_backoff_s=0.1))
    register(c, 7)
    c.select(selection_id="req-1", token_ids=TOKENS)
    c.delete_worker(7)
    with pytest.raises(kv_select.Unavailable):
        kv_select.Client(server.url).reserve("req-1")  # default: no retry, and the entry is kept

    def come_back() -> None:
        time.sleep(0.3)
        register(kv_select.Client(server.url), 7)

    thread = threading.Thread(target=come_back)
    attempts.clear()
    thread.start()
    try:
        handle = c.reserve("req-1")
    finally:
        thread.join(10)
    replays = [a for a in attempts if a == "POST /reservations"]
    assert len(replays) > 1, "the 503s were retried"
    assert handle.worker_id == 7
    assert handle.free()
