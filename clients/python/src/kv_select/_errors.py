"""Exceptions: one class per status family of the contract's error model (http-api §2).

Callers key on the class (the status), never on the message text: the contract says
messages are informative only. Every exception carries the server's ``error`` text, the
status and the route it came from.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._models import QueueRejection


class KvSelectError(Exception):
    """Base of every error this client raises.

    Errors pickle with their fields (status, message, details, ...), so one raised in a Ray
    task or actor reaches the driver intact.
    """

    def __reduce__(self) -> tuple[object, ...]:
        # The default reduction calls cls(*args) with the formatted message only, which
        # the keyword-only constructors below cannot take.
        return (_restore, (type(self), self.args, dict(self.__dict__)))


def _restore(cls: type[KvSelectError], args: tuple[object, ...], state: dict[str, object]) -> KvSelectError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class ProtocolError(KvSelectError):
    """The server answered something the contract does not allow (not JSON, a missing field,
    a wrong type): a version mismatch or not a kv-select server."""


class TransportError(KvSelectError):
    """The request did not complete: the connection failed or timed out.

    ``sent`` is false only when the request certainly never reached the server (connection
    refused, connect timeout), which is what makes a booking safe to retry.
    """

    def __init__(self, message: str, *, method: str, path: str, sent: bool) -> None:
        super().__init__(f"{method} {path}: {message}")
        self.method = method
        self.path = path
        self.sent = sent


class ApiError(KvSelectError):
    """The server answered with an error status; ``message`` is its ``error`` text."""

    def __init__(self, status: int, message: str, *, method: str, path: str) -> None:
        super().__init__(f"{method} {path} -> {status}: {message}")
        self.status = status
        self.message = message
        self.method = method
        self.path = path


class BadRequest(ApiError):
    """400 (validation), 413 (body or prompt too large), 415 (not JSON), 422 (wrong body
    shape). ``field`` is the request field the message names, when it names one."""

    @property
    def field(self) -> str | None:
        return _field_named(self.message)


class Unauthorized(ApiError):
    """401: the server requires a bearer token and got none or an unknown one."""


class Forbidden(ApiError):
    """403: a read-only token on a route that needs a full token."""


class NotFound(ApiError):
    """404: unknown worker or reservation, or no pending selection to replay."""

    @property
    def no_pending_selection(self) -> bool:
        """The replay form found no cached ``/select`` (expired, already used, never selected,
        another replica): the caller books with the explicit form instead (http-api §6.1)."""
        return self.message.startswith("no pending selection")


class Conflict(ApiError):
    """409: the selection id is already reserved or being reserved, or replica sync is off."""


class Busy(ApiError):
    """429: every eligible worker is overloaded, a queue limit was hit, or the deadline
    passed while queued. ``details`` is set when a policy-class queue limit rejected it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        method: str,
        path: str,
        details: QueueRejection | None = None,
    ) -> None:
        super().__init__(status, message, method=method, path=path)
        self.details = details


class Unavailable(ApiError):
    """503: no schedulable worker (anywhere, or in this partition), or shutting down."""


class ServerError(ApiError):
    """500 or any other status the contract does not assign to a class above."""


_STATUS_CLASSES: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: BadRequest,
    415: BadRequest,
    422: BadRequest,
    429: Busy,
    503: Unavailable,
}


def error_class(status: int) -> type[ApiError]:
    return _STATUS_CLASSES.get(status, ServerError)


# A 422 text is the extractor's prefix, then the path of the offending field as serde
# reports it (``pinned_worker: missing field `dp_rank` ``, ``token_ids[0]: invalid type``),
# with no path for a missing top-level field (``missing field `selection_id` ``). The 400 texts
# of the prompt and lifecycle rules start with the field (``isl_tokens must be greater than 0``).
_DESERIALIZE = "Failed to deserialize the JSON body into the target type: "
_PATH = re.compile(r"([A-Za-z_][A-Za-z0-9_.\[\]]*): ")
_MISSING = re.compile(r"missing field `([A-Za-z0-9_]+)`")
_LEADING = re.compile(r"^([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b")


def _field_named(message: str) -> str | None:
    if message.startswith(_DESERIALIZE):
        rest = message[len(_DESERIALIZE) :]
        path = _PATH.match(rest)
        if path:
            rest = rest[path.end() :]
        missing = _MISSING.match(rest)
        if missing and path:
            return f"{path.group(1)}.{missing.group(1)}"
        if missing:
            return missing.group(1)
        return path.group(1) if path else None
    m = _LEADING.match(message)
    return m.group(1) if m else None
