"""Frames to the telemetry process down a non-blocking pipe, each kept until a checkpoint covers it."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from typing import Any, Callable

from .. import record as rec
from .. import semconv as sc
from ..diagnostics import logger, warn_once

RESTART_DELAYS_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # by deaths in a row, each within SHORT_LIFE_S
SHORT_LIFE_S = 60.0
MAX_BACKLOG_BYTES = 32 << 20  # frames no checkpoint covers
_KILLED = (-9, -15, -2)  # killed before its hello: not given up on
_READ_NS = 100_000_000  # answers are read this often while frames wait
_WRITE_BYTES = 1 << 20  # the most joined into one write
# -I: no working directory, PYTHONPATH (an auto-instrumentation's) nor user site on the path
_START = "import sys; sys.path[:0] = sys.argv[1:]; from otel_hicache.sinks.process import main; sys.exit(main())"
_AUTO = os.path.join("opentelemetry", "instrumentation", "auto_instrumentation")
_FULL = ("otel-hicache: the telemetry process is not keeping up; dropping transfer records (reason=queue_full)",
         "otel-hicache: the telemetry process is not keeping up; dropping the oldest acks and host frees")


def telemetry_process_command() -> list[str]:
    cwd = ""
    with contextlib.suppress(OSError):
        cwd = os.getcwd()
    path = [os.path.dirname(os.path.dirname(os.path.abspath(rec.__file__)))]
    path += [p for p in map(os.path.abspath, filter(None, sys.path)) if p not in (cwd, path[0]) and _AUTO not in p]
    return [sys.executable, "-I", "-c", _START, *path]


def _close(process: Any, close: Callable = lambda f: f.close()) -> None:
    for f in (process.stdin, process.stdout):
        with contextlib.suppress(OSError, ValueError):
            close(f)


def _encoded(batch: Any) -> bytes:
    try:
        return rec.encode(batch)
    except Exception:  # a message that does not encode costs only itself
        return rec.encode([m if _encodes(m) else (rec.DROPPED, sc.DROP_INTERNAL_ERROR, int(m[0] == rec.OP))
                           for m in batch])


def _encodes(message: Any) -> bool:
    try:
        return bool(rec.encode(message))
    except Exception as exc:
        warn_once(f"encode:{type(exc).__name__}", "otel-hicache: a record does not encode (%r): internal_error", exc)
        return False


class ProcessChannel:
    """Batches to a telemetry process after ``hello``, or to ``fallback()``'s embedded sinks."""

    def __init__(self, hello: dict[str, Any], max_ops: int, fallback: Callable[[], Any]) -> None:
        self._max_ops, self._fallback, self._lock = max_ops, fallback, threading.Lock()
        self._hello = dict(hello, key=os.urandom(16).hex(), start_ns=time.time_ns())
        self._tokens, self._flushes = itertools.count(1), {}  # token -> its answer (None: not yet)
        self._pools: list = []  # in every hello
        self._frames: deque = deque()  # [frame, ops] from the checkpoint on
        self._queued = self._queued_bytes = 0  # frames handed to writes, and their bytes
        self._bytes = self._waiting_ops = self._written_ops = self._short_lives = self._last_read = 0
        self._out, self._out_ops = memoryview(b""), 0  # the write under way
        self._checkpoint = self._embedded = self.process = None
        self._stopped, self._started_at, self._restart_at = False, 0.0, 0.0

    def write(self, batch: list[tuple[Any, ...]], ops: int) -> None:
        with self._lock:
            if self._embedded is not None:
                self._embedded.write(batch, ops)
            elif not self._stopped:  # a write racing stop() is lost
                self._pools.extend(m for m in batch if m[0] == rec.POOL)
                self._queue(_encoded(batch), ops)
                if self._waiting_ops > self._max_ops or self._bytes > MAX_BACKLOG_BYTES:
                    self._trim()

    def send(self) -> None:
        with self._lock:
            self._pump()

    def due(self) -> int | None:
        """When (``monotonic_ns``) send() is due: a restart, a full pipe, answers."""
        if self._embedded is not None or self._stopped or not self._frames:
            return None
        if self.process is None:
            return int(self._restart_at * 1e9)
        return self._last_read + (_READ_NS if self._waiting() else 10 * _READ_NS)

    def flush(self, timeout_s: float) -> bool:
        """Whether all written before is exported in time."""
        deadline, token = time.monotonic() + timeout_s, next(self._tokens)
        with self._lock:
            self._flushes[token] = None
        self.write([(rec.FLUSH, token)], 0)
        while True:
            with self._lock:
                left = deadline - time.monotonic()
                if self._embedded is not None:
                    self._flushes.pop(token, None)
                    return bool(self._embedded.flush(max(0.0, left)))
                self._pump(answers=True)
                if self._flushes[token] is not None or left <= 0 or self._stopped:
                    return bool(self._flushes.pop(token))
            time.sleep(min(left, 0.005))

    def stop(self, timeout_s: float, export_s: float | None = None) -> bool:
        """Write what waits and a STOP (export within ``export_s``), wait ``timeout_s`` for the exit."""
        deadline, lost = time.monotonic() + timeout_s, 0
        with self._lock:
            self._stopped = True
            if self.process is None and self._embedded is None and self._frames:
                self._start()
            if (process := self.process) is not None:
                self._queue(rec.encode([(rec.STOP, timeout_s if export_s is None else export_s)]), 0)
                while self.process is process and self._waiting() and (left := deadline - time.monotonic()) > 0:
                    self._pump(final=True)
                    time.sleep(min(left, 0.005))
                lost = self._waiting_ops + (self._out_ops if self._out else 0)
                _close(process)
                self.process = None
        if self._embedded is not None:
            return bool(self._embedded.stop(max(0.0, deadline - time.monotonic()), export_s))
        if lost:
            logger.warning("otel-hicache: %d transfers waiting for the telemetry process at exit were lost", lost)
        try:
            if process is not None:
                process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            threading.Thread(target=process.wait, name="otel-hicache-reaper", daemon=True).start()
            return False
        return not lost

    def forget_in_child(self) -> None:
        if self.process is not None:  # os.close takes no lock; kept: closed only once
            _close(self.process, lambda f: os.close(f.fileno()))
            self._inherited = self.process
        self.__init__(self._hello, self._max_ops, self._fallback)

    def _start(self) -> bool:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
        try:
            self.process = process = subprocess.Popen(telemetry_process_command(), stdin=subprocess.PIPE,
                                                      stdout=subprocess.PIPE, start_new_session=True, env=env)
        except OSError as exc:
            self._give_up(f"cannot start it ({exc!r})")
            return False
        with contextlib.suppress(OSError):  # 1 MiB, the most without privileges
            fcntl.fcntl(process.stdin.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        for stream in (process.stdin, process.stdout):
            os.set_blocking(stream.fileno(), False)
        self._started_at = time.monotonic()
        # its hello, the last checkpoint (frame 1), then the frames from there
        self._out = memoryview(rec.encode(dict(self._hello, pools=self._pools)) + (self._checkpoint or b""))
        self._numbered, self._out_ops = int(self._checkpoint is not None), 0
        self._answered, self._replies, self._written_ops = False, b"", 0  # (kill tests read those ops)
        return True

    def _died(self) -> None:
        self._read(ended=True)
        process, self.process, now = self.process, None, time.monotonic()
        self._short_lives = self._short_lives + 1 if now - self._started_at < SHORT_LIFE_S else 1
        self._restart_at = now + RESTART_DELAYS_S[min(self._short_lives, len(RESTART_DELAYS_S)) - 1]
        try:
            process.wait(1.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        _close(process)
        self._out, self._queued, self._queued_bytes = memoryview(b""), 0, 0
        self._waiting_ops = sum(entry[1] for entry in self._frames)
        for token in [t for t, ok in self._flushes.items() if ok is None]:
            self._queue(rec.encode([(rec.FLUSH, token)]), 0)
        if self._answered or process.returncode in _KILLED:
            logger.warning("otel-hicache: the telemetry process ended (exit code %s); another replays the %d "
                           "transfers since its last checkpoint", process.returncode, self._waiting_ops)
        else:  # another would not run either
            self._give_up(f"it ended before it was ready (exit code {process.returncode})")

    def _give_up(self, why: str) -> None:
        warn_once("telemetry_process:fallback", "otel-hicache: telemetry process: %s; the sinks run embedded in "
                  "this process from now on", why)
        embedded = self._fallback()
        embedded.write(self._pools + (rec.decode(self._checkpoint) if self._checkpoint else []), 0)
        for frame, ops in self._frames:
            embedded.write(rec.decode(frame), ops)
        self._frames.clear()
        self._embedded = embedded

    def _queue(self, frame: bytes, ops: int) -> None:
        self._frames.append([frame, ops])
        self._bytes += len(frame)
        self._waiting_ops += ops

    def _waiting(self) -> bool:
        return bool(self._out) or self._queued < len(self._frames)

    def _pump(self, answers: bool = False, final: bool = False) -> None:
        """Write until the pipe is full or (but ``final``) half the byte bound awaits a checkpoint."""
        while self._embedded is None:
            if self.process is None and (self._stopped or not self._frames or time.monotonic() < self._restart_at
                                         or not self._start()):
                return
            if not self._out:
                if self._queued == len(self._frames) or self._queued_bytes >= MAX_BACKLOG_BYTES // 2 and not final:
                    break
                out, size, self._out_ops = [], 0, 0  # one join: a growing bytearray fragments the heap
                while self._queued < len(self._frames) and size < _WRITE_BYTES:
                    frame, ops = self._frames[self._queued]
                    out.append(frame)
                    size, self._out_ops, self._queued = size + len(frame), self._out_ops + ops, self._queued + 1
                self._out, self._queued_bytes = memoryview(b"".join(out)), self._queued_bytes + size
                self._waiting_ops -= self._out_ops
            try:
                self._out = self._out[os.write(self.process.stdin.fileno(), self._out):]
            except BlockingIOError:
                break
            except (OSError, ValueError):
                self._died()
                continue
            if not self._out:
                self._written_ops += self._out_ops
        now = time.monotonic_ns()
        if self.process is not None and (answers or now - self._last_read >= _READ_NS):
            self._last_read = now
            self._read()

    def _read(self, ended: bool = False) -> None:
        chunks, eof = [self._replies], False
        while not eof:
            try:
                chunks.append(os.read(self.process.stdout.fileno(), 1 << 20))
            except (OSError, ValueError):  # BlockingIOError: no more now
                break
            eof = not chunks[-1]
        *lines, self._replies = b"".join(chunks).split(b"\n")
        for line in lines:
            kind, _, rest = line.partition(b" ")
            number, _, value = rest.partition(b" ")
            if kind == b"hello":
                self._answered = True
            elif kind == b"exported" and number.isdigit():
                self._checkpoint = rec.FRAME_HEADER.pack(len(value), 0) + value
                while self._numbered < int(number) and self._queued:
                    size = len(self._frames.popleft()[0])
                    self._numbered, self._queued = self._numbered + 1, self._queued - 1
                    self._queued_bytes, self._bytes = self._queued_bytes - size, self._bytes - size
            elif kind == b"flushed" and number.isdigit() and self._flushes.get(int(number), 0) is None:
                self._flushes[int(number)] = value == b"1"  # a second answer is not kept
        if eof and not ended:
            self._died()

    def _trim(self) -> None:
        """Past a bound, the oldest waiting frames lose their ops (counted) and host pages, then acks, frees,
        states and drop counts (the last state and counts kept)."""
        counts: Counter = Counter()
        last, state = None, []  # (entry, what it kept), the last state
        for stage, kinds in enumerate(((rec.OP, rec.HOST), (rec.ACK, rec.FREE, rec.STATE, rec.DROPPED))):
            for entry in itertools.islice(self._frames, self._queued, None):
                if self._waiting_ops <= self._max_ops and self._bytes <= MAX_BACKLOG_BYTES:
                    break
                batch = rec.decode(entry[0]) if entry[1] or stage else []
                if not (removed := [m for m in batch if m[0] in kinds]):
                    continue
                for m in [*removed, (rec.DROPPED, sc.DROP_QUEUE_FULL, entry[1])]:
                    if m[0] == rec.DROPPED:
                        counts[m[1]] += m[2]
                state = [m for m in removed if m[0] == rec.STATE][-1:] or state
                self._waiting_ops -= entry[1]
                last = (entry, [m for m in batch if m[0] not in kinds])
                self._set(*last)
                warn_once(f"channel_full:{stage}", _FULL[stage])
        if last is not None:
            self._set(last[0], last[1] + state + [[rec.DROPPED, reason, n] for reason, n in counts.items() if n])

    def _set(self, entry: list, batch: list) -> None:
        data = rec.encode(batch)
        self._bytes += len(data) - len(entry[0])
        entry[:] = [data, 0]
