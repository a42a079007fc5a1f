"""The capture's messages to the sinks, batches of JSON values (decoding runs no code): (OP, *OP_FIELDS),
(ACK, seq, ack_ns or None), (HOST, seq, pool id, direction, slots, submit_ns, cause, num_bytes), (POOL, pool
id, name, slots, page_size), (FREE, pool id, slots), (DROPPED, reason, count), (STATE, *STATE_FIELDS), (FLUSH,
token: export and answer, unless 0), (STOP, bound s), (CHECKPOINT, [[counter, attributes, total], ...], [OP
awaiting its ack, ...]); the answers: hello, flushed <token> <0|1>, exported <frames> <[CHECKPOINT]>."""

from __future__ import annotations

import json
import struct
from json.encoder import c_make_encoder, encode_basestring
from typing import Any

import numpy as np

OFFLOAD, ONBOARD = "offload", "onboard"  # L1 (device) to L2 (host), and back
DIRECTIONS = (OFFLOAD, ONBOARD)
TIERS = {OFFLOAD: ("L1", "L2"), ONBOARD: ("L2", "L1")}  # (source, destination)
MERGED_OP, DIRECT = "merged_op", "direct"  # acked (expect_ack=True), or not
ORIGINS = (MERGED_OP, DIRECT)
DEVICE_EVENT, HOST_CLOCK = "device_event", "host_clock"  # the timing source
INT64_MAX = 2**63 - 1  # OTLP encodes no larger count or time

OP, ACK, HOST, POOL, FREE, DROPPED, STATE, FLUSH, STOP, CHECKPOINT = range(10)

FRAME_HEADER = struct.Struct("<II")  # the JSON's length, the slots' length after it
MAX_FRAME_BYTES = 1 << 26  # a longer frame is not the capture's
_SLOTS = {HOST: 4, FREE: 2}  # the field that holds slots


_C_ARGS = (encode_basestring, None, ":", ",", False, False, True)  # json.dumps' compact text
try:  # json.dumps' set-up costs more than most frames' encoding: its C encoder, checked once
    _C_JSON = "".join(c_make_encoder(None, None, *_C_ARGS)([1, "\u00e9", {"k": None}], 0)) == '[1,"\u00e9",{"k":null}]'
except Exception:
    _C_JSON = False


def encode(value: Any) -> bytes:
    """A frame; ``bytes`` values go after the JSON, which holds their ``[offset, length]``."""
    tail, size = [], 0

    def place(data: Any) -> list[int]:
        nonlocal size
        if type(data) is not bytes:
            raise TypeError(f"{type(data).__name__} is not JSON serializable")
        tail.append(data)
        size += len(data)
        return [size - len(data), len(data)]

    if _C_JSON:
        text = "".join(c_make_encoder(None, place, *_C_ARGS)(value, 0)).encode()
    else:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=place).encode()
    return FRAME_HEADER.pack(len(text), size) + text + b"".join(tail)


def decode(frame: bytes) -> Any:
    """A frame's batch, slots in place; ValueError if they are not where it says."""
    length, size = FRAME_HEADER.unpack_from(frame)
    start = FRAME_HEADER.size + length
    batch, tail = json.loads(frame[FRAME_HEADER.size:start]), frame[start:start + size]
    for message in batch:
        where = _SLOTS.get(message[0]) if type(message) is list and message and type(message[0]) is int else None
        if where is not None and where < len(message):
            at = message[where]
            if not (type(at) is list and len(at) == 2 and all(type(n) is int and n >= 0 for n in at)
                    and sum(at) <= len(tail)):
                raise ValueError(f"host slots not in their frame: {at!r}")
            message[where] = tail[at[0]:sum(at)]
    return batch


# cause_parts: a mixed op's ((cause, pools, pool tokens, bytes), ...)
OP_FIELDS = (
    "seq", "direction", "origin", "cause", "cause_parts", "tokens", "blocks", "pool_names", "pool_tokens",
    "num_bytes", "page_size", "io_backend", "attributes", "timing_source", "placement", "start_ns", "end_ns",
    "duration_ns", "queue_wait_ns", "error", "submit_ns", "ack_ns", "expect_ack", "parent", "request_links",
    "request_links_dropped")
# per direction: ops in flight, the oldest one's and the oldest unacked one's submit_ns; then totals
STATE_FIELDS = ("inflight", "oldest_inflight_ns", "oldest_unacked_ns", "queue_size", "poller_cpu_s")


def encodes(text: str) -> bool:
    """Not if a lone surrogate (it would fail the batch's export)."""
    try:
        return text.isascii() or bool(text.encode())
    except UnicodeEncodeError:
        return False


def context_tuple(context: Any) -> tuple | None:
    """(trace_id, span_id, flags, remote, trace state pairs)."""
    if context is None or not context.is_valid:
        return None
    state = context.trace_state
    return (context.trace_id, context.span_id, int(context.trace_flags), bool(context.is_remote),
            tuple(state.items()) if state else ())


def slot_bytes(slots: Any) -> bytes:
    """NumPy or CPU torch arrays, ints or a range as int64 bytes; else TypeError or ValueError."""
    if isinstance(slots, range) or (isinstance(slots, (list, tuple)) and (not slots or isinstance(slots[0], int))):
        if not all(type(slot) is int for slot in slots):  # not bool
            raise TypeError("host slots must be integers")
        return np.fromiter(slots, np.int64, len(slots)).tobytes()
    parts = []
    for part in slots if isinstance(slots, (list, tuple)) else (slots,):
        if not isinstance(part, np.ndarray):  # (torch's numpy() refuses a device tensor before reading it)
            part = part.numpy() if hasattr(part, "numpy") else np.asarray(part)
        if part.dtype.kind not in ("i", "u"):
            raise TypeError(f"host slots must be integers, got {part.dtype}")
        parts.append(part.astype(np.int64, copy=False).tobytes())
    return b"".join(parts)
