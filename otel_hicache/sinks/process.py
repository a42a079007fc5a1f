"""The telemetry process, one per serving process.

Started by the capture's channel (:mod:`otel_hicache.capture.channel`) with the serving
process's interpreter, isolated (``-I``), and environment. Frames are JSON (:mod:`..record`):
one that is not the capture's is counted and skipped. Its first frame (the hello) carries the serving
process's resource, so both processes' telemetry joins; its providers are built from the
same ``OTEL_*`` variables (:mod:`.providers`). Then each frame is a batch for the consumer;
a ``FLUSH`` is answered once what came before it is exported, and at most every
``CHECKPOINT_S`` a checkpoint goes back (:class:`_Checkpoints`): a successor goes on from it
if this process dies. Span ids come from the ops (:class:`.spans.OpIds`) and every counter
says it counts since the serving process's channel opened, so a replayed op is the same span
and the counters never restart. At the end of its input
(the serving process stopped, or ended in any way) it ends the ack waits, exports what it
has (bounded by ``OTEL_HICACHE_SHUTDOWN_TIMEOUT_S``) and exits. It runs at a lower CPU
priority than the serving process, and ignores the terminal's Ctrl-C (the serving process
ends it by closing its input, after its own last records).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import time
from typing import Any

from .. import environment_variables as ev
from .. import record as rec
from .. import semconv as sc
from ..diagnostics import logger, mark_warned, warn_once
from ..settings import env_float
from .bounded_flush import bounded

NICENESS = 10  # below the serving process: export waits, serving does not
CHECKPOINT_S = 1.0
"""How often at most (while frames come in) the spans taken in are exported and a checkpoint sent
back: the serving process keeps the frames after the last one, to replay them to a successor."""
CHECKPOINT_BYTES = 4 << 20  # ... and after this much input, so what the serving process keeps stays small
_PARENT_CHECK_S = 1.0  # an idle read looks this often whether the serving process is still there
_IDLE_S = 0.05  # an idle read hands the summed counters to the SDK this often (consumer.idle)
MALFORMED = object()
"""A frame that is not the capture's: not JSON, or longer than any of its batches."""


class _Input:
    """The frames of a pipe, read whole; ``None`` at its end, or once the serving process is
    gone while something else keeps its end open (checked on every idle second)."""

    def __init__(self, fd: int, parent: int, idle: Any) -> None:
        self._fd = fd
        self._parent = parent
        self._idle = idle
        self._buffer = bytearray()
        self.read_bytes = 0  # in all

    def _fill(self, size: int) -> bool:
        waited = 0.0
        while len(self._buffer) < size:
            readable, _, _ = select.select([self._fd], [], [], _IDLE_S)
            if not readable:
                self._idle()
                waited += _IDLE_S
                if waited >= _PARENT_CHECK_S:
                    waited = 0.0
                    if os.getppid() != self._parent:
                        return False
                continue
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                return False
            self._buffer += chunk
            self.read_bytes += len(chunk)
        return True

    def frames(self) -> Any:
        """Each frame's value, or ``MALFORMED``."""
        header = rec.FRAME_HEADER.size
        while self._fill(header):
            length = rec.FRAME_HEADER.unpack_from(self._buffer)[0]
            if length > rec.MAX_FRAME_BYTES:  # not the capture's: what was read with it goes too
                self._buffer.clear()
                yield MALFORMED
                continue
            if not self._fill(header + length):
                return
            data = bytes(self._buffer[header:header + length])
            del self._buffer[:header + length]
            try:
                yield rec.decode(data)
            except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
                yield MALFORMED


def well_formed(batch: Any) -> bool:
    """A batch as the capture writes them: a list of messages, each a list starting with its kind
    (a FLUSH's token an int, a STOP's bound a number); any message may still fail alone later."""
    if type(batch) is not list:
        return False
    for m in batch:
        if type(m) is not list or not m or type(m[0]) is not int or not rec.OP <= m[0] <= rec.CHECKPOINT:
            return False
        if m[0] == rec.FLUSH and (len(m) < 2 or type(m[1]) is not int):
            return False
        if m[0] == rec.STOP and (len(m) < 2 or type(m[1]) not in (int, float)):
            return False
    return True


