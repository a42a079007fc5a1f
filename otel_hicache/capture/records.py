"""``submit()`` queues a plain list; the poller makes it a record, validated here."""

from __future__ import annotations

import operator
import reprlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

from .. import semconv as sc
from ..adapters import causes
from ..diagnostics import warn_once
from ..record import DIRECT, INT64_MAX, MERGED_OP, TIERS, encodes

# submit()'s list, also the handle whose last field ack() stamps
SUBMISSION_FIELDS = (
    "direction", "tokens_by_pool", "num_bytes", "page_size", "start_event", "finish_event", "io_backend",
    "attributes", "expect_ack", "submit_ns", "parent_context", "host_start_ns", "host_end_ns", "ack_watch",
    "cause", "cause_call", "host_slots", "requests", "ack_ns")
S_SUBMIT_NS = SUBMISSION_FIELDS.index("submit_ns")
S_ACK_NS = SUBMISSION_FIELDS.index("ack_ns")

class TransferRecord:
    __slots__ = ("handle", *SUBMISSION_FIELDS[:S_ACK_NS], "origin", "cause_parts", "request_links",
                 "request_links_dropped", "tokens", "blocks", "pool_names", "pool_tokens", "timing_source",
                 "placement", "start_ns", "end_ns", "duration_ns", "queue_wait_ns", "error", "completed_at_ns", "seq")

    def __init__(self, handle: list[Any]) -> None:
        self.handle = handle
        (self.direction, self.tokens_by_pool, self.num_bytes, self.page_size, self.start_event, self.finish_event,
         self.io_backend, self.attributes, self.expect_ack, self.submit_ns, self.parent_context, self.host_start_ns,
         self.host_end_ns, self.ack_watch, self.cause, self.cause_call, self.host_slots, self.requests, _) = handle
        self.queue_wait_ns = self.placement = self.error = self.completed_at_ns = None
        self.request_links, self.request_links_dropped = (), 0


def _shown(value: Any) -> str:
    if isinstance(value, int) and not -2**64 < value < 2**64:
        return f"an integer of {value.bit_length()} bits"
    return reprlib.repr(value)


def integer(value: Any, what: str, low: int = 0) -> int:
    """An int (NumPy and torch ones too, not bool) from ``low`` to ``INT64_MAX``."""
    if type(value) is not int:
        try:
            value = operator.index(None if isinstance(value, bool) else value)
        except TypeError:
            raise TypeError(f"{what} must be an integer, got {type(value).__name__} {_shown(value)}") from None
    if not low <= value <= INT64_MAX:
        raise ValueError(f"{what} must be >= {low} and < 2**63, got {_shown(value)}")
    return value


_NAMES_SEEN: set[str] = set()  # the few pool names every op repeats, checked once


def _name(name: Any, what: str) -> str:
    if type(name) is str and name in _NAMES_SEEN:
        return name
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what} must be non-empty strings, got {_shown(name)}")
    name = str.__str__(name)  # a str enum member as its value
    if not encodes(name):
        raise ValueError(f"{what} must be valid Unicode (no lone surrogates), got {_shown(name)}")
    if len(_NAMES_SEEN) < 1024 and len(name) <= 256:
        _NAMES_SEEN.add(name)
    return name


