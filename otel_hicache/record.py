"""The format from the capture to the sinks: batches (lists) of messages of JSON values only, so
decoding one runs no code. A message is a tuple whose first item is its kind:

* ``OP``: an op seen complete, ``OP_FIELDS`` in order; ``ACK``: ``(ACK, seq, ack_ns or None: none came)``;
* ``HOST``: ``(HOST, seq, pool id, direction, pages, submit_ns, cause, num_bytes)``, an op's host pages;
* ``POOL``: ``(POOL, pool id, name, slots, page_size)``; ``FREE``: ``(FREE, pool id, pages)``, freed;
* ``DROPPED``: ``(DROPPED, reason, count)``; ``STATE``: ``(STATE, *STATE_FIELDS)``, when it changes;
* ``FLUSH``: ``(FLUSH, token)``, export and answer (token 0: neither); ``STOP``: ``(STOP, export bound s)``;
* ``CHECKPOINT``: ``(CHECKPOINT, [[counter, attributes, total], ...], [OP awaiting its ack, ...])``.

A frame is ``FRAME_HEADER`` (the length) and the UTF-8 JSON. The telemetry process answers lines:
``hello``, ``flushed <token> <0|1>``, ``exported <frames> <[CHECKPOINT]>`` (the first ``frames``
frames' spans are exported; a successor starts there). Pages: :func:`page_text`; span contexts:
``(trace_id, span_id, trace_flags, is_remote, ((key, value), ...))``.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

OFFLOAD, ONBOARD = "offload", "onboard"  # L1 (device) to L2 (host), and back
DIRECTIONS = (OFFLOAD, ONBOARD)
TIERS = {OFFLOAD: ("L1", "L2"), ONBOARD: ("L2", "L1")}  # (source, destination)
MERGED_OP, DIRECT = "merged_op", "direct"  # acked (expect_ack=True), or not
ORIGINS = (MERGED_OP, DIRECT)
DEVICE_EVENT, HOST_CLOCK = "device_event", "host_clock"  # timed by elapsed_time(), or the host clock
INT64_MAX = 2**63 - 1  # OTLP encodes no larger count or time

OP, ACK, HOST, POOL, FREE, DROPPED, STATE, FLUSH, STOP, CHECKPOINT = range(10)

FRAME_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 26  # a longer frame is not the capture's


def encode(value: Any) -> bytes:
    data = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    return FRAME_HEADER.pack(len(data)) + data


def decode(data: bytes) -> Any:
    """ValueError when not JSON."""
    return json.loads(data)


# cause_parts: a mixed op's ((cause, pools, pool tokens, bytes), ...); attributes: the call's dict or None;
# error: semconv.FAIL_* or None; ack_ns: acked before seen complete; expect_ack: an ACK follows if no ack_ns.
OP_FIELDS = (
    "seq", "direction", "origin", "cause", "cause_parts", "tokens", "blocks", "pool_names", "pool_tokens",
    "num_bytes", "page_size", "io_backend", "attributes", "timing_source", "placement", "start_ns", "end_ns",
    "duration_ns", "queue_wait_ns", "error", "submit_ns", "ack_ns", "expect_ack", "parent", "request_links",
    "request_links_dropped",
)
# {direction: ops not seen complete}, {direction: the oldest one's submit_ns or None}, {direction: the
# oldest completion awaiting its ack or None}, records the capture holds, the poller's CPU seconds.
STATE_FIELDS = ("inflight", "oldest_inflight_ns", "oldest_unacked_ns", "queue_size", "poller_cpu_s")


def encodes(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a lone surrogate would fail its batch's export)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def context_tuple(context: Any) -> tuple[int, int, int, bool, tuple[tuple[str, str], ...]] | None:
    """A valid ``SpanContext`` as plain values, else None."""
    if context is None or not context.is_valid:
        return None
    state = context.trace_state
    return (context.trace_id, context.span_id, int(context.trace_flags), bool(context.is_remote),
            tuple(state.items()) if state else ())


def page_text(slots: Any, page_size: int) -> str:
    return base64.b64encode(page_bytes(slots, page_size)).decode("ascii")


def page_bytes(slots: Any, page_size: int) -> bytes:
    """The pages of token slots as int64 bytes, repeats in a row dropped."""
    import numpy as np

    pages = slot_array(slots) // page_size
    if pages.size > 1:
        pages = pages[np.concatenate(((True,), pages[1:] != pages[:-1]))]
    return pages.tobytes()


def slot_array(slots: Any) -> Any:
    """Token slots (NumPy or CPU torch arrays, ints, a range) as int64; else TypeError or ValueError."""
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
