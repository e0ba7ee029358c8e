"""Response objects: small frozen dataclasses named and shaped as in the HTTP contract.

Each ``from_json`` reads the fields the contract defines and ignores any others, so a newer
server that adds fields keeps working with this client (the contract's own rule for request
bodies, applied to responses). A response that lacks a required field or carries a value of
the wrong type raises :class:`~kv_select.ProtocolError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from ._errors import ProtocolError

T = TypeVar("T")

Json = Any
"""A decoded JSON value (what ``json.loads`` returns)."""


def _obj(value: Json, what: str) -> Mapping[str, Json]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def _list(value: Json, what: str) -> list[Json]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what}: expected a JSON array, got {type(value).__name__}")
    return value


def _req(d: Mapping[str, Json], key: str, kind: type[T], what: str) -> T:
    if key not in d:
        raise ProtocolError(f"{what}: missing field {key!r}")
    return _typed(d[key], kind, f"{what}.{key}")


def _opt(d: Mapping[str, Json], key: str, kind: type[T], what: str) -> T | None:
    value = d.get(key)
    if value is None:
        return None
    return _typed(value, kind, f"{what}.{key}")


def _typed(value: Json, kind: type[T], what: str) -> T:
    # bool is an int subclass in Python; a JSON true must not pass as a count.
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # type: ignore[return-value]
    if not ok:
        raise ProtocolError(f"{what}: expected {kind.__name__}, got {type(value).__name__}")
    return value  # type: ignore[no-any-return]


def _ints(value: Json, what: str) -> list[int]:
    return [_typed(v, int, f"{what}[{i}]") for i, v in enumerate(_list(value, what))]


def _strs(value: Json, what: str) -> list[str]:
    return [_typed(v, str, f"{what}[{i}]") for i, v in enumerate(_list(value, what))]


def _str_map(value: Json, what: str) -> dict[str, str]:
    return {k: _typed(v, str, f"{what}.{k}") for k, v in _obj(value, what).items()}


def _rank_map(value: Json, what: str) -> dict[int, str]:
    # Ranks travel as decimal string keys (http-api §1.3); callers get them back as ints.
    ranks: dict[int, str] = {}
    for rank, v in _obj(value, what).items():
        if not rank.isdigit():
            raise ProtocolError(f"{what}: rank key {rank!r} is not a number")
        ranks[int(rank)] = _typed(v, str, f"{what}.{rank}")
    return ranks


@dataclass(frozen=True)
class WorkerRecord:
    """A worker catalog record (http-api §4.2), as returned by every ``/workers`` route."""

    worker_id: int
    model_name: str
    routing_group: str
    lifecycle: str
    """``schedulable``, ``incomplete``, ``draining`` or ``unschedulable``."""
    endpoint: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_endpoints: dict[int, str] = field(default_factory=dict)
    replay_endpoint: str | None = None
    block_size: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_size: int | None = None
    max_num_batched_tokens: int | None = None
    total_kv_blocks: int | None = None
    stable_routing_id: str | None = None
    is_eagle: bool | None = None
    taints: list[str] = field(default_factory=list)
    topology_domains: dict[str, str] = field(default_factory=dict)
    kv_transfer_domain: str | None = None
    kv_transfer_enforcement: str | None = None
    kv_transfer_preferred_weight: float | None = None
    router_hint_worker_type: str | None = None
    router_hint_source_control_endpoints: dict[int, str] = field(default_factory=dict)
    kv_event_source_mode: str | None = None
    not_schedulable_reasons: list[str] = field(default_factory=list)

    @property
    def schedulable(self) -> bool:
        return self.lifecycle == "schedulable"

    @staticmethod
    def from_json(value: Json) -> WorkerRecord:
        w = "worker record"
        d = _obj(value, w)
        return WorkerRecord(
            worker_id=_req(d, "worker_id", int, w),
            model_name=_req(d, "model_name", str, w),
            routing_group=_req(d, "routing_group", str, w),
            lifecycle=_req(d, "lifecycle", str, w),
            endpoint=_opt(d, "endpoint", str, w),
            kv_events_endpoint=_opt(d, "kv_events_endpoint", str, w),
            kv_events_endpoints=_rank_map(d.get("kv_events_endpoints") or {}, f"{w}.kv_events_endpoints"),
            replay_endpoint=_opt(d, "replay_endpoint", str, w),
            block_size=_opt(d, "block_size", int, w),
            data_parallel_start_rank=_opt(d, "data_parallel_start_rank", int, w),
            data_parallel_size=_opt(d, "data_parallel_size", int, w),
            max_num_batched_tokens=_opt(d, "max_num_batched_tokens", int, w),
            total_kv_blocks=_opt(d, "total_kv_blocks", int, w),
            stable_routing_id=_opt(d, "stable_routing_id", str, w),
            is_eagle=_opt(d, "is_eagle", bool, w),
            taints=_strs(d.get("taints") or [], f"{w}.taints"),
            topology_domains=_str_map(d.get("topology_domains") or {}, f"{w}.topology_domains"),
            kv_transfer_domain=_opt(d, "kv_transfer_domain", str, w),
            kv_transfer_enforcement=_opt(d, "kv_transfer_enforcement", str, w),
            kv_transfer_preferred_weight=_opt(d, "kv_transfer_preferred_weight", float, w),
            router_hint_worker_type=_opt(d, "router_hint_worker_type", str, w),
            router_hint_source_control_endpoints=_rank_map(
                d.get("router_hint_source_control_endpoints") or {},
                f"{w}.router_hint_source_control_endpoints",
            ),
            kv_event_source_mode=_opt(d, "kv_event_source_mode", str, w),
            not_schedulable_reasons=_strs(
                d.get("not_schedulable_reasons") or [], f"{w}.not_schedulable_reasons"
            ),
        )


@dataclass(frozen=True)
class Readiness:
    """``GET /ready`` (http-api §7.2): the same body whether the status is 200 or 503."""

    ready: bool
    schedulable_workers: int
    workers: list[WorkerRecord]

    @staticmethod
    def from_json(value: Json) -> Readiness:
        w = "readiness"
        d = _obj(value, w)
        return Readiness(
            ready=_req(d, "ready", bool, w),
            schedulable_workers=_req(d, "schedulable_workers", int, w),
            workers=[WorkerRecord.from_json(r) for r in _list(d.get("workers", []), f"{w}.workers")],
        )


@dataclass(frozen=True)
class Overlap:
    """Matched *token* counts of the chosen worker (http-api §5.1); ``dp`` is keyed by rank."""

    longest_matched: int
    gpu: int
    cpu: int
    disk: int
    dp: dict[int, int]

    @staticmethod
    def from_json(value: Json) -> Overlap:
        w = "overlap"
        d = _obj(value, w)
        dp: dict[int, int] = {}
        for rank, tokens in _obj(d.get("dp", {}), f"{w}.dp").items():
            if not rank.isdigit():
                raise ProtocolError(f"{w}.dp: rank key {rank!r} is not a number")
            dp[int(rank)] = _typed(tokens, int, f"{w}.dp.{rank}")
        return Overlap(
            longest_matched=_req(d, "longest_matched", int, w),
            gpu=_req(d, "gpu", int, w),
            cpu=_req(d, "cpu", int, w),
            disk=_req(d, "disk", int, w),
            dp=dp,
        )


@dataclass(frozen=True)
class WorkerLoad:
    """``worker_load`` of an advisory ``/select`` (http-api §5.2)."""

    active_prefill_tokens: int
    prefill_token_capacity: int
    total_kv_blocks: int | None = None
    prefill_busy: bool | None = None

    @staticmethod
    def from_json(value: Json) -> WorkerLoad:
        w = "worker_load"
        d = _obj(value, w)
        return WorkerLoad(
            active_prefill_tokens=_req(d, "active_prefill_tokens", int, w),
            prefill_token_capacity=_req(d, "prefill_token_capacity", int, w),
            total_kv_blocks=_opt(d, "total_kv_blocks", int, w),
            prefill_busy=_opt(d, "prefill_busy", bool, w),
        )


@dataclass(frozen=True)
class KvHintAction:
    action_id: str
    action_type: str
    action_version: str
    payload: dict[str, Json]
    """For ``kv.fetch``: ``source_control_endpoint`` and ``block_hashes``."""


@dataclass(frozen=True)
class KvHint:
    """A KV-transfer hint attached to a booking (http-api §5.4)."""

    protocol_version: str
    message_id: str
    actions: list[KvHintAction]

    @staticmethod
    def from_json(value: Json) -> KvHint:
        w = "kv_hint"
        d = _obj(value, w)
        actions = []
        for i, a in enumerate(_list(d.get("actions", []), f"{w}.actions")):
            aw = f"{w}.actions[{i}]"
            ad = _obj(a, aw)
            actions.append(
                KvHintAction(
                    action_id=_req(ad, "action_id", str, aw),
                    action_type=_req(ad, "action_type", str, aw),
                    action_version=_req(ad, "action_version", str, aw),
                    payload=dict(_obj(ad.get("payload", {}), f"{aw}.payload")),
                )
            )
        return KvHint(
            protocol_version=_req(d, "protocol_version", str, w),
            message_id=_req(d, "message_id", str, w),
            actions=actions,
        )


@dataclass(frozen=True)
class Selection:
    """The answer of ``/select`` and ``/select_and_reserve`` (http-api §5.1).

    ``sequence_hashes``, ``isl_tokens`` and ``track_prefill_tokens`` are set by
    ``/select_and_reserve`` only, ``worker_load`` by an advisory ``/select`` only,
    ``kv_hint`` by bookings only; ``selection_id`` is ``None`` for a ``/select`` without one.
    """

    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    endpoint: str
    block_size: int
    overlap: Overlap
    effective_prefill_tokens: int
    potential_decode_blocks: int
    selection_id: str | None = None
    sequence_hashes: list[int] | None = None
    isl_tokens: int | None = None
    track_prefill_tokens: bool | None = None
    decode_busy: bool | None = None
    worker_load: WorkerLoad | None = None
    kv_hint: KvHint | None = None

    @staticmethod
    def from_json(value: Json) -> Selection:
        w = "selection"
        d = _obj(value, w)
        return Selection(
            model_name=_req(d, "model_name", str, w),
            routing_group=_req(d, "routing_group", str, w),
            worker_id=_req(d, "worker_id", int, w),
            dp_rank=_req(d, "dp_rank", int, w),
            endpoint=_req(d, "endpoint", str, w),
            block_size=_req(d, "block_size", int, w),
            overlap=Overlap.from_json(d.get("overlap")),
            effective_prefill_tokens=_req(d, "effective_prefill_tokens", int, w),
            potential_decode_blocks=_req(d, "potential_decode_blocks", int, w),
            selection_id=_opt(d, "selection_id", str, w),
            sequence_hashes=(
                None
                if d.get("sequence_hashes") is None
                else _ints(d["sequence_hashes"], f"{w}.sequence_hashes")
            ),
            isl_tokens=_opt(d, "isl_tokens", int, w),
            track_prefill_tokens=_opt(d, "track_prefill_tokens", bool, w),
            decode_busy=_opt(d, "decode_busy", bool, w),
            worker_load=None if d.get("worker_load") is None else WorkerLoad.from_json(d["worker_load"]),
            kv_hint=None if d.get("kv_hint") is None else KvHint.from_json(d["kv_hint"]),
        )


@dataclass(frozen=True)
class Reservation:
    """The 201 body of ``POST /reservations`` (http-api §6.1)."""

    selection_id: str
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    endpoint: str

    @staticmethod
    def from_json(value: Json) -> Reservation:
        w = "reservation"
        d = _obj(value, w)
        return Reservation(
            selection_id=_req(d, "selection_id", str, w),
            model_name=_req(d, "model_name", str, w),
            routing_group=_req(d, "routing_group", str, w),
            worker_id=_req(d, "worker_id", int, w),
            dp_rank=_req(d, "dp_rank", int, w),
            endpoint=_req(d, "endpoint", str, w),
        )

    @staticmethod
    def of_selection(s: Selection) -> Reservation:
        """The reservation a ``/select_and_reserve`` booked (its id is always set there)."""
        if s.selection_id is None:
            raise ProtocolError("select_and_reserve answered without a selection_id")
        return Reservation(
            selection_id=s.selection_id,
            model_name=s.model_name,
            routing_group=s.routing_group,
            worker_id=s.worker_id,
            dp_rank=s.dp_rank,
            endpoint=s.endpoint,
        )


@dataclass(frozen=True)
class RankLoad:
    """One DP rank's load: a row of ``GET /loads`` and of ``POST /potential_loads``."""

    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int

    @staticmethod
    def from_json(value: Json) -> RankLoad:
        w = "load"
        d = _obj(value, w)
        return RankLoad(
            worker_id=_req(d, "worker_id", int, w),
            dp_rank=_req(d, "dp_rank", int, w),
            potential_prefill_tokens=_req(d, "potential_prefill_tokens", int, w),
            potential_decode_blocks=_req(d, "potential_decode_blocks", int, w),
            active_requests=_req(d, "active_requests", int, w),
        )


