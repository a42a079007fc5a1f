"""Transfer records: ``submit()`` queues a plain list, the poller makes it a slotted record and validates it here."""

from __future__ import annotations

import operator
import reprlib
from typing import Any, Mapping

from .. import semconv as sc
from ..adapters import causes
from ..diagnostics import warn_once
from ..record import DEVICE_EVENT, DIRECT, HOST_CLOCK, INT64_MAX, MERGED_OP, TIERS, encodes

__all__ = ["DEVICE_EVENT", "DIRECT", "HOST_CLOCK", "INT64_MAX", "MERGED_OP", "SUBMISSION_FIELDS", "TransferRecord",
           "submission", "validate"]

SUBMISSION_FIELDS = (
    # captured on the caller's thread
    "direction", "tokens_by_pool", "num_bytes", "page_size", "start_event", "finish_event", "timing_enabled",
    "io_backend", "attributes", "expect_ack", "submit_ns", "parent_context", "host_start_ns", "host_end_ns",
    "ack_watch", "cause", "host_slots", "requests",
    # stamped later, on the list itself, by ack() or the poller (ack_watch)
    "ack_ns",
)
"""The layout of what ``submit()`` queues: a plain list (cheapest to build), also the handle ``ack()``
stamps; ``submit()``'s list literal is checked against it (tests/test_records.py)."""

S_SUBMIT_NS = SUBMISSION_FIELDS.index("submit_ns")
S_ACK_NS = SUBMISSION_FIELDS.index("ack_ns")
_TIME = "must be a time in ns from 0 to 2**63-1"
_DEFAULTS = {"num_bytes": 0, "page_size": 1, "timing_enabled": False, "expect_ack": False, "submit_ns": 0}


def submission(*values: Any, **fields: Any) -> list[Any]:
    """A list as ``submit()`` builds it, for tests: the ``SUBMISSION_FIELDS`` in order, positionally and/or by name."""
    if len(values) > len(SUBMISSION_FIELDS):
        raise TypeError(f"submission() takes at most {len(SUBMISSION_FIELDS)} values, got {len(values)}")
    handle = [*values, *(fields.pop(name, _DEFAULTS.get(name)) for name in SUBMISSION_FIELDS[len(values):])]
    if fields:
        raise TypeError(f"submission() got unknown or repeated fields: {', '.join(sorted(fields))}")
    return handle


class TransferRecord:
    """One merged op (or one direct copy) on the poller, from its submitted list (``handle``,
    whose ``ack_ns`` is read live: ``ack()`` may stamp it later)."""

    __slots__ = ("handle", *SUBMISSION_FIELDS[:S_ACK_NS],
                 # filled by the poller; cause_parts: a mixed op's ((cause, pool names, pool tokens, bytes), ...)
                 "origin", "cause_parts", "request_links", "request_links_dropped", "tokens", "blocks", "pool_names",
                 "pool_tokens", "timing_source", "placement", "start_ns", "end_ns", "duration_ns", "queue_wait_ns",
                 "error", "completed_at_ns", "seq")

    def __init__(self, handle: list[Any]) -> None:
        self.handle = handle
        (self.direction, self.tokens_by_pool, self.num_bytes, self.page_size, self.start_event, self.finish_event,
         self.timing_enabled, self.io_backend, self.attributes, self.expect_ack, self.submit_ns, self.parent_context,
         self.host_start_ns, self.host_end_ns, self.ack_watch, self.cause, self.host_slots, self.requests, _) = handle
        # the poller's fields read before they may be set (validate() and timing.resolve() set the others)
        self.queue_wait_ns = self.placement = self.error = self.completed_at_ns = None
        self.request_links, self.request_links_dropped = (), 0

    @property
    def ack_ns(self) -> int | None:
        return self.handle[S_ACK_NS]


def _shown(value: Any) -> str:
    """``value`` for an error message, short whatever it is (a 5,000-digit int, a 10 MB string)."""
    if isinstance(value, int) and not -2**64 < value < 2**64:
        return f"an integer of {value.bit_length()} bits"
    return reprlib.repr(value)


def _integer(value: Any, what: str) -> int:
    """``value`` as an int (ints, NumPy and torch integer scalars), or a TypeError naming ``what``."""
    if type(value) is int:  # the common case, first
        return value
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {_shown(value)}") from None


def _count(value: Any, what: str, rule: str = "must be >= 0 and < 2**63") -> int:
    """0 to ``INT64_MAX`` (a float is refused, not rounded), or a ValueError/TypeError naming ``what``."""
    if type(value) is int and 0 <= value <= INT64_MAX:  # the common case, first
        return value
    number = _integer(value, what)
    if not 0 <= number <= INT64_MAX:
        raise ValueError(f"{what} {rule}, got {_shown(number)}")
    return number


_NAMES_SEEN: set[str] = set()  # names checked once (a few pool names, seen on every op), up to 1,024 short ones


def _name(name: Any, what: str) -> str:
    """A non-empty string that encodes as UTF-8, a str enum member as its plain value."""
    if type(name) is str and name in _NAMES_SEEN:
        return name
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what} must be non-empty strings, got {_shown(name)}")
    name = str.__str__(name)
    if not encodes(name):
        raise ValueError(f"{what} must be valid Unicode (no lone surrogates), got {_shown(name)}")
    if len(_NAMES_SEEN) < 1024 and len(name) <= 256:
        _NAMES_SEEN.add(name)
    return name


