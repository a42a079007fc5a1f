"""The telemetry process, one per serving process, started by the capture's channel
(:mod:`otel_hicache.capture.channel`) with the serving process's interpreter (isolated, ``-I``)
and environment, at a lower CPU priority, ignoring the terminal's Ctrl-C.

Its input is frames (:mod:`..record`): the hello (the serving process's resource, so both
processes' telemetry joins, plus its static attributes; its providers come from the same
``OTEL_*`` variables), then
batches for the consumer; a frame that is not the capture's is counted and skipped. A ``FLUSH``
is answered once what came before it is exported, and at most every ``CHECKPOINT_S`` a
checkpoint goes back, where a successor goes on from if this process dies (span ids come from
the ops, :class:`.spans.OpIds`, so a replayed op is the same span). At the end of its input it
ends the ack waits, exports within ``OTEL_HICACHE_SHUTDOWN_TIMEOUT_S`` and exits.
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
CHECKPOINT_S = 1.0  # spans exported and a checkpoint sent at most this often (the serving process keeps
CHECKPOINT_BYTES = 4 << 20  # the frames after it, to replay), and after this much input
_PARENT_CHECK_S = 1.0  # an idle read looks this often whether the serving process is still there
_IDLE_S = 0.05  # an idle read's wait, after which a checkpoint may be due
MALFORMED = object()  # a frame that is not the capture's: not JSON, or longer than any of its batches


class _Input:
    """The frames of a pipe, read whole, until its end or the serving process is gone."""

    def __init__(self, fd: int, parent: int, idle: Any) -> None:
        self._fd, self._parent, self._idle = fd, parent, idle
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
    """A batch as the capture writes them: lists starting with their kind (a FLUSH's token an int, a
    STOP's bound a number); any message may still fail alone later."""
    return type(batch) is list and all(
        type(m) is list and m and type(m[0]) is int and rec.OP <= m[0] <= rec.CHECKPOINT
        and (m[0] != rec.FLUSH or (len(m) > 1 and type(m[1]) is int))
        and (m[0] != rec.STOP or (len(m) > 1 and type(m[1]) in (int, float))) for m in batch)


def _answer(answers: Any, line: bytes) -> None:
    """An answer to the serving process; once it stopped reading, none is needed."""
    try:
        answers.write(line)
    except OSError:
        pass


def _resource(hello: dict[str, Any]) -> Any:
    from opentelemetry.sdk.resources import Resource

    return Resource(hello.get("resource") or {}, hello.get("schema_url") or None)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # anything printed goes to the serving process's standard error, not into the answers
    sys.stdout = sys.stderr
    consumer: Any = None
    done = {"frames": 0, "taken": 0, "at": time.monotonic(), "bytes": 0}  # frames applied, in the last checkpoint

    def checkpoint(flushed: bool = False) -> None:
        """While frames come in, at most every CHECKPOINT_S or CHECKPOINT_BYTES: the spans taken in
        exported (``flushed``: just now), then ``exported <frames> <checkpoint>``."""
        due = done["frames"] > done["taken"] and (time.monotonic() - done["at"] >= CHECKPOINT_S
                                                  or source.read_bytes - done["bytes"] >= CHECKPOINT_BYTES)
        if consumer is None or not (flushed or due):
            return
        frames, message = done["frames"], rec.encode([consumer.checkpoint()])[rec.FRAME_HEADER.size:]
        done.update(at=time.monotonic(), bytes=source.read_bytes)
        if flushed or bounded("force_flush", providers.tracer_provider, None, bound):
            done["taken"] = frames
            _answer(answers, b"exported %d %s\n" % (frames, message))

    source = _Input(0, os.getppid(), checkpoint)
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
                      own_process=True, static=hello.get("attributes"))
    bound = env_float(ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S)
    consumer = Consumer(providers.tracer_provider, providers.meter_provider,
                        {**hello, "in_resource": providers.static_in_resource}, ids=ids)
    _answer(answers, b"hello\n")
    for batch in frames:
        done["frames"] += 1
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
                checkpoint(flushed=True)
            _answer(answers, b"".join(b"flushed %d %d\n" % (token, ok) for token in flushes))
        else:
            checkpoint()
    consumer.close()
    # a flush first, within the same bound: the SDK's self-metrics of its exports leave with the last one
    deadline = time.monotonic() + bound
    providers.force_flush(bound)
    providers.shutdown(max(0.5, deadline - time.monotonic()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
