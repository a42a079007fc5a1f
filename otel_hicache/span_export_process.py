"""Span export in a helper process: OTLP encoding off the serving process's GIL.

Encoding one transfer span to OTLP protobuf costs 60-130 us of Python on the span
processor's thread, with the GIL held. With spans at 100% that is what makes a sleeping
scheduler thread wake milliseconds late: a waiting thread gets the GIL back only at the
forced switch (``sys.getswitchinterval()``, 5 ms), and smaller batches do not help
(``docs/performance.md``, "GIL wake-up delay").

With ``OTEL_HICACHE_SPAN_EXPORT_PROCESS=true``, :func:`otel_hicache.configure` gives its
tracer provider one :class:`ProcessSpanProcessor` instead of a batch processor per
exporter. It is the SDK's ``BatchSpanProcessor`` (same queue, limits and self-metrics),
with small batches (:data:`BATCH`) handed to a :class:`ProcessSpanExporter`, which turns
each span into plain values (:func:`flatten`, a few microseconds), marshals them and
writes them down a pipe to a helper process of its own (``python -m
otel_hicache.span_export_process``, started on first export, in a forked child too). The
helper builds the exporters ``OTEL_TRACES_EXPORTER`` names from the same variables, as
``configure()`` does, rebuilds each span as a ``ReadableSpan`` (:func:`rebuild`, public
constructors only) and exports it through a ``BatchSpanProcessor`` of its own: the OTLP
bytes are the ones the span would have had in-process (``tests/test_span_export_process.py``
compares them).

``force_flush`` and ``shutdown`` reach the helper (its answer, or its exit, within the
time given). The helper lowers its own scheduling priority (:data:`NICE`). With
``OTEL_HICACHE_GIL_SLICE_US`` set, the exporter takes its turn and pauses as
:mod:`otel_hicache.gil_slice` says while it flattens and marshals a batch. A helper that dies is started again at the next export; a batch that can
no longer be written to it is counted as lost (``lost``) and warned about once, with how
many spans written since it last answered a flush may have gone with it. After :data:`MAX_STARTS` helpers died,
or when none can be started, the spans are exported in-process, as without the
variable, warned once.

The wire is this module's own: a 4-byte length, then ``marshal`` data (the helper runs
the same interpreter). Frames from the parent: ``("r", index, attributes, schema_url)`` a
resource, ``("i", index, name, version, schema_url, attributes)`` a scope, ``("s",
[span, ...])`` up to :data:`FRAME_SPANS` spans, ``("f", token, timeout_ms)`` a flush, ``("x", timeout_ms)`` the end.
From the helper: ``("f", token, ok)``.
"""

from __future__ import annotations

import marshal
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO, Callable, Sequence

from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from . import fork
from .diagnostics import logger, warn_once
from .environment_variables import OTEL_HICACHE_GIL_SLICE_US, OTEL_HICACHE_SHUTDOWN_TIMEOUT_S
from .gil_slice import GilSlice
from .settings import env_float

BATCH = 32
"""Spans per write to the helper: ~0.27 ms of GIL (8.4 us a span for :func:`flatten` and
``marshal``, measured), held from the batch's first span to the write; 8 measured no better."""
SCHEDULE_DELAY_MS = 200
"""The longest a span waits in the serving process before it is written to the helper
(``OTEL_BSP_SCHEDULE_DELAY``, if shorter); the helper's own processor then waits as
``OTEL_BSP_SCHEDULE_DELAY`` says."""
FRAME_SPANS = 8
"""Spans per ``"s"`` frame (a batch is several): one ``marshal`` call is a unit of GIL time
that ``OTEL_HICACHE_GIL_SLICE_US`` cannot cut, ~50 us for 8 spans here."""
NICE = 10
"""The helper lowers its own scheduling priority by this much (``os.nice``): it is background
work, and on a machine with few cores it competes with the serving process's threads."""
MAX_STARTS = 3
"""Helpers started in one process before its spans are exported in-process instead."""
PIPE_BYTES = 1 << 20
"""The pipe's capacity where Linux lets it be raised (``F_SETPIPE_SZ``): ~2,700 transfer spans
(~380 bytes each on the wire) before a write waits for the helper."""

_HEADER = struct.Struct("<I")
_INHERITED: list[Any] = []  # a forked child's copies of the parent's helper (see _after_fork_in_child)


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds of a child process from ``/proc/PID/stat`` (utime + stime), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# -- spans as plain values --------------------------------------------------------------------------

