"""``Client`` (blocking) and ``AsyncClient`` (asyncio): the same methods, names and types.

Every method builds its request with :mod:`kv_select._calls` and only the sending differs,
which is what keeps the two clients in step (a test compares their signatures).
"""

from __future__ import annotations

import asyncio
import json
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, Awaitable, Coroutine, Generator, TypeVar

import httpx

from . import _calls
from ._calls import Call, Retries, transport_error
from ._errors import KvSelectError, NotFound
from ._models import (
    OverlapScores,
    PartitionDump,
    PartitionLoads,
    RankLoad,
    Readiness,
    Reservation,
    Selection,
    WorkerRecord,
)

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

    from ._calls import ExplicitReservation, Inspection, SelectOptions, WorkerFields, WorkerPatch

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8092"
# A non-advisory /select (and /select_and_reserve) may wait in the admission queue for
# capacity; the default leaves it room before the client gives up.
DEFAULT_TIMEOUT_S = 30.0

# httpx failures that happen before any byte of the request reached the server.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def _headers(token: str | None, call: Call[Any]) -> dict[str, str]:
    headers = dict(call.headers or {})
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    if call.body is not None:
        headers["content-type"] = "application/json"
    return headers


def _content(call: Call[Any]) -> bytes | None:
    """The body as compact JSON, whatever the httpx version: httpx 0.27 writes ``", "``
    between array elements, and the server parses ``token_ids`` 64 bytes at a time only
    when they are separated by bare commas (docs/hot-path.md)."""
    if call.body is None:
        return None
    return json.dumps(call.body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _note_free_failure(exc: BaseException, selection_id: str, error: KvSelectError) -> None:
    # The body's exception is what the caller needs to see; the failed free rides along.
    add_note = getattr(exc, "add_note", None)
    if callable(add_note):
        add_note(f"kv_select: freeing reservation {selection_id!r} on exit also failed: {error}")


class _HandleBase:
    def __init__(self, reservation: Reservation, selection: Selection | None) -> None:
        self.reservation = reservation
        """What ``POST /reservations`` (or ``/select_and_reserve``) booked."""
        self.selection = selection
        """The full selection when the booking came from ``select_and_reserve``."""
        self._freed = False

    @property
    def selection_id(self) -> str:
        return self.reservation.selection_id

    @property
    def worker_id(self) -> int:
        return self.reservation.worker_id

    @property
    def dp_rank(self) -> int:
        return self.reservation.dp_rank

    @property
    def endpoint(self) -> str:
        return self.reservation.endpoint

    @property
    def freed(self) -> bool:
        """Whether the reservation is known to be gone (freed here, or found already gone)."""
        return self._freed

    def __repr__(self) -> str:
        state = "freed" if self._freed else "live"
        return f"<{type(self).__name__} {self.selection_id!r} worker={self.worker_id} rank={self.dp_rank} {state}>"


class ReservationHandle(_HandleBase):
    """A live booking. As a context manager it frees the booking on exit, also when the
    body raised; the body's exception is never replaced by a failure of that free."""

    def __init__(self, client: Client, reservation: Reservation, selection: Selection | None = None) -> None:
        super().__init__(reservation, selection)
        self._client = client

    def prefill_complete(self) -> None:
        self._client.prefill_complete(self.selection_id)

    def output_block(self, decay_fraction: float | None = None) -> None:
        self._client.output_block(self.selection_id, decay_fraction=decay_fraction)

    def free(self) -> bool:
        """Frees the booking: true if this call freed it, false if it was already gone (freed
        before, expired, or its worker was removed). Other errors propagate."""
        if self._freed:
            return False
        try:
            self._client.free(self.selection_id)
        except NotFound:
            self._freed = True
            return False
        self._freed = True
        return True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.free()
            return
        try:
            self.free()
        except KvSelectError as error:
            _note_free_failure(exc, self.selection_id, error)


class AsyncReservationHandle(_HandleBase):
    """:class:`ReservationHandle` for :class:`AsyncClient` (``async with``)."""

    def __init__(
        self, client: AsyncClient, reservation: Reservation, selection: Selection | None = None
    ) -> None:
        super().__init__(reservation, selection)
        self._client = client

    async def prefill_complete(self) -> None:
        await self._client.prefill_complete(self.selection_id)

    async def output_block(self, decay_fraction: float | None = None) -> None:
        await self._client.output_block(self.selection_id, decay_fraction=decay_fraction)

    async def free(self) -> bool:
        """See :meth:`ReservationHandle.free`."""
        if self._freed:
            return False
        try:
            await self._client.free(self.selection_id)
        except NotFound:
            self._freed = True
            return False
        self._freed = True
        return True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.free()
            return
        try:
            # A cancelled task still frees its booking: the free is shielded from the
            # cancellation that is unwinding the body.
            await asyncio.shield(self.free())
        except KvSelectError as error:
            _note_free_failure(exc, self.selection_id, error)


class PendingReservation(Awaitable[AsyncReservationHandle]):
    """What the async booking methods return: await it for the handle, or use it directly as
    ``async with client.reserve(...) as r:``, which books on entry and frees on exit."""

    def __init__(self, booking: Coroutine[Any, Any, AsyncReservationHandle]) -> None:
        self._booking: Coroutine[Any, Any, AsyncReservationHandle] | None = booking
        self._handle: AsyncReservationHandle | None = None

    def __await__(self) -> Generator[Any, None, AsyncReservationHandle]:
        return self._take().__await__()

    def _take(self) -> Coroutine[Any, Any, AsyncReservationHandle]:
        if self._booking is None:
            raise RuntimeError("this reservation was already awaited or entered")
        booking, self._booking = self._booking, None
        return booking

    async def __aenter__(self) -> AsyncReservationHandle:
        self._handle = await self._take()
        return self._handle

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            await self._handle.__aexit__(exc_type, exc, tb)

    def __del__(self) -> None:
        # Never awaited: close the coroutine so Python does not warn about it; nothing was sent.
        if self._booking is not None:
            self._booking.close()


class Client:
    """Blocking client of one kv-select server.

    ``token`` is sent as ``Authorization: Bearer <token>`` (servers started with
    ``--auth-token-file``). ``retries`` says which failures are tried again (see
    :class:`Retries`; bookings are not retried by default). Pass ``http_client`` to bring
    your own ``httpx.Client`` (proxies, TLS, transports); it is then yours to close.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: Retries = Retries(),
        http_client: httpx.Client | None = None,
    ) -> None:
        self._token = token
        self._retries = retries
        self._owned = http_client is None
        self._http = http_client or httpx.Client(base_url=base_url, timeout=timeout)

    def close(self) -> None:
        if self._owned:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self, call: Call[T]) -> T:
        retry = 0
        while True:
            try:
                return self._send(call)
            except KvSelectError as error:
                if retry >= call.retry_budget(self._retries) or not call.may_retry(error):
                    raise
                retry += 1
                time.sleep(self._retries.delay(retry))

    def _send(self, call: Call[T]) -> T:
        try:
            response = self._http.request(
                call.method,
                call.path,
                content=_content(call),
                params=call.params,
                headers=_headers(self._token, call),
            )
        except _NOT_SENT as error:
            raise transport_error(call, error, sent=False) from error
        except httpx.TransportError as error:
            raise transport_error(call, error, sent=True) from error
        return call.interpret(response.status_code, response.content)

    # health and catalog

    def health(self) -> bool:
        """``GET /health``: whether the process serves HTTP."""
        return self._run(_calls.health())

    def ready(self) -> Readiness:
        """``GET /ready``; a not-ready service answers (503) rather than raising."""
        return self._run(_calls.ready())

    def upsert_worker(self, worker_id: int, **fields: Unpack[WorkerFields]) -> WorkerRecord:
        """``POST /workers``: replaces the whole record of ``worker_id``. An incomplete
        record is not an error: check ``lifecycle`` / ``not_schedulable_reasons``."""
        return self._run(_calls.upsert_worker(worker_id, fields))

    def patch_worker(self, worker_id: int, **fields: Unpack[WorkerPatch]) -> WorkerRecord:
        """``PATCH /workers/{id}``: changes only the given fields."""
        return self._run(_calls.patch_worker(worker_id, fields))

    def delete_worker(self, worker_id: int) -> WorkerRecord:
        """``DELETE /workers/{id}``: the final record (``lifecycle == "unschedulable"``)."""
        return self._run(_calls.delete_worker(worker_id))

    def list_workers(self, model_name: str | None = None, routing_group: str | None = None) -> list[WorkerRecord]:
        """``GET /workers``, optionally one model and/or routing group."""
        return self._run(_calls.list_workers(model_name, routing_group))

    # selection and reservations

    def select(
        self, *, selection_id: str | None = None, advisory: bool = False, **options: Unpack[SelectOptions]
    ) -> Selection:
        """``POST /select``: picks a worker and books nothing. With a ``selection_id`` the
        choice is cached for :meth:`reserve` (the replay form). ``advisory`` skips the
        admission queue and reports ``worker_load``."""
        return self._run(_calls.select(selection_id, advisory, options))

    def select_and_reserve(
        self, *, selection_id: str | None = None, **options: Unpack[SelectOptions]
    ) -> ReservationHandle:
        """``POST /select_and_reserve``: selects and books in one step; the handle's
        ``selection`` has the full answer. Without a ``selection_id`` the server makes one."""
        selection = self._run(_calls.select_and_reserve(selection_id, options))
        return ReservationHandle(self, Reservation.of_selection(selection), selection)

    def reserve(
        self, selection_id: str, *, model_name: str | None = None, routing_group: str | None = None
    ) -> ReservationHandle:
        """``POST /reservations``, replay form: books exactly what the ``select`` cached under
        this id. :class:`NotFound` with ``no_pending_selection`` means there is nothing to
        replay; book with :meth:`reserve_explicit` instead."""
        return ReservationHandle(self, self._run(_calls.reserve(selection_id, model_name, routing_group)))

    def reserve_explicit(
        self, selection_id: str, worker_id: int, **fields: Unpack[ExplicitReservation]
    ) -> ReservationHandle:
        """``POST /reservations``, explicit form: books the prompt on ``worker_id`` (rank
        ``dp_rank``, default 0). It discards any cached selection under the id first."""
        return ReservationHandle(self, self._run(_calls.reserve_explicit(selection_id, worker_id, fields)))

    def prefill_complete(self, selection_id: str) -> None:
        """``POST /reservations/{id}/prefill_complete``: the prompt is prefilled; its prefill
        load is cleared. Repeating it is harmless while the reservation lives."""
        self._run(_calls.prefill_complete(selection_id))

    def output_block(self, selection_id: str, decay_fraction: float | None = None) -> None:
        """``POST /reservations/{id}/output_block``: one more output block, optionally with
        the decay weight ``decay_fraction`` in [0, 1]."""
        self._run(_calls.output_block(selection_id, decay_fraction))

    def free(self, selection_id: str) -> None:
        """``DELETE /reservations/{id}``: frees the booking (:class:`NotFound` if gone)."""
        self._run(_calls.free(selection_id))

    # inspection

    def loads(self, model_name: str | None = None, routing_group: str | None = None) -> list[PartitionLoads]:
        """``GET /loads``: per-rank load of every partition (or the matching ones)."""
        return self._run(_calls.loads(model_name, routing_group))

    def potential_loads(self, **fields: Unpack[Inspection]) -> list[RankLoad]:
        """``POST /potential_loads``: each rank's load if this prompt were added to it."""
        return self._run(_calls.potential_loads(fields))

    def overlap_scores(self, **fields: Unpack[Inspection]) -> OverlapScores:
        """``POST /overlap_scores``: cached blocks of this prompt per worker rank."""
        return self._run(_calls.overlap_scores(fields))

    def dump(self) -> dict[str, PartitionDump]:
        """``GET /dump``: the KV-index snapshot, keyed ``"<model_name>:<routing_group>"``."""
        return self._run(_calls.dump())

    # replica mesh

    def replica_peers(self) -> list[str]:
        """``GET /replica_sync/peers``: the configured replica-sync endpoints."""
        return self._run(_calls.replica_peers())

    def register_replica_peer(self, endpoint: str) -> bool:
        """``POST /replica_sync/register_peer``: true if newly connected, false if it was
        registered already. :class:`Conflict` when the server runs without replica sync."""
        return self._run(_calls.register_replica_peer(endpoint))

    def deregister_replica_peer(self, endpoint: str) -> None:
        """``POST /replica_sync/deregister_peer`` (:class:`NotFound` if not registered)."""
        self._run(_calls.deregister_replica_peer(endpoint))


class AsyncClient:
    """:class:`Client` for asyncio: the same constructor and methods, each a coroutine; the
    booking methods return a :class:`PendingReservation` (await it, or ``async with`` it)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: Retries = Retries(),
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self._token = token
        self._retries = retries
        self._owned = http_client is None
        self._http = http_client or httpx.AsyncClient(base_url=base_url, timeout=timeout)

    async def close(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _run(self, call: Call[T]) -> T:
        retry = 0
        while True:
            try:
                return await self._send(call)
            except KvSelectError as error:
                if retry >= call.retry_budget(self._retries) or not call.may_retry(error):
                    raise
                retry += 1
                await asyncio.sleep(self._retries.delay(retry))

    async def _send(self, call: Call[T]) -> T:
        try:
            response = await self._http.request(
                call.method,
                call.path,
                content=_content(call),
                params=call.params,
                headers=_headers(self._token, call),
            )
        except _NOT_SENT as error:
            raise transport_error(call, error, sent=False) from error
        except httpx.TransportError as error:
            raise transport_error(call, error, sent=True) from error
        return call.interpret(response.status_code, response.content)

    def _booking(self, call: Call[Reservation]) -> PendingReservation:
        async def book() -> AsyncReservationHandle:
            return AsyncReservationHandle(self, await self._run(call))

        return PendingReservation(book())

    async def health(self) -> bool:
        return await self._run(_calls.health())

    async def ready(self) -> Readiness:
        return await self._run(_calls.ready())

    async def upsert_worker(self, worker_id: int, **fields: Unpack[WorkerFields]) -> WorkerRecord:
        return await self._run(_calls.upsert_worker(worker_id, fields))

    async def patch_worker(self, worker_id: int, **fields: Unpack[WorkerPatch]) -> WorkerRecord:
        return await self._run(_calls.patch_worker(worker_id, fields))

    async def delete_worker(self, worker_id: int) -> WorkerRecord:
        return await self._run(_calls.delete_worker(worker_id))

    async def list_workers(
        self, model_name: str | None = None, routing_group: str | None = None
    ) -> list[WorkerRecord]:
        return await self._run(_calls.list_workers(model_name, routing_group))

    async def select(
        self, *, selection_id: str | None = None, advisory: bool = False, **options: Unpack[SelectOptions]
    ) -> Selection:
        return await self._run(_calls.select(selection_id, advisory, options))

    def select_and_reserve(
        self, *, selection_id: str | None = None, **options: Unpack[SelectOptions]
    ) -> PendingReservation:
        call = _calls.select_and_reserve(selection_id, options)

        async def book() -> AsyncReservationHandle:
            selection = await self._run(call)
            return AsyncReservationHandle(self, Reservation.of_selection(selection), selection)

        return PendingReservation(book())

    def reserve(
        self, selection_id: str, *, model_name: str | None = None, routing_group: str | None = None
    ) -> PendingReservation:
        return self._booking(_calls.reserve(selection_id, model_name, routing_group))

    def reserve_explicit(
        self, selection_id: str, worker_id: int, **fields: Unpack[ExplicitReservation]
    ) -> PendingReservation:
        return self._booking(_calls.reserve_explicit(selection_id, worker_id, fields))

    async def prefill_complete(self, selection_id: str) -> None:
        await self._run(_calls.prefill_complete(selection_id))

    async def output_block(self, selection_id: str, decay_fraction: float | None = None) -> None:
        await self._run(_calls.output_block(selection_id, decay_fraction))

    async def free(self, selection_id: str) -> None:
        await self._run(_calls.free(selection_id))

    async def loads(
        self, model_name: str | None = None, routing_group: str | None = None
    ) -> list[PartitionLoads]:
        return await self._run(_calls.loads(model_name, routing_group))

    async def potential_loads(self, **fields: Unpack[Inspection]) -> list[RankLoad]:
        return await self._run(_calls.potential_loads(fields))

    async def overlap_scores(self, **fields: Unpack[Inspection]) -> OverlapScores:
        return await self._run(_calls.overlap_scores(fields))

    async def dump(self) -> dict[str, PartitionDump]:
        return await self._run(_calls.dump())

    async def replica_peers(self) -> list[str]:
        return await self._run(_calls.replica_peers())

    async def register_replica_peer(self, endpoint: str) -> bool:
        return await self._run(_calls.register_replica_peer(endpoint))

    async def deregister_replica_peer(self, endpoint: str) -> None:
        await self._run(_calls.deregister_replica_peer(endpoint))


__all__ = [
    "AsyncClient",
    "AsyncReservationHandle",
    "Client",
    "PendingReservation",
    "ReservationHandle",
]
