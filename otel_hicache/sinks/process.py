"""The telemetry process: frames in (a hello, then batches), lines out, as :mod:`..record` says."""

import contextlib
import os
import select
import signal
import sys
import time
from typing import Any, Callable, Iterator

from .. import environment_variables as ev
from .. import record as rec
from .. import semconv as sc
from ..diagnostics import mark_warned, warn_once
from .bounded_flush import bounded

CHECKPOINT_S = 5.0  # a checkpoint (an export) at most this often (the SDK's batch delay),
CHECKPOINT_BYTES = 4 << 20  # and after this much input
PARENT_CHECK_S = 1.0  # an idle read's wait before looking for the serving process


def frames(fd: int, idle: Callable[[], float]) -> Iterator[tuple[Any, int]]:
    """(value or None, size) of each frame until the input ends or the serving process is gone."""
    parent, buffer, header, wait = os.getppid(), bytearray(), rec.FRAME_HEADER.size, PARENT_CHECK_S
    while True:
        length = sum(rec.FRAME_HEADER.unpack_from(buffer)) if len(buffer) >= header else -1
        if length > rec.MAX_FRAME_BYTES:  # what was read with it goes too
            yield None, len(buffer)
            buffer.clear()
        elif 0 <= length <= len(buffer) - header:
            length += header
            data = bytes(buffer[:length])
            del buffer[:length]
            try:
                yield rec.decode(data), length
            except (ValueError, RecursionError):
                yield None, length
        elif select.select([fd], [], [], wait)[0]:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return
            buffer += chunk
            wait = 0.0  # idle() says when a checkpoint is owed
        elif os.getppid() != parent:
            return
        else:
            wait = idle()


def well_formed(batch: Any) -> bool:
    return type(batch) is list and all(
        type(m) is list and m and type(m[0]) is int and rec.OP <= m[0] <= rec.CHECKPOINT
        and (m[0] != rec.FLUSH or (len(m) > 1 and type(m[1]) is int))
        and (m[0] != rec.STOP or (len(m) > 1 and type(m[1]) in (int, float))) for m in batch)


class _Sinks:
    def __init__(self, hello: dict, answer: Callable[[bytes], None]) -> None:
        from opentelemetry.sdk.resources import Resource

        from .consumer import Consumer
        from .providers import build
        from .spans import OpIds

        ids = OpIds(bytes.fromhex(hello.get("key") or "") or os.urandom(16))
        self.providers = p = build(Resource(hello.get("resource") or {}, hello.get("schema_url") or None),
                                   id_generator=ids, counters_since_ns=hello.get("start_ns"), own_process=True,
                                   static=hello.get("attributes"))
        self.consumer = Consumer(p.tracer_provider, p.meter_provider, {**hello, "in_resource": p.static_in_resource},
                                 ids=ids)
        self.answer = answer
        self.flush_s = self.bound = ev.env_float(ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S)
        self.frames = self.taken = self.read = self.read_then = 0
        self.at = time.monotonic()

    def take(self, batch: Any, size: int) -> None:
        self.frames, self.read = self.frames + 1, self.read + size
        if not well_formed(batch):  # written by another process
            self.consumer.metrics.dropped_records(sc.DROP_MALFORMED_FRAME)
            warn_once("malformed_frame", "otel-hicache: the telemetry process read a frame that is not the capture's")
            return
        self.read += len(batch) << 11  # and 2 KiB a message: short replays under load
        self.bound = next((m[1] for m in batch if m[0] == rec.STOP), self.bound)
        flushes = [m[1] for m in batch if m[0] == rec.FLUSH and m[1]]
        self.consumer.apply(batch)
        ok = bool(flushes) and self.providers.force_flush(self.flush_s)
        if ok or not flushes:
            self.checkpoint(flushed=ok)
        if flushes:
            self.answer(b"".join(b"flushed %d %d\n" % (token, ok) for token in flushes))

    def checkpoint(self, flushed: bool = False) -> None:
        """If due: export the spans taken in, answer ``exported``."""
        if not flushed and (self.frames == self.taken or time.monotonic() - self.at < CHECKPOINT_S
                            and self.read - self.read_then < CHECKPOINT_BYTES):
            return
        frames, message = self.frames, rec.encode([self.consumer.checkpoint()])[rec.FRAME_HEADER.size:]
        self.at, self.read_then = time.monotonic(), self.read
        if flushed or bounded("force_flush", self.providers.tracer_provider, None, self.bound):
            self.taken = frames
            self.answer(b"exported %d %s\n" % (frames, message))

    def idle(self) -> float:
        self.checkpoint()  # then no wake-up while nothing is owed
        return PARENT_CHECK_S if self.frames == self.taken else max(0.01, self.at + CHECKPOINT_S - time.monotonic())

    def close(self) -> None:
        """A flush first: the SDK's self-metrics leave with it."""
        self.consumer.close()
        deadline = time.monotonic() + self.bound
        self.providers.force_flush(self.bound)
        self.providers.shutdown(max(0.5, deadline - time.monotonic()))


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(10)  # export waits, serving does not
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # prints go to standard error, not into the answers
    sys.stdout = sys.stderr

    def answer(line: bytes) -> None:
        with contextlib.suppress(OSError):  # it stopped reading
            answers.write(line)

    sinks = None
    source = frames(0, lambda: sinks.idle() if sinks else PARENT_CHECK_S)
    hello = next(source, (None, 0))[0]
    if not isinstance(hello, dict):
        return 1
    mark_warned(hello.get("warned") or [])
    sinks = _Sinks(hello, answer)
    answer(b"hello\n")
    for batch, size in source:
        sinks.take(batch, size)
    sinks.close()
    return 0
