"""What each route sends and how its answer is read, shared by ``Client`` and ``AsyncClient``.

The two clients differ only in how they send a :class:`Call`; building the request,
interpreting the status and deciding whether a failure may be retried live here once, so
the sync and async clients cannot drift apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Literal, Mapping, Sequence, TypedDict, TypeVar
from urllib.parse import quote

from ._errors import (
    ApiError,
    Busy,
    KvSelectError,
    ProtocolError,
    TransportError,
    Unavailable,
    error_class,
)
from ._models import (
    Json,
    OverlapScores,
    PartitionDump,
    PartitionLoads,
    QueueRejection,
    RankLoad,
    Readiness,
    Reservation,
    Selection,
    WorkerRecord,
    dump_from_json,
)

T = TypeVar("T")


# --- request field types (the contract's names; see http-api §3, §3.4, §4.1, §6.1) ---


class RouterConfigOverride(TypedDict, total=False):
    overlap_score_credit: float
    prefill_load_scale: float
    overlap_score_weight: float
    router_temperature: float
    assume_kv_reuse: bool
    track_prefill_tokens: bool
    shared_cache_multiplier: float


class _SessionContextBase(TypedDict):
    session_id: str


class SessionContext(_SessionContextBase, total=False):
    parent_session_id: str
    session_final: bool
    input_trigger: Literal["user_message", "tool_result", "other"]
    agent_headers: Mapping[str, Sequence[str]]


class _AffinityTargetBase(TypedDict):
    worker_id: int


class AffinityTarget(_AffinityTargetBase, total=False):
    dp_rank: int


class PinnedWorker(TypedDict):
    worker_id: int
    dp_rank: int


class RoutingConstraints(TypedDict, total=False):
    required_taints: Sequence[str]
    preferred_taints: Mapping[str, float]


class Prompt(TypedDict, total=False):
    """The prompt, in one of the contract's forms (http-api §3.1): ``token_ids``, the
    multimodal ``mm_routing_info``, or the hash-only trio ``block_hashes`` +
    ``sequence_hashes`` + ``isl_tokens`` (hashes are signed 64-bit, as on the wire)."""

    token_ids: Sequence[int]
    mm_routing_info: Mapping[str, Any]
    block_mm_infos: Sequence[Mapping[str, Any] | None]
    block_hashes: Sequence[int]
    sequence_hashes: Sequence[int]
    isl_tokens: int
    lora_name: str
    cache_salt: str
    is_eagle: bool


class Inspection(Prompt, total=False):
    """Fields of ``/potential_loads`` and ``/overlap_scores``."""

    model_name: str
    routing_group: str
    router_config_override: RouterConfigOverride


class SelectOptions(Inspection, total=False):
    """Fields shared by ``/select`` and ``/select_and_reserve`` (http-api §3.4).

    ``policy_class`` is not a body field: it travels as the ``x-dynamo-meta-policy-class``
    header (http-api §1.6).
    """

    expected_output_tokens: int
    priority_jump: float
    strict_priority: int
    session_id: str
    session_context: SessionContext
    affinity_target: AffinityTarget
    pinned_worker: PinnedWorker
    allowed_worker_ids: Iterable[int]
    routing_constraints: RoutingConstraints
    policy_class: str


class ExplicitReservation(Prompt, total=False):
    """Fields of the explicit ``POST /reservations`` form besides ``selection_id`` and
    ``worker_id`` (http-api §6.1)."""

    model_name: str
    routing_group: str
    dp_rank: int
    router_config_override: RouterConfigOverride
    expected_output_tokens: int
    effective_prefill_tokens: int
    track_prefill_tokens: bool


class WorkerPatch(TypedDict, total=False):
    """Fields ``PATCH /workers/{id}`` may change (http-api §4.4). Rank-keyed maps take int
    ranks; an empty map or list clears the field."""

    endpoint: str
    kv_events_endpoint: str
    kv_events_endpoints: Mapping[int, str]
    replay_endpoint: str
    block_size: int
    data_parallel_start_rank: int
    data_parallel_size: int
    max_num_batched_tokens: int
    total_kv_blocks: int
    stable_routing_id: str
    is_eagle: bool
    taints: Iterable[str]
    topology_domains: Mapping[str, str]
    kv_transfer_domain: str
    kv_transfer_enforcement: Literal["required", "preferred"]
    kv_transfer_preferred_weight: float
    router_hint_worker_type: str
    router_hint_source_control_endpoints: Mapping[int, str]
    kv_event_source_mode: str


class WorkerFields(WorkerPatch, total=False):
    """The worker record of ``POST /workers`` besides ``worker_id`` (http-api §4.1)."""

    model_name: str
    routing_group: str


# --- retries ---


@dataclass(frozen=True)
class Retries:
    """How often a failed call is tried again, and only where the contract makes that safe.

    * ``safe`` extra attempts for calls that book nothing or are idempotent: the reads,
      ``/select`` (it books nothing, and a repeat only replaces its pending entry with an equal
      one), worker upsert and patch (they replace fields with the same values) and
      ``prefill_complete`` (idempotent while the reservation lives). They are retried after any
      transport failure and after a 503.
    * ``bookings`` extra attempts for ``select_and_reserve`` and both ``/reservations`` forms,
      retried only when nothing was booked: a 503 (the contract books nothing and keeps the
      pending selection) or a connection that failed before the request was sent. A timeout
      after sending is never retried, because the booking may have landed. Off by default.
    * ``output_block``, the frees, worker deletes and peer (de)registration are never
      retried: a repeat would append a second block or answer 404 for the first call's work.

    The n-th retry waits ``backoff_s * 2**(n-1)``, at most ``max_backoff_s``.
    """

    safe: int = 2
    bookings: int = 0
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def delay(self, retry: int) -> float:
        return float(min(self.max_backoff_s, self.backoff_s * (2 ** (retry - 1))))


RetryClass = Literal["safe", "booking", "never"]

NO_RETRIES = Retries(safe=0, bookings=0)


@dataclass(frozen=True)
class Call(Generic[T]):
    """One HTTP exchange: what to send, which statuses are answers, and how to read them."""

    method: str
    path: str
    parse: Callable[[int, Json], T]
    retry: RetryClass
    body: Json | None = None
    params: Mapping[str, str] | None = None
    headers: Mapping[str, str] | None = None
    answers: frozenset[int] = frozenset({200, 201})

    def retry_budget(self, retries: Retries) -> int:
        if self.retry == "safe":
            return retries.safe
        if self.retry == "booking":
            return retries.bookings
        return 0

    def may_retry(self, error: KvSelectError) -> bool:
        if self.retry == "never":
            return False
        if isinstance(error, Unavailable):
            return True
        if isinstance(error, TransportError):
            return self.retry == "safe" or not error.sent
        return False

    def interpret(self, status: int, content: bytes) -> T:
        """The parsed answer, or the :class:`ApiError` of the status."""
        decoded: Json = None
        text = content.decode("utf-8", errors="replace")
        try:
            decoded = json.loads(content) if content else None
        except ValueError:
            decoded = None
        if status in self.answers:
            if decoded is None and content:
                raise ProtocolError(f"{self.method} {self.path} -> {status}: not JSON: {text[:200]}")
            return self.parse(status, decoded)
        message = text
        details: QueueRejection | None = None
        if isinstance(decoded, dict) and isinstance(decoded.get("error"), str):
            message = decoded["error"]
            if status == 429 and isinstance(decoded.get("details"), dict):
                details = QueueRejection.from_json(decoded["details"])
        cls = error_class(status)
        error: ApiError
        if cls is Busy:
            error = Busy(status, message, method=self.method, path=self.path, details=details)
        else:
            error = cls(status, message, method=self.method, path=self.path)
        raise error


def transport_error(call: Call[Any], error: Exception, *, sent: bool) -> TransportError:
    return TransportError(f"{type(error).__name__}: {error}", method=call.method, path=call.path, sent=sent)


# --- body building ---


def _wire(value: Any) -> Json:
    """A request value as JSON: rank-keyed maps get string keys (http-api §1.3), sets and other
    iterables become arrays, nested mappings keep their shape."""
    if isinstance(value, Mapping):
        return {str(k): _wire(v) for k, v in value.items()}
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, Iterable):
        return [_wire(v) for v in value]
    return value


def _body(fields: Mapping[str, Any], **required: Any) -> dict[str, Json]:
    """The JSON body: required fields first, then every optional field that was given (None
    means "not given", so the server applies its documented default)."""
    body = {k: _wire(v) for k, v in required.items()}
    body.update({k: _wire(v) for k, v in fields.items() if v is not None})
    return body


def _query(**params: str | None) -> dict[str, str] | None:
    given = {k: v for k, v in params.items() if v is not None}
    return given or None


def _seg(selection_id: str) -> str:
    # Any string is a selection id (http-api §1.5): escape it whole, slashes included.
    return quote(selection_id, safe="")


def _ok(status: int, body: Json) -> None:
    if not (isinstance(body, dict) and body.get("status") == "ok"):
        raise ProtocolError(f'expected {{"status": "ok"}}, got {body!r}')


def _workers(status: int, body: Json) -> list[WorkerRecord]:
    if not isinstance(body, list):
        raise ProtocolError("GET /workers: expected an array")
    return [WorkerRecord.from_json(r) for r in body]


def _worker(status: int, body: Json) -> WorkerRecord:
    return WorkerRecord.from_json(body)


def _strings(status: int, body: Json) -> list[str]:
    if not (isinstance(body, list) and all(isinstance(s, str) for s in body)):
        raise ProtocolError("expected an array of strings")
    return list(body)


# --- one builder per route ---


def health() -> Call[bool]:
    return Call("GET", "/health", lambda s, b: isinstance(b, dict) and b.get("status") == "ok", "safe")


def ready() -> Call[Readiness]:
    # 503 is an answer here, not an error: the same body says why the service is not ready.
    return Call(
        "GET", "/ready", lambda s, b: Readiness.from_json(b), "safe", answers=frozenset({200, 503})
    )


def upsert_worker(worker_id: int, fields: WorkerFields) -> Call[WorkerRecord]:
    return Call("POST", "/workers", _worker, "safe", body=_body(fields, worker_id=worker_id))


def patch_worker(worker_id: int, fields: WorkerPatch) -> Call[WorkerRecord]:
    return Call("PATCH", f"/workers/{int(worker_id)}", _worker, "safe", body=_body(fields))


def delete_worker(worker_id: int) -> Call[WorkerRecord]:
    return Call("DELETE", f"/workers/{int(worker_id)}", _worker, "never")


def list_workers(model_name: str | None, routing_group: str | None) -> Call[list[WorkerRecord]]:
    return Call(
        "GET", "/workers", _workers, "safe", params=_query(model_name=model_name, routing_group=routing_group)
    )


def _selection_call(path: str, retry: RetryClass, options: SelectOptions, **required: Any) -> Call[Selection]:
    fields = dict(options)
    policy_class = fields.pop("policy_class", None)
    headers = None if policy_class is None else {"x-dynamo-meta-policy-class": str(policy_class)}
    return Call(
        "POST",
        path,
        lambda s, b: Selection.from_json(b),
        retry,
        body=_body(fields, **required),
        headers=headers,
    )


def select(selection_id: str | None, advisory: bool, options: SelectOptions) -> Call[Selection]:
    required: dict[str, Any] = {}
    if selection_id is not None:
        required["selection_id"] = selection_id
    if advisory:
        required["advisory"] = True
    return _selection_call("/select", "safe", options, **required)


def select_and_reserve(selection_id: str | None, options: SelectOptions) -> Call[Selection]:
    required: dict[str, Any] = {} if selection_id is None else {"selection_id": selection_id}
    return _selection_call("/select_and_reserve", "booking", options, **required)


def _reservation(status: int, body: Json) -> Reservation:
    return Reservation.from_json(body)


def reserve(selection_id: str, model_name: str | None, routing_group: str | None) -> Call[Reservation]:
    body = _body({"model_name": model_name, "routing_group": routing_group}, selection_id=selection_id)
    return Call("POST", "/reservations", _reservation, "booking", body=body)


def reserve_explicit(selection_id: str, worker_id: int, fields: ExplicitReservation) -> Call[Reservation]:
    body = _body(fields, selection_id=selection_id, worker_id=worker_id)
    return Call("POST", "/reservations", _reservation, "booking", body=body)


def prefill_complete(selection_id: str) -> Call[None]:
    return Call("POST", f"/reservations/{_seg(selection_id)}/prefill_complete", _ok, "safe")


def output_block(selection_id: str, decay_fraction: float | None) -> Call[None]:
    body = _body({"decay_fraction": decay_fraction})
    return Call("POST", f"/reservations/{_seg(selection_id)}/output_block", _ok, "never", body=body)


def free(selection_id: str) -> Call[None]:
    return Call("DELETE", f"/reservations/{_seg(selection_id)}", _ok, "never")


def loads(model_name: str | None, routing_group: str | None) -> Call[list[PartitionLoads]]:
    def parse(status: int, body: Json) -> list[PartitionLoads]:
        if not isinstance(body, list):
            raise ProtocolError("GET /loads: expected an array")
        return [PartitionLoads.from_json(p) for p in body]

    return Call("GET", "/loads", parse, "safe", params=_query(model_name=model_name, routing_group=routing_group))


def potential_loads(fields: Inspection) -> Call[list[RankLoad]]:
    def parse(status: int, body: Json) -> list[RankLoad]:
        if not isinstance(body, list):
            raise ProtocolError("POST /potential_loads: expected an array")
        return [RankLoad.from_json(r) for r in body]

    return Call("POST", "/potential_loads", parse, "safe", body=_body(fields))


def overlap_scores(fields: Inspection) -> Call[OverlapScores]:
    return Call("POST", "/overlap_scores", lambda s, b: OverlapScores.from_json(b), "safe", body=_body(fields))


def dump() -> Call[dict[str, PartitionDump]]:
    return Call("GET", "/dump", lambda s, b: dump_from_json(b), "safe")


def replica_peers() -> Call[list[str]]:
    return Call("GET", "/replica_sync/peers", _strings, "safe")


def register_replica_peer(endpoint: str) -> Call[bool]:
    # 201: newly connected; 200: it was registered already (http-api §9.1).
    def parse(status: int, body: Json) -> bool:
        _ok(status, body)
        return status == 201

    return Call("POST", "/replica_sync/register_peer", parse, "never", body={"endpoint": endpoint})


def deregister_replica_peer(endpoint: str) -> Call[None]:
    return Call("POST", "/replica_sync/deregister_peer", _ok, "never", body={"endpoint": endpoint})