def _context(context: Any) -> tuple[Any, ...] | None:
    if context is None:
        return None
    state = context.trace_state
    return (context.trace_id, context.span_id, int(context.trace_flags), context.is_remote,
            tuple(state.items()) if state else ())


def _attributes(attributes: Any) -> tuple[dict[str, Any] | None, int]:
    """(a plain dict or None, the count the SDK's bounded container dropped)."""
    if not attributes:
        return None, getattr(attributes, "dropped", 0) or 0
    return dict(attributes), getattr(attributes, "dropped", 0) or 0


def flatten(span: Any, resource_index: int, scope_index: int) -> tuple[Any, ...]:
    """A ``ReadableSpan`` as a tuple of values ``marshal`` writes (public properties only)."""
    status = span.status
    return (span.name, _context(span.context), _context(span.parent), span.kind.value, span.start_time,
            span.end_time, status.status_code.value, status.description, dict(span.attributes),
            span.dropped_attributes,
            [(e.name, e.timestamp, *_attributes(e.attributes)) for e in span.events], span.dropped_events,
            [(_context(link.context), *_attributes(link.attributes)) for link in span.links], span.dropped_links,
            resource_index, scope_index)


class _Rebuilder:
    """The helper's side: ``ReadableSpan``s again, of the resources and scopes sent before them."""

    def __init__(self) -> None:
        from opentelemetry.attributes import BoundedAttributes
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util import BoundedList
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

        self._bounded_attributes, self._bounded_list = BoundedAttributes, BoundedList
        self._resource, self._scope = Resource, InstrumentationScope
        self._event, self._readable, self._link = Event, ReadableSpan, Link
        self._span_context, self._trace_flags, self._trace_state = SpanContext, TraceFlags, TraceState
        self._kinds = {kind.value: kind for kind in SpanKind}
        self._codes = {code.value: code for code in StatusCode}
        self._status = Status
        self.resources: dict[int, Any] = {}
        self.scopes: dict[int, Any] = {}

    def resource(self, index: int, attributes: dict[str, Any], schema_url: str | None) -> None:
        self.resources[index] = self._resource(attributes, schema_url)

    def scope(self, index: int, name: str, version: str | None, schema_url: str | None,
              attributes: dict[str, Any] | None) -> None:
        self.scopes[index] = self._scope(name, version, schema_url, attributes)

    def _context(self, values: tuple[Any, ...] | None) -> Any:
        if values is None:
            return None
        trace_id, span_id, flags, is_remote, state = values
        return self._span_context(trace_id, span_id, is_remote, self._trace_flags(flags),
                                  self._trace_state(list(state)) if state else None)

    def _attributes(self, attributes: dict[str, Any] | None, dropped: int) -> Any:
        if not dropped:
            return attributes
        bounded = self._bounded_attributes(None, attributes, immutable=False)
        bounded.dropped = dropped  # what the span's own container had dropped
        return bounded

    def _list(self, items: list[Any], dropped: int) -> Any:
        if not dropped:
            return items
        bounded = self._bounded_list.from_seq(None, items)
        bounded.dropped = dropped
        return bounded

    def span(self, values: tuple[Any, ...]) -> Any:
        (name, context, parent, kind, start, end, code, description, attributes, dropped_attributes,
         events, dropped_events, links, dropped_links, resource, scope) = values
        return self._readable(
            name=name, context=self._context(context), parent=self._context(parent),
            resource=self.resources[resource], attributes=self._attributes(attributes, dropped_attributes),
            events=self._list([self._event(n, self._attributes(a, d), t) for n, t, a, d in events], dropped_events),
            links=self._list([self._link(self._context(c), self._attributes(a, d)) for c, a, d in links],
                             dropped_links),
            kind=self._kinds[kind], status=self._status(self._codes[code], description),
            start_time=start, end_time=end, instrumentation_scope=self.scopes[scope])

    def take(self, frame: tuple[Any, ...]) -> list[Any] | None:
        """The spans of an ``"s"`` frame; a resource or a scope is kept ([]); None: not such a frame."""
        kind = frame[0]
        if kind == "s":
            return [self.span(values) for values in frame[1]]
        if kind == "r":
            self.resource(*frame[1:])
        elif kind == "i":
            self.scope(*frame[1:])
        else:
            return None
        return []