def validate(record: TransferRecord) -> None:
    """Check and normalize a record's submitted fields in place (a ValueError/TypeError names the
    problem); sets ``tokens`` (the first pool's), ``blocks``, ``pool_names`` and ``pool_tokens``."""
    if record.direction not in TIERS:
        raise ValueError(f"direction must be 'offload' or 'onboard', got {_shown(record.direction)}")
    page_size = record.page_size = _integer(record.page_size, "page_size")
    if not 1 <= page_size <= INT64_MAX:
        raise ValueError(f"page_size must be >= 1 and < 2**63, got {_shown(page_size)}")
    record.num_bytes = _count(record.num_bytes, "num_bytes")
    pools = record.tokens_by_pool
    if pools is None:
        pools = {}
    if type(pools) is not dict and not isinstance(pools, Mapping):
        raise TypeError(f"tokens_by_pool must be a mapping of pool name to tokens, got {type(pools).__name__}")
    names = []
    counts = []
    for name, count in pools.items():
        name = _name(name, "tokens_by_pool keys")
        names.append(name)
        if type(count) is int and 0 <= count <= INT64_MAX:  # the common case, first: no message built
            counts.append(count)
        else:
            counts.append(_count(count, f"tokens_by_pool[{_shown(name)}]"))
    record.pool_names = tuple(names)
    record.pool_tokens = tuple(counts)
    record.tokens = counts[0] if counts else 0
    record.blocks = -(-record.tokens // page_size)
    if record.host_start_ns is not None:  # submit() takes it as the submit time too
        record.host_start_ns = _count(record.host_start_ns, "host_start_ns", _TIME)
    record.submit_ns = _count(record.submit_ns, "submit_ns", _TIME)
    if record.host_end_ns is not None:
        record.host_end_ns = _count(record.host_end_ns, "host_end_ns", _TIME)
    if record.io_backend is not None:
        record.io_backend = _name(str(record.io_backend), "io_backend")
    record.origin = MERGED_OP if record.expect_ack else DIRECT
    _validate_cause(record)
    slots = record.host_slots
    if slots is not None and not (type(slots) is tuple and len(slots) == 2 and hasattr(slots[0], "pool_id")):
        record.host_slots = None  # the op is still reported; its host pages are not tracked
        warn_once("host_slots", "otel-hicache: host_slots must be (TransferTelemetry.host_pool(...), slots), got "
                  "%r; ignored", type(slots).__name__)
    watch = record.ack_watch
    if watch is not None and not (type(watch) is tuple and len(watch) == 2 and hasattr(watch[0], "__iter__")):
        record.ack_watch = None  # the op is still reported; only its ack time is unknown
        warn_once("ack_watch", "otel-hicache: ack_watch must be a (container, item) tuple, got %r; ignored",
                  type(watch).__name__)


def _known_cause(cause: Any, direction: str) -> str:
    """``cause`` if it is one of ``direction``'s, else ``other`` (warned once): a closed set."""
    if cause in causes()[direction]:
        return cause
    warn_once(f"cause:{direction}:{cause!r}"[:200], "otel-hicache: %r is not a %s cause (%s); counted as %r",
              cause, direction, ", ".join(causes()[direction]), sc.CAUSE_OTHER)
    return sc.CAUSE_OTHER


def _validate_cause(record: TransferRecord) -> None:
    """``cause``: None (``other``), one cause, parts ``[(cause, tokens_by_pool, num_bytes), ...]``
    that must sum to the op's totals (several causes: ``mixed``; not summing: ``other``, warned
    once), or a deferred call returning one of these (made here, on the poller)."""
    cause = record.cause
    record.cause_parts = None
    if callable(cause) or (type(cause) is tuple and cause and callable(cause[0])):
        try:
            cause = record.cause = cause() if callable(cause) else cause[0](*cause[1:])
        except Exception as exc:  # pylint: disable=broad-except  # the op is still reported
            warn_once(f"cause:call:{type(exc).__name__}", "otel-hicache: could not work out an op's cause (%r); "
                      "counted as %r", exc, sc.CAUSE_OTHER)
            cause = None
    if cause is None:
        record.cause = sc.CAUSE_OTHER
        return
    if isinstance(cause, str):  # a str enum member too: its plain value
        record.cause = _known_cause(str.__str__(cause), record.direction)
        return
    try:
        parts: dict[str, list[Any]] = {}  # cause -> [pools {name: tokens}, bytes]
        for part_cause, pools, num_bytes in cause:
            part_cause = _known_cause(part_cause, record.direction)
            entry = parts.setdefault(part_cause, [{}, 0])
            for name, count in (pools or {}).items():
                name = _name(name, "cause part pool names")
                entry[0][name] = entry[0].get(name, 0) + _count(count, f"cause part tokens[{name!r}]")
            entry[1] += _count(num_bytes, "cause part num_bytes")
        totals: dict[str, int] = {}
        for pools, _ in parts.values():
            for name, count in pools.items():
                totals[name] = totals.get(name, 0) + count
        expected = {n: c for n, c in zip(record.pool_names, record.pool_tokens) if c}
        if {n: c for n, c in totals.items() if c} != expected or \
                sum(b for _, b in parts.values()) != record.num_bytes:
            raise ValueError(f"parts sum to {totals} tokens and {sum(b for _, b in parts.values())} bytes, "
                             f"the op moved {expected} and {record.num_bytes}")
    except (TypeError, ValueError) as exc:
        warn_once("cause:parts", "otel-hicache: a merged op's cause parts are malformed (%s); such ops are "
                  "counted as %r", exc, sc.CAUSE_OTHER)
        record.cause = sc.CAUSE_OTHER
        return
    if len(parts) == 1:
        record.cause = next(iter(parts))
        return
    record.cause = sc.CAUSE_MIXED
    record.cause_parts = tuple(
        (part_cause, tuple(pools), tuple(pools.values()), num_bytes)
        for part_cause, (pools, num_bytes) in sorted(parts.items()))
