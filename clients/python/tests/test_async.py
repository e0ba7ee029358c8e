"""``AsyncClient`` has the shape of ``Client`` and gives the same answers, and its
reservation handles free on exit, on an exception and on cancellation."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Any, Callable

import pytest

import kv_select
from conftest import Server, active_requests, register

TOKENS = list(range(1, 18))


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


# What differs by design: the async booking methods return a PendingReservation, and
# the sync client's handle type is the sync one.
ASYNC_RETURN = {
    "ReservationHandle": "PendingReservation",
}


def test_both_clients_have_the_same_methods_and_parameters() -> None:
    sync, async_ = public_methods(kv_select.Client), public_methods(kv_select.AsyncClient)
    assert set(sync) == set(async_)
    for name, signature in sync.items():
        other = async_[name]
        assert list(signature.parameters.values()) == list(other.parameters.values()), name
        expected = ASYNC_RETURN.get(str(signature.return_annotation), signature.return_annotation)
        assert other.return_annotation == expected, name
        member = getattr(kv_select.AsyncClient, name)
        returns_pending = expected == "PendingReservation"
        assert inspect.iscoroutinefunction(member) != returns_pending, f"{name} is awaitable"
    init = inspect.signature(kv_select.Client.__init__).parameters
    async_init = inspect.signature(kv_select.AsyncClient.__init__).parameters
    assert [p for p in init if p != "http_client"] == [p for p in async_init if p != "http_client"]
    handle_methods = {"prefill_complete", "output_block", "free"}
    for handle in (kv_select.ReservationHandle, kv_select.AsyncReservationHandle):
        assert handle_methods <= set(public_methods(handle))


def _normal(value: Any) -> Any:
    """An answer with the ids the server generates blanked, for comparing two servers."""
    if isinstance(value, kv_select.ReservationHandle | kv_select.AsyncReservationHandle):
        return ("handle", _normal(value.reservation), _normal(value.selection), value.freed)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _normal(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(fields.get("selection_id"), str) and fields["selection_id"].count("-") == 4:
            fields["selection_id"] = "<generated>"
        return (type(value).__name__, fields)
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


SCRIPT: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("health", (), {}),
    ("ready", (), {}),
    ("upsert_worker", (7,), {"endpoint": "http://w7", "block_size": 4, "data_parallel_size": 2}),
    ("upsert_worker", (8,), {"endpoint": "http://w8", "block_size": 4, "taints": ["x"]}),
    ("patch_worker", (8,), {"total_kv_blocks": 64}),
    ("list_workers", (), {}),
    ("ready", (), {}),
    ("select", (), {"selection_id": "s1", "token_ids": TOKENS, "pinned_worker": {"worker_id": 7, "dp_rank": 1}}),
    ("select", (), {"token_ids": TOKENS, "advisory": True, "allowed_worker_ids": [8]}),
    ("reserve", ("s1",), {}),
    ("loads", (), {}),
    ("prefill_complete", ("s1",), {}),
    ("output_block", ("s1",), {"decay_fraction": 0.5}),
    ("loads", (), {}),
    ("potential_loads", (), {"token_ids": TOKENS}),
    ("overlap_scores", (), {"token_ids": TOKENS}),
    ("free", ("s1",), {}),
    ("select_and_reserve", (), {"token_ids": TOKENS, "pinned_worker": {"worker_id": 8, "dp_rank": 0}}),
    ("reserve_explicit", ("e1",), {"worker_id": 7, "sequence_hashes": [5, -6], "isl_tokens": 9, "dp_rank": 1}),
    ("loads", (), {}),
    ("replica_peers", (), {}),
    ("delete_worker", (8,), {}),
    ("list_workers", (), {"model_name": "default"}),
    # errors are answers too: both clients must raise the same class with the same text
    ("reserve", ("s1",), {}),
    ("select", (), {"model_name": "none", "token_ids": [1]}),
    ("free", ("s1",), {}),
    ("output_block", ("e1",), {"decay_fraction": 3.0}),
    ("reserve_explicit", ("e1",), {"worker_id": 7, "sequence_hashes": [1], "isl_tokens": 4}),
    ("register_replica_peer", ("tcp://127.0.0.1:1",), {}),
]


def _outcome(run: Callable[[], Any]) -> Any:
    try:
        return _normal(run())
    except kv_select.ApiError as e:
        return ("raised", type(e).__name__, e.status, e.message)


async def _async_outcome(make: Callable[[], Any]) -> Any:
    try:
        result = make()
        if isinstance(result, kv_select.PendingReservation) or inspect.isawaitable(result):
            result = await result
        return _normal(result)
    except kv_select.ApiError as e:
        return ("raised", type(e).__name__, e.status, e.message)


def _call_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if name == "reserve_explicit":
        kwargs = dict(kwargs)
        return (*args, kwargs.pop("worker_id")), kwargs
    return args, kwargs


def test_the_same_script_gives_the_same_answers(server_factory: Callable[..., Server]) -> None:
    sync_server, async_server = server_factory(), server_factory()
    with kv_select.Client(sync_server.url) as c:
        sync_results = []
        for name, args, kwargs in SCRIPT:
            a, k = _call_args(name, args, kwargs)
            sync_results.append((name, _outcome(lambda: getattr(c, name)(*a, **k))))

    async def run_async() -> list[tuple[str, Any]]:
        results = []
        async with kv_select.AsyncClient(async_server.url) as ac:
            for name, args, kwargs in SCRIPT:
                a, k = _call_args(name, args, kwargs)
                results.append((name, await _async_outcome(lambda: getattr(ac, name)(*a, **k))))
        return results

    async_results = asyncio.run(run_async())
    for (name, sync_answer), (_, async_answer) in zip(sync_results, async_results):
        assert sync_answer == async_answer, name
    errors = [r for _, r in sync_results if isinstance(r, tuple) and r[0] == "raised"]
    assert len(errors) == 6, "the script's error steps raised"


def test_async_handles_free_on_exit_exception_and_cancellation(server: Server) -> None:
    sync = kv_select.Client(server.url)
    register(sync, 7)

    async def scenario() -> None:
        async with kv_select.AsyncClient(server.url) as ac:
            await ac.select(selection_id="a1", token_ids=TOKENS)
            async with ac.reserve("a1") as handle:  # books on entry
                assert active_requests(sync) == 1
                await handle.prefill_complete()
                await handle.output_block()
            assert handle.freed and active_requests(sync) == 0

            with pytest.raises(RuntimeError, match="engine failed"):
                async with ac.select_and_reserve(token_ids=TOKENS) as booked:
                    assert booked.selection is not None and booked.selection.isl_tokens == len(TOKENS)
                    raise RuntimeError("engine failed")
            assert booked.freed and active_requests(sync) == 0

            awaited = await ac.reserve_explicit("e1", 7, token_ids=TOKENS)
            async with awaited:
                assert active_requests(sync) == 1
            assert active_requests(sync) == 0

            entered = asyncio.Event()

            async def serve_forever() -> None:
                async with ac.select_and_reserve(token_ids=TOKENS):
                    entered.set()
                    await asyncio.sleep(3600)

            task = asyncio.create_task(serve_forever())
            await asyncio.wait_for(entered.wait(), 10)
            assert active_requests(sync) == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert active_requests(sync) == 0, "a cancelled request frees its booking"

            pending = ac.reserve("never")
            with pytest.raises(kv_select.NotFound):
                await pending
            with pytest.raises(RuntimeError, match="already awaited"):
                await pending

    asyncio.run(scenario())
    sync.close()


def test_async_retries_a_booking_that_never_left() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def scenario() -> int:
        attempts = 0

        async def count(request: Any) -> None:
            nonlocal attempts
            attempts += 1

        import httpx

        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", event_hooks={"request": [count]})
        ac = kv_select.AsyncClient(retries=kv_select.Retries(bookings=2, backoff_s=0.001), http_client=http)
        with pytest.raises(kv_select.TransportError) as failed:
            await ac.reserve("x")
        assert failed.value.sent is False
        await http.aclose()
        return attempts

    assert asyncio.run(scenario()) == 3
