"""The capture's messages (:mod:`..record`) made telemetry, per serving process."""

import time
from typing import Any, Callable, Mapping

from .. import record as rec
from .. import semconv as sc
from ..diagnostics import logger, warn_once
from .busy_time import BusyTimeTracker
from .host_residence import HostPool
from .metrics import TransferMetrics
from .spans import SpanBuilder

_BUSY_MARGIN_NS = 5 * 10**9  # intervals kept this long before the oldest op in flight


class Op:
    span_context = exemplar_context = None
    host, links, links_dropped = (None, None, None), (), 0  # host: (pool, pages written, Reuse)

    def __init__(self, message: tuple) -> None:
        self.__dict__.update(zip(rec.OP_FIELDS, message[1:]))


class Consumer:
    """``hello``: static ``attributes`` (on each span and point unless ``in_resource``) and ``pools``."""

    def __init__(self, tracer_provider: Any, meter_provider: Any, hello: Mapping,
                 clock: Callable[[], int] = time.time_ns, ids: Any = None) -> None:
        attributes = {k: tuple(v) if type(v) is list else v for k, v in (hello.get("attributes") or {}).items()}
        static = {} if hello.get("in_resource") else attributes
        location = (sc.LOCATION_EMBEDDED_FALLBACK if hello.get("fallback") else
                    sc.LOCATION_EMBEDDED if hello.get("embedded") else sc.LOCATION_TELEMETRY_PROCESS)
        self.metrics = TransferMetrics(meter_provider, static, clock, str(attributes.get(sc.IO_BACKEND, "unknown")),
                                       location)
        self.spans = SpanBuilder(tracer_provider, static, ids)
        self._busy = {d: BusyTimeTracker() for d in rec.DIRECTIONS}
        self._pools, self._host = {}, {}  # _host: seq -> Op.host until its OP
        self._awaiting = {}  # seq -> (op, span, message), to its ACK
        self._handlers = {rec.OP: self._op, rec.ACK: self._ack, rec.HOST: self._host_pages, rec.POOL: self._pool,
                          rec.FREE: self._freed, rec.STATE: self._state, rec.CHECKPOINT: self._resume,
                          rec.DROPPED: lambda m: m[2] and self.metrics.dropped_records(m[1], m[2]),
                          rec.FLUSH: lambda m: None, rec.STOP: lambda m: None}
        self.apply(hello.get("pools") or [])

    def apply(self, batch: list[tuple]) -> None:
        handlers = self._handlers
        for message in batch:
            try:
                handlers[message[0]](message)
            except Exception as exc:  # pylint: disable=broad-except  # one message, not the batch
                if message[0] in (rec.OP, rec.ACK):
                    self.metrics.dropped_records(sc.DROP_INTERNAL_ERROR)
                warn_once(f"consumer:{type(exc).__name__}", "otel-hicache: a transfer record could not be "
                          "reported (%r)", exc)
                logger.debug("otel-hicache consumer error", exc_info=True)

    def checkpoint(self) -> list:
        return [rec.CHECKPOINT, self.metrics.checkpoint(), [entry[2] for entry in self._awaiting.values()]]

    def _resume(self, message: tuple) -> None:
        self.metrics.seed(message[1])
        for raw in message[2]:
            op = Op(raw)
            self._awaiting[op.seq] = (op, self.spans.begin(op), raw)

    def close(self) -> None:
        for seq in list(self._awaiting):
            self._ack((rec.ACK, seq, None))

    def _op(self, message: tuple) -> None:
        op = Op(message)
        op.host = pool, written, reuse = self._host.pop(op.seq, op.host)
        if reuse is not None and op.error is None:
            try:
                op.links, op.links_dropped = pool.links(reuse)
            except Exception as exc:  # the span is made, unlinked
                warn_once(f"links:{type(exc).__name__}", "otel-hicache: cannot link a load-back (%r)", exc)
        state = self.spans.begin(op)  # first: an op whose span cannot begin changes nothing
        if op.error is not None:
            self.metrics.failed_record(op.error)
            self.spans.finish(op, state)
            return
        if written is not None and op.span_context.trace_flags.sampled:
            pool.link(written, op.span_context.trace_id, op.span_context.span_id)
        self.metrics.completed(op, self._busy[op.direction].add(op.start_ns, op.end_ns))
        if state[1]:  # waits for its ack
            self._awaiting[op.seq] = (op, state, message)
        else:
            self._finish(op, state)

    def _finish(self, op: Op, state: Any) -> None:
        if op.ack_ns is not None:
            self.metrics.acked(op)
        self.spans.finish(op, state)

    def _ack(self, message: tuple) -> None:
        entry = self._awaiting.pop(message[1], None)
        if entry is not None:
            entry[0].ack_ns = message[2]
            self._finish(entry[0], entry[1])

    def _pool(self, message: tuple) -> None:
        if message[1] not in self._pools:  # (sent again to a successor)
            self._pools[message[1]] = HostPool(int(message[3]), int(message[4]), message[2])

    def _host_pages(self, message: tuple) -> None:
        _kind, seq, pool_id, direction, data, submit_ns, cause, num_bytes = message
        pool = self._pools.get(pool_id)
        if pool is None:
            return
        pages = pool.pages(data)
        if direction == rec.OFFLOAD:
            self._host[seq] = (pool, pages, None)
            self.metrics.host_waste(pool.written(pages, submit_ns, cause, num_bytes))
        else:
            reuse = self._host[seq] = (pool, None, pool.read(pages, submit_ns))
            self.metrics.host_reuse(cause, reuse[2])

    def _freed(self, message: tuple) -> None:
        pool = self._pools.get(message[1])
        if pool is not None:
            self.metrics.host_waste(pool.freed(pool.pages(message[2])))

    def _state(self, message: tuple) -> None:
        self.metrics.state(*message[1:6])
        oldest = min((t for t in message[2].values() if t is not None), default=None)
        if oldest is not None or not any(message[1].values()):
            for tracker in self._busy.values():
                tracker.forget_before((tracker.latest_end or 0 if oldest is None else oldest) - _BUSY_MARGIN_NS)
