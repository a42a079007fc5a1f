"""Transfer records: what ``submit()`` captures on the hot path.

A record is a plain slotted object. The caller's thread only fills the
``submit``-time fields; validation, timing and everything else happens on the
completion worker (:mod:`otel_hicache.pipeline`).
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

from .diagnostics import warn_once

OFFLOAD = "offload"
"""Write-back: device (L1) to host (L2)."""
ONBOARD = "onboard"
"""Load-back: host (L2) to device (L1)."""

DIRECTIONS = (OFFLOAD, ONBOARD)

TIERS = {OFFLOAD: ("L1", "L2"), ONBOARD: ("L2", "L1")}
"""Source and destination tier of each direction."""

MERGED_OP = "merged_op"
"""An op whose consumer takes an ack (``expect_ack=True``)."""
DIRECT = "direct"
"""A copy nobody acknowledges (``expect_ack=False``)."""
ORIGINS = (MERGED_OP, DIRECT)

DEVICE_EVENT = "device_event"
"""Duration from ``start_event.elapsed_time(finish_event)``."""
HOST_CLOCK = "host_clock"
"""Duration from the host clock (no timing events, or they failed)."""


# Layout of what submit() queues: a plain list (cheapest to build on the caller's
# thread), which is also the handle ack() stamps.
(
    S_DIRECTION,
    S_TOKENS_BY_POOL,
    S_NUM_BYTES,
    S_PAGE_SIZE,
    S_START_EVENT,
    S_FINISH_EVENT,
    S_TIMING_ENABLED,
    S_IO_BACKEND,
    S_ATTRIBUTES,
    S_EXPECT_ACK,
    S_SUBMIT_NS,
    S_PARENT_CONTEXT,
    S_HOST_START_NS,
    S_HOST_END_NS,
    S_ACK_WATCH,
    S_ACK_NS,
) = range(16)


def submission(
    direction: Any,
    tokens_by_pool: Any = None,
    num_bytes: Any = 0,
    page_size: Any = 1,
    start_event: Any = None,
    finish_event: Any = None,
    timing_enabled: bool = False,
    io_backend: Any = None,
    attributes: Any = None,
    expect_ack: bool = False,
    submit_ns: int = 0,
    parent_context: Any = None,
    host_start_ns: int | None = None,
    host_end_ns: int | None = None,
    ack_watch: tuple[Any, Any] | None = None,
) -> list[Any]:
    """The list ``submit()`` builds inline (spelled out here for tests and strict checks)."""
    return [direction, tokens_by_pool, num_bytes, page_size, start_event, finish_event, timing_enabled,
            io_backend, attributes, expect_ack, submit_ns, parent_context, host_start_ns, host_end_ns,
            ack_watch, None]


class TransferRecord:
    """One merged op (or one direct copy), from submit to its emitted span.

    Built by the worker from the submitted list (``handle``), which ``ack()``
    stamps with the ack time.
    """

    __slots__ = (
        "handle",
        # captured on the caller's thread
        "direction",
        "tokens_by_pool",
        "num_bytes",
        "page_size",
        "start_event",
        "finish_event",
        "timing_enabled",
        "io_backend",
        "attributes",
        "expect_ack",
        "submit_ns",
        "parent_context",
        "host_start_ns",
        "host_end_ns",
        "ack_watch",
        # filled by the worker
        "origin",
        "tokens",
        "blocks",
        "pool_names",
        "pool_tokens",
        "timing_source",
        "start_ns",
        "end_ns",
        "duration_ns",
        "queue_wait_ns",
        "error",
        "span_context",
        "exemplar_context",
        "completed_at_ns",
        "in_flight",
        "seq",
    )

    def __init__(self, handle: list[Any]) -> None:
        self.handle = handle
        (
            self.direction,
            self.tokens_by_pool,
            self.num_bytes,
            self.page_size,
            self.start_event,
            self.finish_event,
            self.timing_enabled,
            self.io_backend,
            self.attributes,
            self.expect_ack,
            self.submit_ns,
            self.parent_context,
            self.host_start_ns,
            self.host_end_ns,
            self.ack_watch,
            _ack,
        ) = handle

    @property
    def ack_ns(self) -> int | None:
        """Host time ``ack()`` was called, or None."""
        return self.handle[S_ACK_NS]


def reset_worker_fields(record: TransferRecord) -> None:
    """Initialize the worker-side fields that may be read before they are set
    (the others are always set by validate(), timing.resolve() or the sinks)."""
    record.queue_wait_ns = None
    record.error = None
    record.span_context = None
    record.exemplar_context = None
    record.completed_at_ns = None
    record.in_flight = False  # counted in hicache.transfer.inflight


def _integer(value: Any, what: str) -> int:
    """``value`` as an int (ints, NumPy and torch integer scalars), or a TypeError naming ``what``."""
    if type(value) is int:  # the common case, first
        return value
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def _count(value: Any, what: str) -> int:
    """A non-negative integer count, or a ValueError/TypeError naming ``what``."""
    number = _integer(value, what)
    if number < 0:
        raise ValueError(f"{what} must be >= 0, got {number}")
    return number


def validate(record: TransferRecord) -> None:
    """Check and normalize a record's submit-time fields in place.

    Raises ``ValueError``/``TypeError`` with a message naming the problem. On
    success ``tokens`` (the anchor pool's count, as ``HiCacheAck.num_tokens``),
    ``blocks = ceil(tokens / page_size)``, ``pool_names``/``pool_tokens`` and an
    integer ``num_bytes`` are set.
    """
    reset_worker_fields(record)
    if record.direction not in TIERS:
        raise ValueError(f"direction must be 'offload' or 'onboard', got {record.direction!r}")
    page_size = record.page_size = _integer(record.page_size, "page_size")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    record.num_bytes = _count(record.num_bytes, "num_bytes")
    pools = record.tokens_by_pool
    if pools is None:
        pools = {}
    if type(pools) is not dict and not isinstance(pools, Mapping):
        raise TypeError(f"tokens_by_pool must be a mapping of pool name to tokens, got {type(pools).__name__}")
    names = []
    counts = []
    for name, count in pools.items():
        if type(name) is not str:
            if not isinstance(name, str):
                raise TypeError(f"tokens_by_pool keys must be non-empty strings, got {name!r}")
            name = str.__str__(name)  # a str enum member: its plain value
        if not name:
            raise TypeError(f"tokens_by_pool keys must be non-empty strings, got {name!r}")
        names.append(name)
        counts.append(_count(count, f"tokens_by_pool[{name!r}]"))
    record.pool_names = tuple(names)
    record.pool_tokens = tuple(counts)
    record.tokens = counts[0] if counts else 0
    record.blocks = -(-record.tokens // page_size)
    record.origin = MERGED_OP if record.expect_ack else DIRECT
    watch = record.ack_watch
    if watch is not None and not (type(watch) is tuple and len(watch) == 2 and hasattr(watch[0], "__iter__")):
        record.ack_watch = None  # the op is still reported; only its ack time is unknown
        warn_once("ack_watch", "otel-hicache: ack_watch must be a (container, item) tuple, got %r; ignored",
                  type(watch).__name__)