def _answer(answers: Any, line: bytes) -> None:
    """An answer to the serving process; once it stopped reading (it stops, or ended), none is
    needed: what came in is still exported."""
    try:
        answers.write(line)
    except OSError:
        pass


def _resource(hello: dict[str, Any]) -> Any:
    from opentelemetry.sdk.resources import Resource

    return Resource(hello.get("resource") or {}, hello.get("schema_url") or None)


class _Checkpoints:
    """Every ``CHECKPOINT_S`` (or ``CHECKPOINT_BYTES`` of input) while frames come in: the spans of
    the ops taken in so far handed to the exporters, then ``exported <frames> <checkpoint>``."""

    def __init__(self, providers: Any, consumer: Any, answers: Any, bound: float) -> None:
        self._providers, self._consumer, self._answers, self._bound = providers, consumer, answers, bound
        self.frames = 0  # applied, after the hello
        self._done = 0  # frames covered by the last checkpoint
        self._at = time.monotonic()
        self._bytes = 0

    def due(self, read_bytes: int) -> bool:
        return self.frames > self._done and (time.monotonic() - self._at >= CHECKPOINT_S
                                             or read_bytes - self._bytes >= CHECKPOINT_BYTES)

    def take(self, read_bytes: int, flushed: bool = False) -> None:
        """``flushed``: everything was just exported (a FLUSH)."""
        self._at, self._bytes = time.monotonic(), read_bytes
        frames, checkpoint = self.frames, self._consumer.checkpoint()
        if flushed or bounded("force_flush", self._providers.tracer_provider, None, self._bound):
            self._done = frames
            _answer(self._answers, b"exported %d %s\n" % (frames, rec.encode([checkpoint])[rec.FRAME_HEADER.size:]))


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # anything printed goes to the serving process's standard error, not into the answers
    sys.stdout = sys.stderr
    parent = os.getppid()
    consumer: Any = None
    checkpoints: Any = None

    def idle() -> None:
        if consumer is not None:
            consumer.idle()
            if checkpoints.due(source.read_bytes):
                checkpoints.take(source.read_bytes)

    source = _Input(0, parent, idle)
    frames = source.frames()
    hello = next(frames, None)
    if not isinstance(hello, dict):
        return 1
    mark_warned(hello.get("warned") or [])
    level = hello.get("log_level")
    if level:  # the serving process logs otel-hicache at DEBUG: so does this one, to the same standard error
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [telemetry process] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)
    from .consumer import Consumer
    from .providers import build
    from .spans import OpIds

    ids = OpIds(bytes.fromhex(hello.get("key") or "") or os.urandom(16))
    providers = build(_resource(hello), id_generator=ids, counters_since_ns=hello.get("start_ns"),
                      own_process=True)
    bound = env_float(ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S)
    consumer = Consumer(providers.tracer_provider, providers.meter_provider, hello, ids=ids)
    checkpoints = _Checkpoints(providers, consumer, answers, bound)
    _answer(answers, b"hello\n")
    for batch in frames:
        checkpoints.frames += 1
        if batch is MALFORMED or not well_formed(batch):  # written by another process: skipped, counted
            consumer.metrics.dropped_records(sc.DROP_MALFORMED_FRAME)
            warn_once("malformed_frame", "otel-hicache: the telemetry process read a frame that is not the "
                      "capture's; skipped, counted in otel_hicache.records.dropped{reason=malformed_frame}")
            continue
        bound = next((m[1] for m in batch if m[0] == rec.STOP), bound)
        flushes = [m[1] for m in batch if m[0] == rec.FLUSH and m[1]]  # (0: the poller's, no export)
        consumer.apply(batch)
        if flushes:
            ok = providers.force_flush(env_float(ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S))
            if ok:
                checkpoints.take(source.read_bytes, flushed=True)
            _answer(answers, b"".join(b"flushed %d %d\n" % (token, ok) for token in flushes))
        elif checkpoints.due(source.read_bytes):
            checkpoints.take(source.read_bytes)
    consumer.close()
    # a flush first, within the same bound: the SDK's self-metrics of its exports (spans and points
    # delivered, or lost) then leave with the last one, as a periodic export would have sent them
    deadline = time.monotonic() + bound
    providers.force_flush(bound)
    providers.shutdown(max(0.5, deadline - time.monotonic()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
