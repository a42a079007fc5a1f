"""otel-hicache for SGLang: every HiCache L1<->L2 copy becomes a device-timed span.

Entry points ``sglang.srt.plugins`` (``otel_hicache``, run by SGLang's ``load_plugins()`` in each
scheduler) and ``opentelemetry_instrumentor`` (``sglang_hicache``), or by hand:
``SGLangHiCacheInstrumentor().instrument()`` (``tracer_provider=``, ``meter_provider=``: else each
process that makes a HiCache controller builds otel-hicache's own from ``OTEL_*``).
"""

from __future__ import annotations

import sys
from typing import Any, Collection

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

import otel_hicache
from otel_hicache import environment_variables as ev
from otel_hicache.diagnostics import logger, warn_once

from . import causes
from .package import _instruments
from .patching import Group, Incompatible, Patcher, why_not_applied
from .transfers import OFFLOAD, ONBOARD, TransferObserver
from .version import __version__

__all__ = ["SGLangHiCacheInstrumentor", "patch_groups", "plugin", "__version__"]

L2_TRANSFER = "sglang.srt.mem_cache.l2_transfer"
CACHE_CONTROLLER = "sglang.srt.managers.cache_controller"
HOST_POOL = "sglang.srt.mem_cache.pool_host.base"

FIELDS = (  # the fields of SGLang's named tuples that the adapter reads: the version guard
    (CACHE_CONTROLLER, "HiCacheAck",
     ("start_event", "finish_event", "num_tokens", "timing_enabled", "num_tokens_by_pool", "num_bytes")),
    (L2_TRANSFER, "TransferCompletion", ("start_event", "finish_event", "timing_enabled")),
    (L2_TRANSFER, "L2Transfer", ("host_pool", "host_indices", "is_draft")),
)


def _check_transfers() -> None:
    for module, cls, fields in FIELDS:
        have = getattr(getattr(sys.modules[module], cls, None), "_fields", None)
        if have is None:
            raise Incompatible(f"{module}.{cls} not found")
        absent = [f for f in fields if f not in have]
        if absent:
            raise Incompatible(f"{cls} has no field {', '.join(absent)}")


def _groups(observer: TransferObserver) -> list[Group]:
    """What is wrapped (``docs/sglang.md``), all or nothing per group."""
    return [
        Group("L1<->L2 transfers", [
            (L2_TRANSFER, "L2TransferEngine.submit_device_to_host", observer.submit_wrapper(OFFLOAD)),
            (L2_TRANSFER, "L2TransferEngine.submit_host_to_device", observer.submit_wrapper(ONBOARD)),
            (CACHE_CONTROLLER, "HiCacheController.__init__", observer.init_wrapper),
            (CACHE_CONTROLLER, "HiCacheController.start_writing",
             observer.start_wrapper(OFFLOAD, "write_queue", "ack_write_queue")),
            (CACHE_CONTROLLER, "HiCacheController.start_loading",
             observer.start_wrapper(ONBOARD, "load_queue", "ack_load_queue")),
        ], check=_check_transfers),
        *(Group(name, [(site.module, site.path, observer.causes.site(site)) for site in sites])
          for name, sites in causes.SITES.items()),
        Group("host residence", [(HOST_POOL, "HostKVCache.free", observer.host_free_wrapper)]),
    ]


def _request_groups(observer: TransferObserver) -> list[Group]:
    """Wrapped only once SGLang's request tracing is on."""
    return [Group(name, [(site.module, site.path, observer.causes.request_site(site)) for site in sites])
            for name, sites in causes.REQUEST_SITES.items()]


class SGLangHiCacheInstrumentor(BaseInstrumentor):
    """Instruments SGLang HiCache's L1<->L2 transfers."""

    _observer: TransferObserver | None = None
    _patchers: tuple[Patcher, ...] = ()

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        if not ev.env_bool(ev.OTEL_HICACHE_ENABLED) or ev.sdk_disabled():
            logger.debug("otel-hicache: disabled by OTEL_HICACHE_ENABLED/OTEL_SDK_DISABLED; SGLang not patched")
            return
        tracer_provider, meter_provider = kwargs.get("tracer_provider"), kwargs.get("meter_provider")

        def make_telemetry(ranks: dict[str, Any]) -> otel_hicache.TransferTelemetry:
            if tracer_provider is None or meter_provider is None:
                otel_hicache.configure()  # private providers from OTEL_*, this process's own
            return otel_hicache.TransferTelemetry(tracer_provider, meter_provider, attributes=ranks)

        observer = self._observer = TransferObserver(make_telemetry)
        self._patchers = (Patcher("SGLang", _groups(observer)), Patcher("SGLang", _request_groups(observer)))
        observer.request_patcher = self._patchers[1]  # instrumented by the first controller, if SGLang traces
        self._patchers[0].instrument()

    def _uninstrument(self, **kwargs: Any) -> None:
        observer, patchers = self._observer, self._patchers
        self._observer, self._patchers = None, ()
        if observer is not None:
            observer.request_patcher = None  # a controller made from now on wraps nothing again
        for patcher in reversed(patchers):  # the request sites, applied over the cause sites, first
            patcher.uninstrument()
        if observer is not None and observer.telemetry is not None:
            observer.telemetry.shutdown()  # reports what was recorded; bounded

    @property
    def telemetry(self) -> otel_hicache.TransferTelemetry | None:
        """This process's telemetry, once a HiCache controller exists (tests, diagnostics)."""
        return self._observer.telemetry if self._observer is not None else None

    def instrumented_groups(self) -> list[str]:
        """Which patch groups are in place (the rest were incompatible or not imported yet)."""
        return [name for patcher in self._patchers for name in patcher.applied()]


def patch_groups() -> list[tuple[str, str | None]]:
    """Each patch group and why it would not apply here (None: it would); imports SGLang, wraps nothing."""
    import importlib

    failed: str | None = None  # after one failed import, not the seconds of another
    report = []
    observer = TransferObserver(lambda ranks: None)
    for group in [*_groups(observer), *_request_groups(observer)]:  # wrappers made, never applied
        for module in dict.fromkeys(m for m, _, _ in group.targets):
            try:
                if module not in sys.modules and failed is None:
                    importlib.import_module(module)
            except Exception as exc:
                failed = f"cannot import {module} ({type(exc).__name__}: {exc})"
        imported = all(m in sys.modules for m, _, _ in group.targets)
        report.append((group.name, why_not_applied(group) if imported else failed))
    return report


def plugin() -> None:
    """The ``sglang.srt.plugins`` entry point, run by SGLang's ``load_plugins()``."""
    try:
        instrumentor = SGLangHiCacheInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:  # opentelemetry-instrument got here first
            instrumentor.instrument()
    except Exception as exc:  # never into SGLang
        warn_once("sglang:plugin", "otel-hicache: the SGLang plugin could not start (%r); SGLang runs "
                  "uninstrumented", exc)
