"""What the capture hands to the sinks: batches (lists) of messages made of JSON values only.

Nothing in a batch refers to the serving process's objects and decoding one runs no code (unlike
a pickle). Each message is a tuple whose first item is its kind:

* ``OP``: an op seen complete, ``OP_FIELDS`` in order;
* ``ACK``: ``(ACK, seq, ack_ns or None)``, the end of op ``seq``'s ack wait (None: timed out, or stopped);
* ``HOST``: ``(HOST, seq, pool id, direction, pages, submit_ns, cause, num_bytes)``, an op's host pages;
* ``POOL``: ``(POOL, pool id, name, slots, page_size)``; ``FREE``: ``(FREE, pool id, pages)``, freed pages;
* ``DROPPED``: ``(DROPPED, reason, count)``; ``STATE``: ``(STATE, *STATE_FIELDS)``, sent when it changes;
* ``FLUSH``: ``(FLUSH, token)``, export what came before and say so (token 0, the poller's: no export);
* ``STOP``: ``(STOP, seconds)``, export within ``seconds`` and exit;
* ``CHECKPOINT``: ``(CHECKPOINT, totals, awaiting)``, what a dead telemetry process confirmed, for its
  successor: each counter's ``[name, attributes, value]`` and the OP messages still awaiting their ack.

Between processes a batch is a frame: ``FRAME_HEADER`` (the length) and its UTF-8 JSON. The telemetry
process answers a line each: ``hello``, ``flushed <token> <0|1>``, ``exported <frames> <JSON>`` (the
spans of its first ``frames`` frames were exported; the JSON, a batch of one ``CHECKPOINT``, is where a
successor starts). Host pages are the base64 of an int64 array (:func:`page_text`); span contexts are
``(trace_id, span_id, trace_flags, is_remote, ((key, value), ...))``.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

OFFLOAD, ONBOARD = "offload", "onboard"  # device (L1) to host (L2), and back
DIRECTIONS = (OFFLOAD, ONBOARD)
TIERS = {OFFLOAD: ("L1", "L2"), ONBOARD: ("L2", "L1")}  # source and destination tier
MERGED_OP, DIRECT = "merged_op", "direct"  # an op acked (expect_ack=True), and a copy nobody acks
ORIGINS = (MERGED_OP, DIRECT)
DEVICE_EVENT, HOST_CLOCK = "device_event", "host_clock"  # durations from elapsed_time(), or the host clock
INT64_MAX = 2**63 - 1  # the largest count or ns time OTLP encodes: a larger one fails every export

OP, ACK, HOST, POOL, FREE, DROPPED, STATE, FLUSH, STOP, CHECKPOINT = range(10)

FRAME_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 26  # a header saying more is not the capture's: malformed, never waited for


def encode(value: Any) -> bytes:
    """A batch (or the hello) as one frame."""
    data = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    return FRAME_HEADER.pack(len(data)) + data


def decode(data: bytes) -> Any:
    """A frame's JSON back; a ValueError when it is not JSON."""
    return json.loads(data)


# An OP message's fields. cause_parts: a mixed op's ((cause, pool names, pool tokens, bytes), ...);
# attributes: the call's own (a dict) or None; placement: hicache.placement_source of device-timed ops;
# error: semconv.FAIL_* or None; ack_ns: when acked before seen complete; expect_ack: an ACK follows
# (when ack_ns is None); parent: the span context current at submit; request_links: span contexts.
OP_FIELDS = (
    "seq", "direction", "origin", "cause", "cause_parts", "tokens", "blocks", "pool_names", "pool_tokens",
    "num_bytes", "page_size", "io_backend", "attributes", "timing_source", "placement", "start_ns", "end_ns",
    "duration_ns", "queue_wait_ns", "error", "submit_ns", "ack_ns", "expect_ack", "parent", "request_links",
    "request_links_dropped",
)
# A STATE message's: {direction: ops submitted, not seen complete}, {direction: the oldest one's submit
# time or None}, {direction: the oldest completion awaiting its ack or None}, records queued or held by
# the capture, the poller thread's CPU seconds.
STATE_FIELDS = ("inflight", "oldest_inflight_ns", "oldest_unacked_ns", "queue_size", "poller_cpu_s")


def encodes(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a lone surrogate would fail every export of its batch)."""
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
    """The pages of token slots as the bytes of an int64 array, repeats in a row dropped (once per page)."""
    import numpy as np

    pages = slot_array(slots) // page_size
    if pages.size > 1:
        pages = pages[np.concatenate(((True,), pages[1:] != pages[:-1]))]
    return pages.tobytes()


def slot_array(slots: Any) -> Any:
    """Token slots (a NumPy or CPU torch array, ints, a range, or a sequence of arrays) as an int64
    array; TypeError or ValueError for anything else, a device tensor among them (it would synchronize)."""
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
