"""What the capture hands to the sinks: batches of messages made of plain values.

The capture (:mod:`otel_hicache.capture`, in the serving process) writes batches, lists of
the tuples below, to a channel; the sinks (:mod:`otel_hicache.sinks`, in the telemetry
process or on the poller thread) read them in order. JSON values only (ints, floats,
strings, None, booleans, lists or tuples and str-keyed dicts of them): a batch encodes in one
call of the C JSON encoder, nothing in it refers back to the serving process's objects, and
reading one runs no code (unlike a pickle, which a same-user process writing into the pipe
could use to run its own).

Each message is a tuple whose first item is its kind:

* ``OP``: one merged op (or direct copy) seen complete, ``OP_FIELDS`` in order;
* ``ACK``: ``(ACK, seq, ack_ns or None)``, the end of the ack wait of the op ``seq``
  (None: the wait timed out, or the serving process stopped waiting);
* ``HOST``: ``(HOST, seq, pool id, direction, pages, submit_ns, cause, num_bytes)``, the
  host pages an op wrote or read, at intake (submission order, with the frees);
* ``POOL``: ``(POOL, pool id, name, slots, page_size)``, a host pool made;
* ``FREE``: ``(FREE, pool id, pages)``, host pages the application freed;
* ``DROPPED``: ``(DROPPED, reason, count)``, records the capture could not report;
* ``STATE``: ``(STATE, STATE_FIELDS...)``, what the gauges show, sent when it changes;
* ``FLUSH``: ``(FLUSH, token)``, the channel's: export what came before, then say so (token 0,
  the poller's: hand the summed counters to the SDK, no export);
* ``STOP``: ``(STOP, seconds)``, the channel's last: the serving process stops, export what
  came before within ``seconds`` and exit;
* ``CHECKPOINT``: ``(CHECKPOINT, totals, awaiting)``, what a telemetry process that died had
  confirmed, for its successor: every counter's total (``[name, attributes, value]``) and the
  OP messages of the ops still waiting for their ack (their spans only: their metrics are in
  the totals).

Between processes a batch (or the hello, the first frame) is a frame: the length of its
UTF-8 JSON (``FRAME_HEADER``, at most ``MAX_FRAME_BYTES``) and the JSON (:func:`encode`,
:func:`decode`; tuples arrive as lists). The telemetry process answers on its standard
output, a line per answer:
``hello`` (its sinks are built), ``flushed <token> <0|1>``, and ``exported <frames> <JSON>``:
the spans of every op in its first ``frames`` frames after the hello were handed to the
exporters, and the JSON (a batch of one ``CHECKPOINT``) is where a successor starts from.

Host pages are page indices as the base64 text of an int64 array (:func:`page_text`). Trace
and span contexts are ``(trace_id, span_id, trace_flags, is_remote, trace_state)``, the
state as a tuple of ``(key, value)`` pairs.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

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

INT64_MAX = 2**63 - 1
"""The largest count or time any OTLP exporter can encode (int64 values, nanosecond times):
a larger one would make every export of its batch, or of a cumulative counter, fail."""

OP, ACK, HOST, POOL, FREE, DROPPED, STATE, FLUSH, STOP, CHECKPOINT = range(10)

FRAME_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 26
"""A frame header saying more is not one of the capture's (its batches are far smaller): the
reader counts it as malformed rather than wait for, or allocate, that much."""


def encode(value: Any) -> bytes:
    """A batch (or the hello) as one frame."""
    data = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    return FRAME_HEADER.pack(len(data)) + data


def decode(data: bytes) -> Any:
    """A frame's JSON back; ValueError (a subclass of it) when it is not JSON."""
    return json.loads(data)

OP_FIELDS = (
    "seq",  # intake order, per serving process
    "direction",
    "origin",
    "cause",
    "cause_parts",  # a mixed merged op's ((cause, pool names, pool tokens, bytes), ...), else None
    "tokens",
    "blocks",
    "pool_names",
    "pool_tokens",
    "num_bytes",
    "page_size",
    "io_backend",
    "attributes",  # the call's own span attributes (a dict), or None
    "timing_source",
    "placement",  # hicache.placement_source of device-timed ops, else None
    "start_ns",
    "end_ns",
    "duration_ns",
    "queue_wait_ns",
    "error",  # semconv.FAIL_* of an op that failed, else None
    "submit_ns",
    "ack_ns",  # the ack time when the op was acked before it was seen complete, else None
    "expect_ack",  # an ACK message follows when this is true and ack_ns is None
    "parent",  # the span context current at submit, or None
    "request_links",  # the sampled request span contexts it served or wrote
    "request_links_dropped",
)

STATE_FIELDS = (
    "inflight",  # {direction: ops submitted and not yet seen complete}
    "oldest_inflight_ns",  # {direction: submit time of the oldest of them, or None}
    "oldest_unacked_ns",  # {direction: completion time of the oldest op waiting for its ack, or None}
    "queue_size",  # records queued or held by the capture
    "poller_cpu_s",  # CPU seconds of the poller thread so far
)


def encodes(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: one with a lone surrogate would make every export of
    its batch (and, as a label, of its series) fail."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def context_tuple(context: Any) -> tuple[int, int, int, bool, tuple[tuple[str, str], ...]] | None:
    """A ``SpanContext`` as plain values, or None when it is not valid."""
    if context is None or not context.is_valid:
        return None
    state = context.trace_state
    return (context.trace_id, context.span_id, int(context.trace_flags), bool(context.is_remote),
            tuple(state.items()) if state else ())


def page_text(slots: Any, page_size: int) -> str:
    """:func:`page_bytes` as base64 text, as messages carry them."""
    return base64.b64encode(page_bytes(slots, page_size)).decode("ascii")


def page_bytes(slots: Any, page_size: int) -> bytes:
    """The pages of token slots, repeats in a row dropped, as the bytes of an int64 array: a
    page goes once rather than once per slot (most of the cost is encoding its bytes)."""
    import numpy as np

    pages = slot_array(slots) // page_size
    if pages.size > 1:
        pages = pages[np.concatenate(((True,), pages[1:] != pages[:-1]))]
    return pages.tobytes()


def slot_array(slots: Any) -> Any:
    """Token slot indices (a NumPy or CPU torch array, a sequence of ints, a range, or a
    sequence of arrays) as an int64 NumPy array. Raises TypeError or ValueError for
    anything else, a device tensor among them (reading one would synchronize)."""
    import numpy as np

    if isinstance(slots, range) or (isinstance(slots, (list, tuple)) and (not slots or isinstance(slots[0], int))):
        if not all(type(slot) is int for slot in slots):  # pylint: disable=unidiomatic-typecheck  # not bool
            raise TypeError("host slots must be integers")
        return np.fromiter(slots, np.int64, len(slots))
    parts = []
    for part in slots if isinstance(slots, (list, tuple)) else (slots,):
        if not getattr(part, "is_cpu", True):
            raise ValueError("host slots must be in host memory (reading a device tensor would synchronize)")
        if hasattr(part, "numpy") and not hasattr(part, "__array_interface__"):  # a torch tensor
            part = part.numpy()
        kind = getattr(getattr(part, "dtype", None), "kind", None)
        if kind not in ("i", "u"):
            raise TypeError(f"host slots must be integers, got {getattr(part, 'dtype', type(part).__name__)}")
        parts.append(part.reshape(-1).astype(np.int64, copy=False))
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, np.int64)
