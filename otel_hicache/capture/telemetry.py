"""``TransferTelemetry``: ``submit()`` and ``ack()`` only stamp the clock and context and queue."""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from typing import Any, Callable, Iterator, Mapping

from opentelemetry import context as otel_context

from .. import configuration
from .. import environment_variables as ev
from ..diagnostics import warn_once
from ..environment_variables import env_bool, env_float, sdk_disabled
from . import fork
from .attributes import static_attributes
from .device import timing_event_pair
from .poller import HostPoolRef, PollerSettings, Poller
from .process_exit import on_exit
from .records import S_ACK_NS, integer

_get_current_context = otel_context.get_current
_POOL_IDS = itertools.count(1)
_OPEN_FIRST = -1  # a forked child's capacity until its first call


def _stop_at_exit(ref: "weakref.ref[Poller]", timeout_s: float) -> None:
    if (poller := ref()) is not None:
        poller.stop(timeout_s)


class TransferTelemetry:
    """L1<->L2 transfers as device-timed spans and exact metrics; ``attributes`` go on every span and point."""

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None,
                 attributes: Mapping[str, Any] | None = None, *, clock: Callable[[], int] | None = None,
                 anchor_event_factory: Callable[[], Any] | None = None) -> None:
        static, self._clock = static_attributes(attributes), clock or time.time_ns
        self._shutdown_timeout_s = env_float(ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S)
        self._pipeline: Poller | None = None
        self.enabled = False
        if not env_bool(ev.OTEL_HICACHE_ENABLED) or sdk_disabled():
            return
        settings = PollerSettings()
        self._cap = settings.max_queue_size
        channel = configuration.open_channel(tracer_provider, meter_provider, static, self._cap, self._clock)
        self._pipeline = Poller(settings, channel, self._clock, anchor_event_factory)
        self.enabled = True
        on_exit(_stop_at_exit, weakref.ref(self._pipeline), self._shutdown_timeout_s, priority=20)
        fork.after_fork_in_child(self._after_fork_in_child)  # runs after the poller's

    def _after_fork_in_child(self) -> None:
        self._cap = _OPEN_FIRST

    def _first_in_child(self, poller: Poller) -> bool:
        """A forked child's first call opens its channel; True if there is room."""
        if self._cap != _OPEN_FIRST:
            return False
        self._cap = poller.settings.max_queue_size
        poller.open_channel()
        return len(poller.queue) + poller.held < self._cap

    @property
    def channel(self) -> Any:
        return self._pipeline.channel if self._pipeline is not None else None

    def submit(self, direction: str, tokens_by_pool: Mapping[str, int], num_bytes: int, *, page_size: int = 1,
               start_event: Any = None, finish_event: Any = None, io_backend: str | None = None,
               attributes: Mapping[str, Any] | None = None, expect_ack: bool = True, host_start_ns: int | None = None,
               host_end_ns: int | None = None, ack_watch: tuple | None = None, cause: str | None = None,
               cause_call: tuple | None = None, host_slots: tuple | None = None, requests: Any = None) -> list | None:
        """Report one merged op (or direct copy), read later on the poller; returns the handle to ack."""
        if (poller := self._pipeline) is None:
            return None
        try:
            if len(poller.queue) + poller.held >= self._cap and not self._first_in_child(poller):
                next(poller.refused)
                return None
            # records.SUBMISSION_FIELDS as a literal: the cheapest build
            record = [direction, tokens_by_pool, num_bytes, page_size, start_event, finish_event, io_backend,
                      attributes, expect_ack, self._clock() if host_start_ns is None else host_start_ns,
                      _get_current_context(), host_start_ns, host_end_ns, ack_watch, cause, cause_call,
                      host_slots, requests, None]
            poller.queue.append(record)
            if poller.idle:
                poller.wake()
            return record
        except Exception:  # never raise into the host application
            return None

    def host_pool(self, slots: int, page_size: int, name: str = "kv") -> Any:
        """A pool for ``host_slots`` and :meth:`host_freed`; None if disabled or bad (warned)."""
        if (poller := self._pipeline) is None or not env_bool(ev.OTEL_HICACHE_HOST_RESIDENCE):
            return None
        try:
            slots, page_size, name = integer(slots, "slots", 1), integer(page_size, "page_size", 1), str(name)
        except (TypeError, ValueError) as exc:
            warn_once(f"host_pool:{exc}"[:200], "otel-hicache: cannot track the %s host pool (%s)", name, exc)
            return None
        pool = HostPoolRef(next(_POOL_IDS), name, slots, page_size)
        poller.add(pool)
        return pool

    def host_freed(self, pool: Any, slots: Any) -> None:
        """The host freed ``slots`` of ``pool``; never refused."""
        if (poller := self._pipeline) is not None and type(pool) is HostPoolRef:
            with contextlib.suppress(Exception):  # never raise into the host application
                self._first_in_child(poller)
                poller.add((pool, slots))

    def ack(self, handle: list | None) -> None:
        try:
            if handle is not None and handle[S_ACK_NS] is None:
                handle[S_ACK_NS] = self._clock()
        except (TypeError, IndexError, KeyError):
            warn_once("ack:handle", "otel-hicache: ack() got %s, not a handle from submit()", type(handle).__name__)

    @contextlib.contextmanager
    def transfer(self, direction: str, tokens_by_pool: Mapping[str, int], num_bytes: int, *, stream: Any = None,
                 **options: Any) -> Iterator[None]:
        """The block's copies as one op without an ack, timed on ``stream`` else by the host clock (``options``:
        submit()'s); none if the block raises."""
        events = None
        if stream is not None and self._pipeline is not None:
            try:
                events = timing_event_pair(stream)
                events[0].record(stream)
            except Exception as exc:
                events = None
                warn_once(f"stream:{type(stream).__name__}", "otel-hicache: cannot record timing events on %s "
                          "(%r); using the host clock", type(stream).__name__, exc)
        host_start = self._clock()
        yield
        if events is not None:
            try:
                events[1].record(stream)
            except Exception:
                events = None
        self.submit(direction, tokens_by_pool, num_bytes, start_event=events and events[0],
                    finish_event=events and events[1], expect_ack=False, host_start_ns=host_start,
                    host_end_ns=None if events else self._clock(), **options)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Report every op completed (and acked, if it waits for one) and export, bounded."""
        if (poller := self._pipeline) is None:
            return True
        deadline, flushed = time.monotonic() + timeout_s, poller.flush(timeout_s)
        channel = poller.channel  # exports what was taken in, even while an op is in flight
        return (channel is None or channel.flush(max(0.1 * timeout_s, deadline - time.monotonic()))) and flushed

    def shutdown(self) -> None:
        """Stop, report what was recorded and export, bounded."""
        poller, self._pipeline = self._pipeline, None
        self.enabled = False
        if poller is not None:
            poller.stop(self._shutdown_timeout_s)