@dataclass(frozen=True)
class PartitionLoads:
    """One partition of ``GET /loads`` (http-api §8.1)."""

    model_name: str
    routing_group: str
    loads: list[RankLoad]
    pending_count: int
    pending_isl_tokens: int

    @property
    def active_requests(self) -> int:
        """Live reservations over all ranks of the partition."""
        return sum(r.active_requests for r in self.loads)

    @staticmethod
    def from_json(value: Json) -> PartitionLoads:
        w = "partition loads"
        d = _obj(value, w)
        return PartitionLoads(
            model_name=_req(d, "model_name", str, w),
            routing_group=_req(d, "routing_group", str, w),
            loads=[RankLoad.from_json(r) for r in _list(d.get("loads", []), f"{w}.loads")],
            pending_count=_req(d, "pending_count", int, w),
            pending_isl_tokens=_req(d, "pending_isl_tokens", int, w),
        )


@dataclass(frozen=True)
class OverlapRow:
    """One (worker, rank) of ``POST /overlap_scores``; units are blocks (http-api §8.3)."""

    worker_id: int
    dp_rank: int
    device_blocks: int
    host_pinned_blocks: int
    disk_blocks: int
    host_pinned_extension_blocks: int
    disk_extension_blocks: int
    shared_beyond_device_blocks: int | None = None

    @staticmethod
    def from_json(value: Json) -> OverlapRow:
        w = "overlap row"
        d = _obj(value, w)
        return OverlapRow(
            worker_id=_req(d, "worker_id", int, w),
            dp_rank=_req(d, "dp_rank", int, w),
            device_blocks=_req(d, "device_blocks", int, w),
            host_pinned_blocks=_req(d, "host_pinned_blocks", int, w),
            disk_blocks=_req(d, "disk_blocks", int, w),
            host_pinned_extension_blocks=_req(d, "host_pinned_extension_blocks", int, w),
            disk_extension_blocks=_req(d, "disk_extension_blocks", int, w),
            shared_beyond_device_blocks=_opt(d, "shared_beyond_device_blocks", int, w),
        )