def rebuild(frames: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The spans in ``frames`` (as :class:`ProcessSpanExporter` writes them), rebuilt (tests)."""
    rebuilder, spans = _Rebuilder(), []
    for frame in frames:
        spans.extend(rebuilder.take(frame) or ())
    return spans


# -- the serving process's side ---------------------------------------------------------------------

def helper_command() -> list[str]:
    """How the helper is started: this interpreter, this module."""
    return [sys.executable, "-m", __name__]


def _encode(frame: tuple[Any, ...]) -> bytes:
    payload = marshal.dumps(frame)
    return _HEADER.pack(len(payload)) + payload


def _write(stream: BinaryIO, frame: tuple[Any, ...]) -> None:
    stream.write(_encode(frame))


def _read(stream: BinaryIO) -> tuple[Any, ...] | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    size = _HEADER.unpack(header)[0]
    payload = stream.read(size)
    return marshal.loads(payload) if len(payload) == size else None


class ProcessSpanExporter(SpanExporter):
    """A ``SpanExporter`` that writes spans to its helper process (see the module docstring).

    :param in_process: builds the exporters to use here when no helper can be had.
    """

    def __init__(self, in_process: Callable[[], Sequence[Any]], command: Sequence[str] | None = None) -> None:
        self._in_process = in_process
        self._command = list(command or helper_command())
        self._environment = dict(os.environ)  # the OTEL_* variables as configure() read them
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = os.getpid()
        self._starts = 0
        self._fallback: list[Any] | None = None
        self._resources: dict[int, tuple[Any, int]] = {}  # id -> (object, index): kept alive, ids stay unique
        self._scopes: dict[int, tuple[Any, int]] = {}
        self._tokens = 0
        self._unconfirmed = 0  # spans written since the helper last answered a flush
        self._closed = False
        self.lost = 0
        """Spans that could not be written to a helper (it had ended)."""
        self._retired_cpu_s = 0.0  # CPU of helpers that ended: the counter never goes down
        self._last_cpu: tuple[int, float] | None = None
        self._slice = GilSlice(env_float(OTEL_HICACHE_GIL_SLICE_US))  # exports are one at a time (_lock)
        fork.after_fork_in_child(self._after_fork_in_child)

    @property
    def pid(self) -> int | None:
        """The helper's process id (None before the first export, or after it ended)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def helper_cpu_s(self) -> float | None:
        """CPU seconds of this exporter's helpers, those that ended included; None before the first."""
        pid = self.pid
        seconds = process_cpu_s(pid)
        last = self._last_cpu
        if last is not None and last[0] != pid:
            self._retired_cpu_s += last[1]
            self._last_cpu = last = None
        if seconds is not None:
            self._last_cpu = (pid, seconds)  # type: ignore[assignment]
        elif last is None and not self._retired_cpu_s:
            return None
        return self._retired_cpu_s + (seconds if seconds is not None else last[1] if last else 0.0)

    # the helper's life

    def _start(self) -> subprocess.Popen[bytes] | None:
        if self._starts >= MAX_STARTS:
            self._fall_back(f"its helper process ended {self._starts} times")
            return None
        self._starts += 1
        try:
            proc = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    close_fds=True, env=self._environment)
        except OSError as exc:
            self._fall_back(f"its helper process cannot be started ({exc!r})")
            return None
        try:
            import fcntl

            fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)  # type: ignore[union-attr]
        except (ImportError, AttributeError, OSError):  # not Linux, or over fs.pipe-max-size: 64 KiB then
            pass
        self._proc = proc
        self._resources.clear()  # a new helper knows none of them
        self._scopes.clear()
        return proc

    def _fall_back(self, why: str) -> None:
        warn_once("span_export_process:fallback", "otel-hicache: OTEL_HICACHE_SPAN_EXPORT_PROCESS: %s; exporting "
                  "spans in this process instead", why)
        try:
            self._fallback = list(self._in_process())
        except Exception as exc:  # pylint: disable=broad-except  # never into the host
            warn_once("span_export_process:in_process", "otel-hicache: cannot build the span exporters: %r", exc)
            self._fallback = []

    def _died(self, proc: subprocess.Popen[bytes], spans: int) -> None:
        self.lost += spans
        code = proc.poll()
        warn_once("span_export_process:died", "otel-hicache: the span export helper process (pid %d) ended "
                  "(exit status %s); %d spans could not be written to it and were lost, and up to %d written since "
                  "its last flush may have been lost with it; starting another at the next export",
                  proc.pid, code, spans, self._unconfirmed)
        self._unconfirmed = 0
        self._close(proc)
        self._proc = None

    @staticmethod
    def _close(proc: subprocess.Popen[bytes]) -> None:
        """Its pipes closed, it killed if it still runs, and reaped."""
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass

    def _after_fork_in_child(self) -> None:
        """A forked child shares the parent's helper pipe: close this copy (the parent's helper must
        still see its end when the parent closes it) and start its own helper if it exports."""
        self._lock = threading.RLock()
        proc, self._proc = self._proc, None
        if proc is not None:
            # Closed by descriptor, never through the file objects (a flush could write the parent's
            # half-written frame into its helper's pipe), and the objects are kept so that their
            # collection never closes a descriptor number the child has reused since.
            _INHERITED.append(proc)
            for stream in (proc.stdin, proc.stdout):
                try:
                    if stream is not None:
                        os.close(stream.fileno())
                except (OSError, ValueError):
                    pass
        self._pid = os.getpid()
        self._starts = 0
        self._retired_cpu_s, self._last_cpu = 0.0, None  # the parent's helpers are not this process's
        self._environment = dict(os.environ)  # the child's own configure() reads them now
        self._resources.clear()
        self._scopes.clear()

    # the SpanExporter interface

    def export(self, spans: Sequence[Any]) -> Any:
        with self._lock:
            if self._pid != os.getpid():
                self._after_fork_in_child()
            if self._closed:
                return SpanExportResult.FAILURE
            if self._fallback is None and self._proc is None:
                self._start()
            if self._fallback is not None:
                return self._export_in_process(spans)
            proc = self._proc
            assert proc is not None and proc.stdin is not None
            self._slice.begin()
            try:
                frames = self._frames(spans)
            except Exception as exc:  # pylint: disable=broad-except  # a span we cannot flatten
                warn_once(f"span_export_process:flatten:{type(exc).__name__}", "otel-hicache: a span could not be "
                          "written to the span export helper (%r); %d spans not exported", exc, len(spans))
                self.lost += len(spans)
                return SpanExportResult.FAILURE
            finally:
                self._slice.end()  # the write below waits with the GIL released
            try:
                proc.stdin.write(frames)
                proc.stdin.flush()
            except (OSError, ValueError):  # BrokenPipeError: the helper is gone
                self._died(proc, len(spans))
                return SpanExportResult.FAILURE
            self._unconfirmed += len(spans)
            return SpanExportResult.SUCCESS

    def _frames(self, spans: Sequence[Any]) -> bytes:
        out: list[tuple[Any, ...]] = []
        resources, scopes = self._resources, self._scopes
        flat = []
        check = self._slice.check  # a pause once this export has held the GIL for its slice (or nothing)
        for span in spans:
            check()
            resource, scope = span.resource, span.instrumentation_scope
            known = resources.get(id(resource))
            if known is None or known[0] is not resource:
                known = resources[id(resource)] = (resource, len(resources))
                out.append(("r", known[1], dict(resource.attributes), resource.schema_url))
            r_index = known[1]
            known = scopes.get(id(scope))
            if known is None or known[0] is not scope:
                known = scopes[id(scope)] = (scope, len(scopes))
                out.append(("i", known[1], scope.name, scope.version, scope.schema_url,
                            dict(scope.attributes) if scope.attributes else None))
            flat.append(flatten(span, r_index, known[1]))
        encoded = [_encode(frame) for frame in out]
        for first in range(0, len(flat), FRAME_SPANS):
            check()
            encoded.append(_encode(("s", flat[first:first + FRAME_SPANS])))
        return b"".join(encoded)

    def _export_in_process(self, spans: Sequence[Any]) -> Any:
        result = SpanExportResult.SUCCESS
        for exporter in self._fallback or ():
            try:
                if exporter.export(spans) is not SpanExportResult.SUCCESS:
                    result = SpanExportResult.FAILURE
            except Exception:  # pylint: disable=broad-except
                result = SpanExportResult.FAILURE
        return result

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        """True when the helper exported everything it had (its processors' ``force_flush``), within the time."""
        with self._lock:
            if self._fallback is not None:
                return all(e.force_flush(timeout_millis) is not False for e in self._fallback
                           if callable(getattr(e, "force_flush", None)))
            proc = self._proc
            if proc is None or self._closed or self._pid != os.getpid():
                return True  # nothing handed over
            self._tokens += 1
            token = self._tokens
            deadline = time.monotonic() + timeout_millis / 1e3
            try:
                _write(proc.stdin, ("f", token, float(timeout_millis)))  # type: ignore[arg-type]
                proc.stdin.flush()  # type: ignore[union-attr]
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                        return False
                    answer = _read(proc.stdout)  # type: ignore[arg-type]
                    if answer is None:
                        raise BrokenPipeError("the helper ended")
                    if answer[0] == "f" and answer[1] == token:
                        self._unconfirmed = 0  # the helper took (and exported, if ok) all of them
                        return bool(answer[2])
            except (OSError, ValueError):
                self._died(proc, 0)
                return False

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        """Let the helper export what it holds and end, within the time and at most
        ``OTEL_HICACHE_SHUTDOWN_TIMEOUT_S`` (the SDK's processor passes what is left of 30 s;
        a helper must not outlive its process by that long with the collector unreachable),
        then it is killed."""
        timeout_millis = min(timeout_millis, env_float(OTEL_HICACHE_SHUTDOWN_TIMEOUT_S) * 1e3)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for exporter in self._fallback or ():
                try:
                    exporter.shutdown()
                except Exception:  # pylint: disable=broad-except
                    pass
            proc, self._proc = self._proc, None
            if proc is None or self._pid != os.getpid():
                return
            try:
                _write(proc.stdin, ("x", float(timeout_millis)))  # type: ignore[arg-type]
                proc.stdin.close()  # type: ignore[union-attr]
            except (OSError, ValueError):
                pass
            try:
                proc.wait(timeout_millis / 1e3 + 1.0)  # its own bound, and its exit
            except subprocess.TimeoutExpired:
                logger.warning("otel-hicache: the span export helper process (pid %d) did not end in time; "
                               "killing it (spans it still held are lost)", proc.pid)
            self._close(proc)


