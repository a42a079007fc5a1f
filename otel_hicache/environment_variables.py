"""Environment variables read by otel-hicache.

One constant per variable, each with its default, in the style of
``opentelemetry.sdk.environment_variables``. The standard ``OTEL_*`` variables
(``OTEL_SDK_DISABLED``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_EXPORTER_OTLP_*``, ``OTEL_TRACES_SAMPLER(_ARG)``, ``OTEL_TRACES_EXPORTER``,
``OTEL_METRICS_EXPORTER``, ``OTEL_METRIC_EXPORT_INTERVAL``...) keep their
specified meaning; see :mod:`otel_hicache.configuration`.

A malformed value never crashes the host: a one-time warning names the
variable and the documented default is used instead. Booleans are ``true`` or
``false`` (case-insensitive), as the OTel specification defines them.
"""

OTEL_HICACHE_ENABLED = "OTEL_HICACHE_ENABLED"
"""
.. envvar:: OTEL_HICACHE_ENABLED

``true`` (default) or ``false``. ``false`` turns every ``submit()`` into an
immediate return, as ``OTEL_SDK_DISABLED=true`` does.
Default: ``true``
"""

OTEL_HICACHE_STRICT = "OTEL_HICACHE_STRICT"
"""
.. envvar:: OTEL_HICACHE_STRICT

``true`` makes misuse of the API (unknown direction, negative or
non-integer counts, ``page_size < 1``) raise ``ValueError``/``TypeError`` in the
caller instead of being counted and warned about. Meant for tests.
Default: ``false``
"""

OTEL_HICACHE_MAX_QUEUE_SIZE = "OTEL_HICACHE_MAX_QUEUE_SIZE"
"""
.. envvar:: OTEL_HICACHE_MAX_QUEUE_SIZE

Most transfer records held between ``submit()`` and their span being emitted
(queued, in flight on the device, or waiting for their ack). Beyond it new
records are dropped and counted in ``otel_hicache.records.dropped{reason=queue_full}``.
Default: ``16384``
"""

OTEL_HICACHE_POLL_INTERVAL_MS = "OTEL_HICACHE_POLL_INTERVAL_MS"
"""
.. envvar:: OTEL_HICACHE_POLL_INTERVAL_MS

How often the poller polls ``finish_event.query()`` while records are pending
(after 100 ms without work it backs off to 50 ms; ``submit()`` never wakes it).
Device-timed durations do not depend on it; host-clock durations of records with a
finish event but no timing (and no ``host_end_ns``) are rounded up to it. Each wake-up
costs the serving process a fixed amount of CPU (``benchmarks/serving_cpu.py``: idle, 30 ops/s), which
this interval spreads over the ops completed meanwhile.
Default: ``10``
"""

OTEL_HICACHE_ACK_TIMEOUT_S = "OTEL_HICACHE_ACK_TIMEOUT_S"
"""
.. envvar:: OTEL_HICACHE_ACK_TIMEOUT_S

How long a completed transfer submitted with ``expect_ack=True`` waits for
``ack()`` before its span is emitted with ``hicache.acked=false``. Metrics other
than ``hicache.transfer.ack_delay`` are recorded at completion and never wait.
Default: ``30``
"""

OTEL_HICACHE_TRANSFER_TIMEOUT_S = "OTEL_HICACHE_TRANSFER_TIMEOUT_S"
"""
.. envvar:: OTEL_HICACHE_TRANSFER_TIMEOUT_S

A transfer whose finish event has not completed after this long is reported
as an error span (``error.type=transfer_timeout``), counted in
``otel_hicache.records.failed`` and its slot freed.
Default: ``60``
"""

OTEL_HICACHE_ANCHOR_INTERVAL_S = "OTEL_HICACHE_ANCHOR_INTERVAL_S"
"""
.. envvar:: OTEL_HICACHE_ANCHOR_INTERVAL_S

How often the poller re-records and synchronizes its wall-clock anchor event
(on its own side stream, never on the scheduler's thread).
Default: ``1``
"""

OTEL_HICACHE_SHUTDOWN_TIMEOUT_S = "OTEL_HICACHE_SHUTDOWN_TIMEOUT_S"
"""
.. envvar:: OTEL_HICACHE_SHUTDOWN_TIMEOUT_S

Upper bound for ``shutdown()`` and for the flush at interpreter exit, including
the exporters' final export, even when the collector is unreachable.
Default: ``5``
"""

OTEL_HICACHE_HOST_RESIDENCE = "OTEL_HICACHE_HOST_RESIDENCE"
"""
.. envvar:: OTEL_HICACHE_HOST_RESIDENCE

``true`` (default): ``TransferTelemetry.host_pool()`` makes host residence bookkeeping
(``hicache.host.*``, load-back span links; the sinks need NumPy), which the SGLang
adapter uses for the anchor KV host pool; the serving process only sends each op's
slots. ``false``: it returns None and no host pages are tracked.
Default: ``true``
"""

OTEL_HICACHE_TELEMETRY_PROCESS = "OTEL_HICACHE_TELEMETRY_PROCESS"
"""
.. envvar:: OTEL_HICACHE_TELEMETRY_PROCESS

Where ``configure()``'s sinks (spans, metrics, host residence, export) run. ``true``: in
a telemetry process of their own, one per serving process, started on first use with
this interpreter and environment; the serving process only captures and writes plain
records to it. ``false``: embedded, on the poller thread of the serving process.
Unset (default): the telemetry process when an exporter sends over the network (OTLP),
else embedded (``console``, ``prometheus`` or ``none``: a pull endpoint belongs to the
serving process). Providers passed to ``TransferTelemetry`` always run embedded.
Default: unset
"""

DEFAULTS = {
    OTEL_HICACHE_ENABLED: True,
    OTEL_HICACHE_STRICT: False,
    OTEL_HICACHE_MAX_QUEUE_SIZE: 16384,
    OTEL_HICACHE_POLL_INTERVAL_MS: 10.0,
    OTEL_HICACHE_ACK_TIMEOUT_S: 30.0,
    OTEL_HICACHE_TRANSFER_TIMEOUT_S: 60.0,
    OTEL_HICACHE_ANCHOR_INTERVAL_S: 1.0,
    OTEL_HICACHE_SHUTDOWN_TIMEOUT_S: 5.0,
    OTEL_HICACHE_HOST_RESIDENCE: True,
    OTEL_HICACHE_TELEMETRY_PROCESS: None,
}
"""The documented default of every ``OTEL_HICACHE_*`` variable."""
