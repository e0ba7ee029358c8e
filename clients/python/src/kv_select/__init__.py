"""Python client of kv-select, the LLM-worker selection service.

``Client`` (blocking) and ``AsyncClient`` (asyncio) cover every route of the HTTP contract;
answers are small dataclasses with the contract's field names, failures are one exception
class per status (:class:`BadRequest`, :class:`NotFound`, :class:`Conflict`, :class:`Busy`,
:class:`Unavailable`, ...). Bookings come back as reservation handles that free themselves
when used as (async) context managers.
"""

from ._calls import (
    AffinityTarget,
    ExplicitReservation,
    Inspection,
    PinnedWorker,
    Prompt,
    Retries,
    RouterConfigOverride,
    RoutingConstraints,
    SelectOptions,
    SessionContext,
    WorkerFields,
    WorkerPatch,
)
from ._client import (
    AsyncClient,
    AsyncReservationHandle,
    Client,
    PendingReservation,
    ReservationHandle,
)
from ._errors import (
    ApiError,
    BadRequest,
    Busy,
    Conflict,
    Forbidden,
    KvSelectError,
    NotFound,
    ProtocolError,
    ServerError,
    TransportError,
    Unauthorized,
    Unavailable,
)
from ._models import (
    KvHint,
    KvHintAction,
    Overlap,
    OverlapRow,
    OverlapScores,
    PartitionDump,
    PartitionLoads,
    QueueRejection,
    RankLoad,
    Readiness,
    Reservation,
    Selection,
    SharedCache,
    WorkerLoad,
    WorkerRecord,
)

__version__ = "0.1.0"

__all__ = [
    "AffinityTarget",
    "ApiError",
    "AsyncClient",
    "AsyncReservationHandle",
    "BadRequest",
    "Busy",
    "Client",
    "Conflict",
    "ExplicitReservation",
    "Forbidden",
    "Inspection",
    "KvHint",
    "KvHintAction",
    "KvSelectError",
    "NotFound",
    "Overlap",
    "OverlapRow",
    "OverlapScores",
    "PartitionDump",
    "PartitionLoads",
    "PendingReservation",
    "PinnedWorker",
    "Prompt",
    "ProtocolError",
    "QueueRejection",
    "RankLoad",
    "Readiness",
    "Reservation",
    "ReservationHandle",
    "Retries",
    "RouterConfigOverride",
    "RoutingConstraints",
    "SelectOptions",
    "ServerError",
    "SessionContext",
    "SharedCache",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "WorkerFields",
    "WorkerLoad",
    "WorkerPatch",
    "WorkerRecord",
]