class ProcessSpanProcessor(BatchSpanProcessor):
    """The SDK's ``BatchSpanProcessor`` over a :class:`ProcessSpanExporter`, whose ``force_flush``
    also flushes the helper (the SDK's does not call its exporter's)."""

    def __init__(self, span_exporter: ProcessSpanExporter, **kwargs: Any) -> None:
        super().__init__(span_exporter, **kwargs)
        self.helper = span_exporter

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        started = time.monotonic()
        flushed = super().force_flush(timeout_millis)
        left = max(0.0, timeout_millis - (time.monotonic() - started) * 1e3)
        return self.helper.force_flush(left) and flushed is not False


# -- the helper process -----------------------------------------------------------------------------

def serve(source: BinaryIO, answers: BinaryIO) -> int:
    """The helper's loop: spans from ``source`` to the exporters ``OTEL_TRACES_EXPORTER`` names,
    until ``("x", timeout)`` or the end of ``source``. Returns its exit status."""
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from . import configuration

    meter_provider = configuration.self_metrics_meter_provider()
    provider = TracerProvider(shutdown_on_exit=False)  # flush and shutdown for the processors below
    # The exporters' otel.sdk.exporter.span.* leave from here; the processor's own series are the
    # serving process's (the same names and component ids from two processes would be one series).
    processors = configuration.span_processors(configuration.exporters("traces", meter_provider),
                                               NoOpMeterProvider())
    for made in processors:
        provider.add_span_processor(made)
    on_end = [made.on_end for made in processors]
    rebuilder = _Rebuilder()
    timeout_ms = 5_000.0
    while True:
        try:
            frame = _read(source)
        except (OSError, ValueError, EOFError):
            frame = None
        if frame is None or frame[0] == "x":
            if frame is not None:
                timeout_ms = frame[1]
            break
        kind = frame[0]
        try:
            if kind == "f":
                ok = provider.force_flush(int(frame[2]))
                _write(answers, ("f", frame[1], bool(ok)))
                answers.flush()
            else:
                for span in rebuilder.take(frame) or ():
                    for call in on_end:
                        call(span)
        except Exception as exc:  # pylint: disable=broad-except  # one bad frame must not end the helper
            warn_once(f"span_export_process:frame:{type(exc).__name__}", "otel-hicache: the span export helper "
                      "could not take a %r frame: %r", kind, exc)
    from .bounded_flush import bounded

    bounded("shutdown", provider, meter_provider, timeout_ms / 1e3)
    return 0


def main() -> int:
    import logging

    logging.basicConfig(format="[otel-hicache span export helper, pid %(process)d] %(levelname)s %(name)s: "
                               "%(message)s")
    try:
        os.nice(NICE)
    except (AttributeError, OSError):  # not POSIX, or not allowed: at the serving process's priority
        pass
    return serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    sys.exit(main())