def validate(record: TransferRecord) -> None:
    """Normalize a record in place; a ValueError or TypeError names a problem."""
    if record.direction not in TIERS:
        raise ValueError(f"direction must be 'offload' or 'onboard', got {_shown(record.direction)}")
    page_size = record.page_size = integer(record.page_size, "page_size", 1)
    record.num_bytes = integer(record.num_bytes, "num_bytes")
    pools = record.tokens_by_pool if record.tokens_by_pool is not None else {}
    if not isinstance(pools, Mapping):
        raise TypeError(f"tokens_by_pool must be a mapping of pool name to tokens, got {type(pools).__name__}")
    record.pool_names = tuple(_name(name, "tokens_by_pool keys") for name in pools)
    record.pool_tokens = tuple(c if type(c) is int and 0 <= c <= INT64_MAX else  # no f-string built
                               integer(c, f"tokens_by_pool[{_shown(n)}]") for n, c in pools.items())
    record.tokens = tokens = record.pool_tokens[0] if record.pool_tokens else 0
    record.blocks = -(-tokens // page_size)
    if record.host_start_ns is not None:  # first: it may be the submit time
        record.host_start_ns = integer(record.host_start_ns, "host_start_ns")
    record.submit_ns = integer(record.submit_ns, "submit_ns")
    if record.host_end_ns is not None:
        record.host_end_ns = integer(record.host_end_ns, "host_end_ns")
    if record.io_backend is not None:
        record.io_backend = _name(str(record.io_backend), "io_backend")
    record.origin = MERGED_OP if record.expect_ack else DIRECT
    _validate_cause(record)
    slots, watch = record.host_slots, record.ack_watch  # a bad one costs only itself
    if slots is not None and not (type(slots) is tuple and len(slots) == 2 and hasattr(slots[0], "pool_id")):
        record.host_slots = None
        warn_once("host_slots", "otel-hicache: host_slots must be (pool, slots), not %s", type(slots).__name__)
    if watch is not None and not (type(watch) is tuple and len(watch) == 2 and hasattr(watch[0], "__iter__")):
        record.ack_watch = None
        warn_once("ack_watch", "otel-hicache: ack_watch must be (container, item), not %s", type(watch).__name__)


def _known_cause(cause: Any, direction: str) -> str:
    if isinstance(cause, str) and cause in causes()[direction]:
        return str.__str__(cause)
    warn_once(f"cause:{direction}:{cause!r}"[:200], "otel-hicache: %r is not a %s cause (%s); counted as %r",
              cause, direction, ", ".join(causes()[direction]), sc.CAUSE_OTHER)
    return sc.CAUSE_OTHER


def _validate_cause(record: TransferRecord) -> None:
    cause, call, record.cause_parts = record.cause, record.cause_call, None
    if call is not None:
        try:
            cause = call[0](*call[1:])
        except Exception as exc:  # the op is still reported
            warn_once(f"cause:call:{type(exc).__name__}", "otel-hicache: could not work out an op's cause (%r); "
                      "counted as %r", exc, sc.CAUSE_OTHER)
            cause = None
    if cause is None or isinstance(cause, str) or call is None:
        record.cause = sc.CAUSE_OTHER if cause is None else _known_cause(cause, record.direction)
        return
    try:
        parts: dict = {}  # cause -> [tokens by pool, bytes]
        for part_cause, pools, num_bytes in cause:
            entry = parts.setdefault(_known_cause(part_cause, record.direction), [Counter(), 0])
            for name, count in (pools or {}).items():
                entry[0][_name(name, "cause part pool names")] += integer(count, f"cause part tokens[{name!r}]")
            entry[1] += integer(num_bytes, "cause part num_bytes")
        moved = Counter(dict(zip(record.pool_names, record.pool_tokens)))  # == takes a missing pool as 0
        tokens, part_bytes = sum((p for p, _ in parts.values()), Counter()), sum(b for _, b in parts.values())
        if tokens != moved or part_bytes != record.num_bytes:
            raise ValueError(f"parts sum to {dict(tokens)}, {part_bytes} bytes, not {dict(moved)}, {record.num_bytes}")
    except (TypeError, ValueError) as exc:
        warn_once("cause:parts", "otel-hicache: cause parts are malformed (%s); counted as %r", exc, sc.CAUSE_OTHER)
        parts = {sc.CAUSE_OTHER: None}
    record.cause = next(iter(parts)) if len(parts) == 1 else sc.CAUSE_MIXED
    if len(parts) != 1:
        record.cause_parts = tuple((c, tuple(p), tuple(p.values()), b) for c, (p, b) in sorted(parts.items()))
