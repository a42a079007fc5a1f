"""The channel from the poller to a telemetry process of its own.

Each batch (:mod:`otel_hicache.record`) is encoded at once as a frame (JSON: reading it runs no
code) and sent every so often (:meth:`ProcessChannel.send`), several frames a write, down a
non-blocking pipe to the telemetry process (:mod:`otel_hicache.sinks.process`): this interpreter,
isolated (``-I``), on this process's path. Every frame written is kept until a checkpoint the
telemetry process answers covers it; a successor starts from that checkpoint with every frame
written after it (its counters go on, a span exported twice keeps its ids). ``MAX_BACKLOG_BYTES``
and ``max_ops`` bound what waits: past them the oldest ops are dropped and counted
(``queue_full``). A dead telemetry process is replaced, after ``RESTART_DELAYS_S`` when the ones
before died young; one that cannot start or ends before it is ready makes the channel fall back to
``fallback()`` (embedded, warned once), from the checkpoint too.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

from .. import record as rec
from .. import semconv as sc
from ..diagnostics import logger, warn_once

RESTART_DELAYS_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # by deaths in a row within SHORT_LIFE_S of the start
SHORT_LIFE_S = 60.0
_KILLED = (-9, -15, -2)  # SIGKILL, SIGTERM, SIGINT before its hello: a death (restarted), not a child that cannot run
_ANSWERS_INTERVAL_NS = 100_000_000
_WRITE_BYTES = 1 << 20  # frames joined into one write, up to about this size
MAX_BACKLOG_BYTES = 32 << 20  # what waits to be written or confirmed
_PIPE_SIZE = 1 << 20  # F_SETPIPE_SZ: the most an unprivileged process may ask for by default
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _nonblocking(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)


def _close(process: Any, close: Callable[[Any], Any]) -> None:
    for stream in (process.stdin, process.stdout) if process is not None else ():
        try:
            if stream is not None:
                close(stream)
        except OSError:
            pass


# -I: neither the working directory nor PYTHONPATH (an auto-instrumentation's sitecustomize) nor the user's
# site directory; the path comes from the serving process, as an argument
_START = ("import json,sys; sys.path[:0] = json.loads(sys.argv[1]); "
          "from otel_hicache.sinks.process import main; sys.exit(main())")
_AUTO_INSTRUMENTATION = os.path.join("opentelemetry", "instrumentation", "auto_instrumentation")


def telemetry_process_command() -> list[str]:
    """This interpreter, isolated, on this process's path (less the working directory and the
    auto-instrumentation's), otel-hicache's own location first."""
    try:
        cwd = os.getcwd()
    except OSError:  # (deleted meanwhile)
        cwd = ""
    own = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [own]
    for entry in sys.path:
        full = os.path.abspath(entry) if entry else cwd
        if full != cwd and not full.rstrip(os.sep).endswith(_AUTO_INSTRUMENTATION) and full not in path:
            path.append(full)
    return [sys.executable, "-I", "-c", _START, json.dumps(path)]


def telemetry_process_environment() -> dict[str, str]:
    """This process's environment less what would load code were the process not isolated."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}