@dataclass(frozen=True)
class SharedCache:
    enabled: bool
    total_hit_blocks: int
    ranges: list[Json]
    error: str | None = None

    @staticmethod
    def from_json(value: Json) -> SharedCache:
        w = "shared_cache"
        d = _obj(value, w)
        return SharedCache(
            enabled=_req(d, "enabled", bool, w),
            total_hit_blocks=_req(d, "total_hit_blocks", int, w),
            ranges=_list(d.get("ranges", []), f"{w}.ranges"),
            error=_opt(d, "error", str, w),
        )


@dataclass(frozen=True)
class OverlapScores:
    """``POST /overlap_scores`` (http-api §8.3)."""

    block_size: int
    num_blocks: int
    workers: list[OverlapRow]
    shared_cache: SharedCache

    @staticmethod
    def from_json(value: Json) -> OverlapScores:
        w = "overlap scores"
        d = _obj(value, w)
        return OverlapScores(
            block_size=_req(d, "block_size", int, w),
            num_blocks=_req(d, "num_blocks", int, w),
            workers=[OverlapRow.from_json(r) for r in _list(d.get("workers", []), f"{w}.workers")],
            shared_cache=SharedCache.from_json(d.get("shared_cache", {})),
        )


@dataclass(frozen=True)
class PartitionDump:
    """One partition of ``GET /dump``: its block size and index events, or the error that
    stopped its dump. ``events`` stay raw JSON: they are the recovery format another selector
    reads back (replica-sync §9), so they pass through unchanged."""

    block_size: int | None
    events: list[dict[str, Json]]
    error: str | None = None

    @staticmethod
    def from_json(value: Json, what: str) -> PartitionDump:
        d = _obj(value, what)
        return PartitionDump(
            block_size=_opt(d, "block_size", int, what),
            events=[dict(_obj(e, f"{what}.events")) for e in _list(d.get("events", []), f"{what}.events")],
            error=_opt(d, "error", str, what),
        )


def dump_from_json(value: Json) -> dict[str, PartitionDump]:
    return {key: PartitionDump.from_json(v, f"dump[{key!r}]") for key, v in _obj(value, "dump").items()}


@dataclass(frozen=True)
class QueueRejection:
    """``details`` of a 429 caused by a policy-class queue limit (http-api §1.2)."""

    policy_class: str
    limit_kind: str
    """``requests``, ``raw_isl_tokens`` or ``cached_tokens``."""
    current: int
    limit: int

    @staticmethod
    def from_json(value: Json) -> QueueRejection:
        w = "details"
        d = _obj(value, w)
        return QueueRejection(
            policy_class=_req(d, "policy_class", str, w),
            limit_kind=_req(d, "limit_kind", str, w),
            current=_req(d, "current", int, w),
            limit=_req(d, "limit", int, w),
        )
