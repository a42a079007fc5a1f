"""The channel from the poller to a telemetry process of its own.

The poller hands each cycle's batch (:mod:`otel_hicache.record`) over, pickled at once, and
sends what waits every so often (:meth:`ProcessChannel.send`), several batches a frame, to
the standard input of ``python -m otel_hicache.sinks.process``, started with this
interpreter and environment at the first one. The pipe is non-blocking: what it cannot take
now waits here, bounded by ``max_ops`` op records, beyond which the oldest batches' ops (and
their host pages) are dropped and counted (``queue_full``), the small messages kept.

The telemetry process answers on its standard output (:mod:`otel_hicache.record`), read
here without blocking. If it dies, the next send finds the pipe broken: the ops written to
it that it never read (still in the pipe) are counted as ``telemetry_process_lost`` and
reported by the next one, started then with everything still waiting here. After ``MAX_RESTARTS`` deaths the channel falls back to ``fallback()``
(an embedded one, warned once). When the serving process ends, however it ends, the
telemetry process reads the end of its input, exports what it has and exits.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import pickle
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from collections import deque
from typing import Any, Callable

from .. import record as rec
from .. import semconv as sc
from ..diagnostics import logger, warn_once

MAX_RESTARTS = 3
_ANSWERS_INTERVAL_NS = 100_000_000
_FRAME_BYTES = 1 << 20  # batches joined into one frame, up to about this size
_PIPE_SIZE = 1 << 20  # F_SETPIPE_SZ: the most an unprivileged process may ask for by default
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _nonblocking(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)


def telemetry_process_command() -> list[str]:
    return [sys.executable, "-m", "otel_hicache.sinks.process"]


class ProcessChannel:
    """Batches to a telemetry process; ``hello`` (a dict of plain values) is its first frame."""

    def __init__(self, hello: dict[str, Any], max_ops: int, fallback: Callable[[], Any]) -> None:
        self._hello = hello
        self._max_ops = max_ops
        self._fallback = fallback
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._pools: list[tuple[Any, ...]] = []  # every POOL message, for each telemetry process started
        self._deaths = 0
        self._lost = 0  # ops a dead telemetry process never took in, for the next one to report
        self._embedded: Any = None
        self._stopped = False
        self._asked: set[int] = set()  # flush tokens not answered yet (asked again of a successor)
        self._flushed: dict[int, bool] = {}
        self._reset()

    def _reset(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self._backlog: deque[list[Any]] = deque()  # [pickled batch, ops] not written yet
        self._backlog_ops = 0
        self._partial: memoryview | None = None  # the rest of the frame being written
        self._partial_batches: list[list[Any]] = []  # the backlog entries in it
        self._partial_frame = b""
        self._hello_entry: list[Any] | None = None
        self._written_bytes = 0  # to this process, in all
        self._written_ops = 0
        self._frames: deque[tuple[int, int]] = deque()  # (end in _written_bytes, ops) of frames it may not have read
        self._taken = 0  # ops it said it took in
        self._replies = b""
        self._last_read = 0
        self._answered = False  # it said it read its hello
        self._hello_lost = 0

    # -- the poller's side ---------------------------------------------------------
    def write(self, batch: list[tuple[Any, ...]], ops: int) -> None:
        """Queue ``batch`` (``ops`` of its messages are OP ones), pickled now; :meth:`send` writes it."""
        with self._lock:
            if self._embedded is not None:
                self._embedded.write(batch, ops)
                return
            if self._stopped:  # (a write racing stop(): no new telemetry process for it)
                return
            self._pools.extend(m for m in batch if m[0] == rec.POOL)
            self._backlog.append([self._pickled(batch), ops])
            self._backlog_ops += ops
            self._trim()

    def send(self) -> None:
        """Write what waits, as far as the pipe takes it now (the poller, at most every write
        interval: each write is a system call that wakes the telemetry process). Never blocks."""
        with self._lock:
            if self._embedded is None:
                self._pump()

    def flush(self, timeout_s: float) -> bool:
        """Everything written before this call exported by the telemetry process (bounded)."""
        deadline = time.monotonic() + timeout_s
        token = next(self._tokens)
        with self._lock:
            self._asked.add(token)
            deaths = self._deaths
        self.write([(rec.FLUSH, token)], 0)
        while True:
            with self._lock:
                if self._embedded is not None:
                    self._asked.discard(token)
                    return bool(self._embedded.flush(max(0.0, deadline - time.monotonic())))
                if self._deaths != deaths and token in self._asked:  # it may have died with the question
                    deaths = self._deaths
                    self._backlog.append([self._pickled([(rec.FLUSH, token)]), 0])
                self._pump(answers=True)
                if token in self._flushed:
                    return self._flushed.pop(token)
                process = self.process
                waiting_to_write = self._partial is not None or bool(self._backlog)
                left = deadline - time.monotonic()
                if process is None and not self._stopped and left > 0:
                    continue  # it ended as it answered: its successor is asked
                if left <= 0 or process is None or process.stdout is None:
                    self._asked.discard(token)
                    return False
            try:
                select.select([process.stdout], [process.stdin] if waiting_to_write else [], [], min(left, 0.05))
            except (OSError, ValueError):  # closed meanwhile
                with self._lock:
                    self._asked.discard(token)
                return False

    def stop(self, timeout_s: float, export_s: float | None = None) -> bool:
        """Write what waits and close the telemetry process's input, within ``timeout_s``; it then
        exports within ``export_s`` (default ``timeout_s``) of reading that end, and exits. It is
        waited for until ``timeout_s`` is over, then left to finish alone (reaped meanwhile)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._embedded is not None:
                return bool(self._embedded.stop(timeout_s, export_s))
            self._stopped = True
            process = self.process
            if process is None:
                return True
            self._backlog.append([self._pickled([(rec.STOP, timeout_s if export_s is None else export_s)]), 0])
            while (self._backlog or self._partial is not None) and time.monotonic() < deadline:
                self._pump()
                if self.process is None:  # it ended meanwhile: no successor after stop(), nothing to wait for
                    break
                if (self._partial is not None or self._backlog) and self.process is not None:
                    try:
                        select.select([], [process.stdin], [], min(0.05, max(0.0, deadline - time.monotonic())))
                    except (OSError, ValueError):
                        break
            left_over = self._backlog_ops + self._partial_ops()
            process = self.process or process
            self._close_input()
            self.process = None
        if left_over:
            logger.warning("otel-hicache: %d transfers were still waiting for the telemetry process at shutdown "
                           "and were not reported", left_over)
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # it exports what it has, within its bound, then exits
            threading.Thread(target=process.wait, name="otel-hicache-reaper", daemon=True).start()
            return False
        finally:
            if process.stdout is not None:
                process.stdout.close()
        return not left_over

    def forget_in_child(self) -> None:
        """In a forked child: the parent's telemetry process and pipes stay the parent's (its end
        closed here, so the parent's telemetry process still sees its input end with the parent)."""
        self._lock = threading.Lock()
        process = self.process
        if process is not None:
            for stream in (process.stdin, process.stdout):
                try:
                    if stream is not None:
                        os.close(stream.fileno())
                except OSError:
                    pass
        self._embedded = None
        self._stopped = False
        self._deaths = 0
        self._lost = 0
        self._asked, self._flushed = set(), {}
        self._reset()

    # -- the telemetry process -------------------------------------------------------
    def _start(self) -> bool:
        env = dict(os.environ)
        try:
            process = subprocess.Popen(telemetry_process_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=env, close_fds=True, start_new_session=True)
        except OSError as exc:
            self._give_up(f"cannot start it ({exc!r})")
            return False
        assert process.stdin is not None and process.stdout is not None
        try:
            fcntl.fcntl(process.stdin.fileno(), _F_SETPIPE_SZ, _PIPE_SIZE)
        except OSError:  # a smaller pipe only means more waits here
            pass
        _nonblocking(process.stdin.fileno())
        _nonblocking(process.stdout.fileno())
        self.process = process
        hello = dict(self._hello, lost=self._lost, pools=list(self._pools))
        self._hello_lost, self._lost = self._lost, 0  # its to report, once it said it read the hello
        self._hello_entry = [pickle.dumps(hello, protocol=pickle.HIGHEST_PROTOCOL), 0]
        self._backlog.appendleft(self._hello_entry)  # before what waited
        return True

    def _unread(self) -> int:
        """Ops of the frames still in the pipe: a dead telemetry process never read them. (The pipe
        keeps its bytes while this end is open; FIONREAD counts them, on either end, on Linux.)"""
        process = self.process
        try:
            unread = struct.unpack("i", fcntl.ioctl(process.stdin.fileno(), termios.FIONREAD,  # type: ignore
                                                    b"\0\0\0\0"))[0]
        except (AttributeError, OSError, ValueError):  # cannot tell: the ops it did not say it took in
            return max(0, self._written_ops - self._taken)
        read = self._written_bytes - unread - (len(self._partial_frame) - len(self._partial)
                                               if self._partial is not None else 0)
        return sum(ops for end, ops in self._frames if end > read)

    def _died(self) -> None:
        """The telemetry process ended (a broken pipe): count the ops it never read, reap it, and
        start another at the next write (or fall back)."""
        process = self.process
        self._read_replies(ended=True)  # what it answered before it ended is still in the pipe
        lost = self._unread()
        self._lost += lost + (0 if self._answered else self._hello_lost)  # (a hello it never read: again)
        self._deaths += 1
        if process is not None:
            try:
                process.wait(1.0)  # reaped: no zombie
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            code = process.returncode
            for stream in (process.stdin, process.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
        else:
            code = None
        warn_once(f"telemetry_process:died:{self._deaths}", "otel-hicache: the telemetry process ended (exit code "
                  "%s) with %d transfers written to it that it never read; they are counted in "
                  "otel_hicache.records.dropped{reason=telemetry_process_lost}", code, lost)
        # a frame cut short goes again, whole, but for the dead one's hello
        cut = [e for e in self._partial_batches if e is not self._hello_entry] if self._partial is not None else []
        backlog, ops = self._backlog, self._backlog_ops + sum(entry[1] for entry in cut)
        if backlog and backlog[0] is self._hello_entry:
            backlog.popleft()
        self._reset()
        backlog.extendleft(reversed(cut))
        self._backlog, self._backlog_ops = backlog, ops
        if self._deaths >= MAX_RESTARTS:
            self._give_up(f"it ended {self._deaths} times")

    def _give_up(self, why: str) -> None:
        """From now on the sinks run embedded, with what waited and what was lost."""
        warn_once("telemetry_process:fallback", "otel-hicache: telemetry process: %s; the sinks run embedded in "
                  "this process from now on", why)
        embedded = self._fallback()
        lost = self._lost
        self._lost = 0
        embedded.write(list(self._pools) + ([(rec.DROPPED, sc.DROP_TELEMETRY_PROCESS_LOST, lost)] if lost else []),
                       0)
        for data, ops in self._backlog:
            batch = pickle.loads(data)
            if type(batch) is list:  # (not a hello)
                embedded.write(batch, ops)
        self._backlog.clear()
        self._backlog_ops = 0
        self._embedded = embedded

    # -- the pipe -----------------------------------------------------------------------
    def _pump(self, answers: bool = False) -> None:
        """Write frames until the pipe is full or nothing waits; read the answers (with ``answers``,
        else at most every ``_ANSWERS_INTERVAL_NS``: a read is a system call too)."""
        while True:
            if self.process is None:
                if self._embedded is not None or self._stopped or not self._start():
                    return
            if self._partial is None:
                if not self._backlog:
                    break
                self._partial_batches = entries = []
                size = 0
                while self._backlog and size < _FRAME_BYTES:
                    entry = self._backlog.popleft()
                    self._backlog_ops -= entry[1]
                    entries.append(entry)
                    size += len(entry[0])
                self._partial_frame = b"".join([rec.FRAME_HEADER.pack(size), *(e[0] for e in entries)])
                self._partial = memoryview(self._partial_frame)
            try:
                written = os.write(self.process.stdin.fileno(), self._partial)  # type: ignore[union-attr]
            except BlockingIOError:
                break
            except (BrokenPipeError, OSError, ValueError):
                self._died()
                continue
            self._partial = self._partial[written:]
            self._written_bytes += written
            if not self._partial:
                ops = sum(entry[1] for entry in self._partial_batches)
                self._written_ops += ops
                self._frames.append((self._written_bytes, ops))
                while self._frames and self._frames[0][0] <= self._written_bytes - _PIPE_SIZE:
                    self._frames.popleft()  # read for sure: the pipe holds no more than its size
                self._partial, self._partial_batches = None, []
        now = time.monotonic_ns()
        if answers or now - self._last_read >= _ANSWERS_INTERVAL_NS:
            self._last_read = now
            self._read_replies()

    def _partial_ops(self) -> int:
        return sum(entry[1] for entry in self._partial_batches) if self._partial is not None else 0

    @staticmethod
    def _pickled(batch: Any) -> bytes:
        try:
            return pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # one message that does not pickle (a caller's attribute): the others go
            kept = []
            for message in batch:
                try:
                    pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
                    kept.append(message)
                except Exception as exc:
                    warn_once(f"pickle:{type(exc).__name__}", "otel-hicache: a transfer record could not be "
                              "sent to the telemetry process (%r); counted as internal_error", exc)
                    kept.append((rec.DROPPED, sc.DROP_INTERNAL_ERROR, 1 if message[0] == rec.OP else 0))
            return pickle.dumps(kept, protocol=pickle.HIGHEST_PROTOCOL)

    def _read_replies(self, ended: bool = False) -> None:
        process = self.process
        if process is None or process.stdout is None:
            return
        try:
            chunk = os.read(process.stdout.fileno(), 65536)
        except (BlockingIOError, OSError, ValueError):
            return
        if not chunk:
            if not ended:  # the end of its answers: it ended after the last write (no broken pipe seen)
                self._died()
            return
        lines = (self._replies + chunk).split(b"\n")
        self._replies = lines.pop()
        for line in lines:
            parts = line.split()
            if len(parts) == 2 and parts[0] == b"taken":
                self._taken = int(parts[1])
                self._answered = True
            elif parts == [b"hello"]:
                self._answered = True
            elif len(parts) == 3 and parts[0] == b"flushed" and int(parts[1]) in self._asked:
                self._asked.discard(int(parts[1]))  # (asked twice: the second answer is not kept)
                self._flushed[int(parts[1])] = parts[2] == b"1"

    def _trim(self) -> None:
        """Beyond ``max_ops`` waiting ops, the oldest waiting batches lose their ops and host pages
        (counted); their other messages (acks, frees, counts, state) are small and kept."""
        excess = self._backlog_ops - self._max_ops
        if excess <= 0:
            return
        dropped = 0
        for entry in self._backlog:
            if excess <= 0:
                break
            data, ops = entry
            if not ops:
                continue
            kept = [m for m in pickle.loads(data) if m[0] not in (rec.OP, rec.HOST)]
            entry[0], entry[1] = pickle.dumps(kept, protocol=pickle.HIGHEST_PROTOCOL), 0
            dropped += ops
            excess -= ops
        self._backlog_ops -= dropped
        self._backlog.append([pickle.dumps([(rec.DROPPED, sc.DROP_QUEUE_FULL, dropped)]), 0])
        warn_once("channel_full", "otel-hicache: the telemetry process is not keeping up; dropping transfer "
                  "records, counted in otel_hicache.records.dropped{reason=queue_full}")

    def _close_input(self) -> None:
        process = self.process
        if process is not None and process.stdin is not None:
            try:
                process.stdin.close()
            except OSError:
                pass