class ProcessChannel:
    """Batches to a telemetry process; ``hello`` (a dict of plain values) is its first frame."""

    def __init__(self, hello: dict[str, Any], max_ops: int, fallback: Callable[[], Any]) -> None:
        self._hello = hello
        self._max_ops = max_ops
        self._fallback = fallback
        self._tokens = itertools.count(1)
        self._pools: list[tuple[Any, ...]] = []  # every POOL message, for each telemetry process started
        self._short_lives = 0  # deaths in a row soon after their start
        self._started_at = self._restart_at = 0.0
        self._fresh()

    def _fresh(self) -> None:
        """A channel with no telemetry process yet (a new one, or a forked child's)."""
        self._lock = threading.Lock()
        # the span ids of an op, and the start time of every counter, the same in each telemetry process
        self._hello = dict(self._hello, key=os.urandom(16).hex(), start_ns=time.time_ns())
        self._deaths = 0
        # where a successor starts from: the last checkpoint (a frame) and the frames written after it
        self._checkpoint: bytes | None = None
        self._unconfirmed: deque[tuple[int, list[Any]]] = deque()  # (frame number, [frame, ops])
        self._unconfirmed_bytes = 0
        self._embedded: Any = None
        self._stopped = False
        self._asked: set[int] = set()  # flush tokens not answered yet (asked again of a successor)
        self._flushed: dict[int, bool] = {}
        self._reset()

    def _reset(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self._backlog: deque[list[Any]] = deque()  # [frame, ops] not written yet
        self._backlog_ops = 0
        self._backlog_bytes = 0
        self._partial: memoryview | None = None  # the rest of the write under way
        self._partial_batches: deque[list[Any]] = deque()  # its frames not wholly written yet
        self._partial_end = 0  # where the first of them ends, in _written_bytes
        self._hello_entry: list[Any] | None = None
        self._checkpoint_entry: list[Any] | None = None
        self._written_bytes = 0  # to this process, in all
        self._written_ops = 0  # (the kill tests count what was written by it)
        self._written_frames = 0  # wholly, after its hello
        self._replies = b""
        self._last_read = 0
        self._answered = False  # it said it read its hello

    # -- the poller's side ---------------------------------------------------------
    def write(self, batch: list[tuple[Any, ...]], ops: int) -> None:
        """Queue ``batch`` (``ops`` of its messages are OPs), encoded now; :meth:`send` writes it."""
        with self._lock:
            if self._embedded is not None:
                self._embedded.write(batch, ops)
                return
            if self._stopped:  # (a write racing stop(): no new telemetry process for it)
                return
            self._pools.extend(m for m in batch if m[0] == rec.POOL)
            frame = self._encoded(batch)
            self._backlog.append([frame, ops])
            self._backlog_ops += ops
            self._backlog_bytes += len(frame)  # (an estimate: never lowered by writes, made exact in _trim)
            if self._backlog_ops > self._max_ops or self._backlog_bytes + self._unconfirmed_bytes > MAX_BACKLOG_BYTES:
                self._trim()

    def send(self) -> None:
        """Write what waits as far as the pipe takes it now (and read the answers, every so often). Never blocks."""
        with self._lock:
            if self._embedded is None:
                self._pump()

    def due(self) -> int | None:
        """When (``time.monotonic_ns()``) send() is needed though nothing new was written: a restart, a
        full pipe, checkpoints not yet read; None when nothing waits."""
        if self._embedded is not None or self._stopped:
            return None
        if self.process is None:
            return int(self._restart_at * 1e9) if self._backlog else None
        if self._partial is not None or self._backlog:
            return self._last_read + _ANSWERS_INTERVAL_NS
        return self._last_read + 10 * _ANSWERS_INTERVAL_NS if self._unconfirmed else None  # (checkpoints: ~1/s)

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
                    self._backlog.append([self._encoded([(rec.FLUSH, token)]), 0])
                self._pump(answers=True)
                if token in self._flushed:
                    return self._flushed.pop(token)
                process = self.process
                waiting_to_write = self._partial is not None or bool(self._backlog)
                left = deadline - time.monotonic()
                restarting = process is None and not self._stopped and left > 0  # its successor is asked
                if not restarting and (left <= 0 or process is None or process.stdout is None):
                    self._asked.discard(token)
                    return False
            if restarting:
                time.sleep(min(left, 0.05))
                continue
            try:
                select.select([process.stdout], [process.stdin] if waiting_to_write else [], [], min(left, 0.05))
            except (OSError, ValueError):  # closed meanwhile
                with self._lock:
                    self._asked.discard(token)
                return False

    def stop(self, timeout_s: float, export_s: float | None = None) -> bool:
        """Write what waits and close the telemetry process's input within ``timeout_s``; it exports
        within ``export_s`` and exits, waited for until ``timeout_s`` is over (then reaped alone)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._embedded is not None:
                return bool(self._embedded.stop(timeout_s, export_s))
            self._stopped = True
            if self.process is None and self._backlog and not self._start() and self._embedded is not None:
                return bool(self._embedded.stop(timeout_s, export_s))  # (what waited went to it)
            process = self.process  # (one started now for what waited, restart delay or not)
            if process is None:
                return True
            self._backlog.append([self._encoded([(rec.STOP, timeout_s if export_s is None else export_s)]), 0])
            while (self._backlog or self._partial is not None) and time.monotonic() < deadline:
                self._pump(final=True)
                if self.process is None:  # it ended meanwhile: no successor after stop(), nothing to wait for
                    break
                if self._partial is not None or self._backlog:
                    try:
                        select.select([], [process.stdin], [], min(0.05, max(0.0, deadline - time.monotonic())))
                    except (OSError, ValueError):
                        break
            left_over = self._backlog_ops + sum(entry[1] for entry in self._partial_batches)
            process = self.process or process
            try:
                process.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
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
        """In a forked child: the parent's telemetry process stays the parent's (our copies of its
        pipes closed, so that it sees its input end with the parent)."""
        _close(self.process, lambda stream: os.close(stream.fileno()))  # (not flushing the parent's buffer)
        self._fresh()  # its own ops and counters

    # -- the telemetry process -------------------------------------------------------
    def _start(self) -> bool:
        try:
            process = subprocess.Popen(telemetry_process_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=telemetry_process_environment(), close_fds=True,
                                       start_new_session=True)
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
        self._started_at = time.monotonic()
        self._hello_entry = [rec.encode(dict(self._hello, pools=list(self._pools))), 0]
        if self._checkpoint is not None:  # before what waited: its predecessor's, to go on from
            self._checkpoint_entry = [self._checkpoint, 0]
            self._backlog.appendleft(self._checkpoint_entry)
        self._backlog.appendleft(self._hello_entry)
        return True

    def _died(self) -> None:
        """The telemetry process ended: reap it; the next starts from its last checkpoint (or fall back)."""
        process = self.process
        assert process is not None
        self._read_replies(ended=True)  # what it answered before it ended is still in the pipe
        self._deaths += 1
        self._short_lives = self._short_lives + 1 if time.monotonic() - self._started_at < SHORT_LIFE_S else 1
        self._restart_at = time.monotonic() + RESTART_DELAYS_S[min(self._short_lives, len(RESTART_DELAYS_S)) - 1]
        try:
            process.wait(1.0)  # reaped: no zombie
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        code = process.returncode
        _close(process, lambda stream: stream.close())
        ready = self._answered
        own = (self._hello_entry, self._checkpoint_entry)
        replay = [entry for _, entry in self._unconfirmed] + [
            e for e in (*self._partial_batches, *self._backlog) if e is not own[0] and e is not own[1]]
        self._unconfirmed, self._unconfirmed_bytes = deque(), 0
        self._reset()
        self._backlog = deque(replay)
        self._backlog_ops = sum(entry[1] for entry in replay)
        if ready or code in _KILLED:  # (one that cannot run gets the one warning of the fallback below)
            warn_once(f"telemetry_process:died:{self._deaths}", "otel-hicache: the telemetry process ended (exit "
                      "code %s); another goes on from its last checkpoint, with the %d transfers written after it",
                      code, self._backlog_ops)
        else:  # it cannot run here (the interpreter, the path): another would not either
            self._give_up(f"it ended before it was ready (exit code {code})")

    def _give_up(self, why: str) -> None:
        """From now on the sinks run embedded, from the last checkpoint, with what waited."""
        warn_once("telemetry_process:fallback", "otel-hicache: telemetry process: %s; the sinks run embedded in "
                  "this process from now on", why)
        embedded = self._fallback()
        first = list(self._pools)
        if self._checkpoint is not None:
            first.extend(rec.decode(self._checkpoint[rec.FRAME_HEADER.size:]))  # (a batch of one)
        embedded.write(first, 0)
        for data, ops in self._backlog:
            batch = rec.decode(data[rec.FRAME_HEADER.size:])
            if type(batch) is list:  # (not a hello)
                embedded.write(batch, ops)
        self._backlog.clear()
        self._backlog_ops = 0
        self._embedded = embedded

    # -- the pipe -----------------------------------------------------------------------
    def _pump(self, answers: bool = False, final: bool = False) -> None:
        """Write frames until the pipe is full, nothing waits or (but ``final``) half the byte bound waits
        for a checkpoint; read the answers (with ``answers``, else at most every ``_ANSWERS_INTERVAL_NS``)."""
        while True:
            if self.process is None:
                if (self._embedded is not None or self._stopped or time.monotonic() < self._restart_at
                        or not self._start()):
                    return
            if self._partial is None:
                if not self._backlog or self._unconfirmed_bytes >= MAX_BACKLOG_BYTES // 2 and not final:
                    break  # (nothing, or so much not yet confirmed that more could not be replayed)
                self._partial_batches = entries = deque()
                size = 0
                while self._backlog and size < _WRITE_BYTES:
                    entry = self._backlog.popleft()
                    self._backlog_ops -= entry[1]
                    entries.append(entry)
                    size += len(entry[0])
                self._partial = memoryview(b"".join(e[0] for e in entries))
                self._partial_end = self._written_bytes + len(entries[0][0])
            try:
                written = os.write(self.process.stdin.fileno(), self._partial)  # type: ignore[union-attr]
            except BlockingIOError:
                break
            except (BrokenPipeError, OSError, ValueError):
                self._died()
                continue
            self._partial = self._partial[written:]
            self._written_bytes += written
            entries = self._partial_batches
            while entries and self._partial_end <= self._written_bytes:  # frames now wholly in the pipe
                entry = entries.popleft()
                self._written_ops += entry[1]
                if entry is not self._hello_entry:
                    self._written_frames += 1
                    if entry is not self._checkpoint_entry:  # kept until a checkpoint covers it
                        self._unconfirmed.append((self._written_frames, entry))
                        self._unconfirmed_bytes += len(entry[0])
                if entries:
                    self._partial_end += len(entries[0][0])
            if not self._partial:
                self._partial = None
        now = time.monotonic_ns()
        if answers or now - self._last_read >= _ANSWERS_INTERVAL_NS:
            self._last_read = now
            self._read_replies()

    @staticmethod
    def _encoded(batch: Any) -> bytes:
        try:
            return rec.encode(batch)
        except Exception:  # one message that does not encode (a caller's attribute): the others go
            kept = []
            for message in batch:
                try:
                    rec.encode(message)
                    kept.append(message)
                except Exception as exc:
                    warn_once(f"encode:{type(exc).__name__}", "otel-hicache: a transfer record could not be "
                              "sent to the telemetry process (%r); counted as internal_error", exc)
                    kept.append((rec.DROPPED, sc.DROP_INTERNAL_ERROR, 1 if message[0] == rec.OP else 0))
            return rec.encode(kept)

    def _read_replies(self, ended: bool = False) -> None:
        process = self.process
        if process is None or process.stdout is None:
            return
        chunks = [self._replies]
        while True:
            try:
                chunk = os.read(process.stdout.fileno(), 1 << 20)
            except (BlockingIOError, OSError, ValueError):
                break
            if not chunk:
                if not ended:  # the end of its answers: it ended after the last write (no broken pipe seen)
                    self._replies = b"".join(chunks)
                    self._answers(self._replies.split(b"\n")[:-1])
                    self._died()
                    return
                break
            chunks.append(chunk)
        lines = b"".join(chunks).split(b"\n")
        self._replies = lines.pop()
        self._answers(lines)

    def _answers(self, lines: list[bytes]) -> None:
        for line in lines:
            parts = line.split(b" ", 2)
            if parts == [b"hello"]:
                self._answered = True
            elif len(parts) == 3 and parts[0] == b"exported" and parts[1].isdigit():
                covered = int(parts[1])  # its first frames: their spans exported, its state in the checkpoint
                self._checkpoint = rec.FRAME_HEADER.pack(len(parts[2])) + parts[2]
                self._checkpoint_entry = None  # (covered now, if it was written)
                while self._unconfirmed and self._unconfirmed[0][0] <= covered:
                    self._unconfirmed_bytes -= len(self._unconfirmed.popleft()[1][0])
            elif len(parts) == 3 and parts[0] == b"flushed" and parts[1].isdigit() and int(parts[1]) in self._asked:
                self._asked.discard(int(parts[1]))  # (asked twice: the second answer is not kept)
                self._flushed[int(parts[1])] = parts[2] == b"1"

    def _trim(self) -> None:
        """Past ``max_ops`` or the bytes, the oldest waiting frames lose their ops and host pages (counted
        ``queue_full``); past the bytes still, the state and drop messages are summed into one, then
        the oldest acks and host frees go (warned once). Pool messages always stay."""
        self._backlog_bytes = sum(len(entry[0]) for entry in self._backlog)
        limit = MAX_BACKLOG_BYTES - self._unconfirmed_bytes  # (what waits to be confirmed counts too)
        excess = self._backlog_ops - self._max_ops
        dropped = 0
        for entry in self._backlog:
            if excess <= 0 and self._backlog_bytes <= limit:
                break
            if entry[1]:
                excess -= entry[1]
                dropped += entry[1]
                self._rewrite(entry, lambda m: m[0] not in (rec.OP, rec.HOST))
        self._backlog_ops -= dropped
        if self._backlog_bytes > limit:
            counts: dict[str, int] = {}
            state: list[Any] = []
            for entry in self._backlog:
                for m in self._rewrite(entry, lambda m: m[0] not in (rec.STATE, rec.DROPPED)):
                    if m[0] == rec.DROPPED:
                        counts[m[1]] = counts.get(m[1], 0) + m[2]
                    else:
                        state = m
            summary = [[rec.DROPPED, r, n] for r, n in counts.items()] + ([state] if state else [])
            if summary:
                self._backlog.append([rec.encode(summary), 0])
                self._backlog_bytes += len(self._backlog[-1][0])
        for entry in self._backlog:
            if self._backlog_bytes <= limit:
                break
            self._rewrite(entry, lambda m: m[0] not in (rec.ACK, rec.FREE))
            warn_once("channel_full_bytes", "otel-hicache: the telemetry process is not keeping up and the "
                      "messages waiting for it passed %d bytes; dropping the oldest acks and host frees",
                      MAX_BACKLOG_BYTES)
        if dropped:
            self._backlog.append([rec.encode([(rec.DROPPED, sc.DROP_QUEUE_FULL, dropped)]), 0])
            warn_once("channel_full", "otel-hicache: the telemetry process is not keeping up; dropping transfer "
                      "records, counted in otel_hicache.records.dropped{reason=queue_full}")

    def _rewrite(self, entry: list[Any], keep: Callable[[Any], bool]) -> list[Any]:
        """A waiting frame with only the messages ``keep`` says; returns those it left out (the hello stays)."""
        batch = rec.decode(entry[0][rec.FRAME_HEADER.size:])
        if type(batch) is not list:
            return []
        kept = [m for m in batch if keep(m)]
        if len(kept) != len(batch):
            data = rec.encode(kept)
            self._backlog_bytes += len(data) - len(entry[0])
            entry[0] = data
            if not any(m[0] == rec.OP for m in kept):
                entry[1] = 0
        return [m for m in batch if not keep(m)]
