"""A HiCache-shaped KV-cache workload on real torch tensors, reported by otel-hicache.

What it models
--------------
SGLang's hierarchical cache (HiCache) keeps KV-cache pages in two tiers:
L1 = GPU memory (the device pool) and L2 = pinned host DRAM (the host pool).
The cache controller moves *merged ops* of whole pages between them:

* offload (write-back): device pages a forward pass just filled are copied to
  free host pages, on a dedicated write stream;
* onboard (load-back): host pages that hit in the radix tree are copied back
  into free device pages, on a dedicated load stream.

Here the pools are real tensors laid out ``[num_pages, page_size,
bytes_per_token]`` (uint8, "page first", so a page is one contiguous block in
both tiers). The default shape is Qwen3-0.6B-like: 28 layers x 8 KV heads x
head dim 128 in bf16, i.e. K+V = 114,688 bytes per token, pages of 64 tokens.
Three pools move together in every op:

* ``kv``: the full-attention pool, the *anchor* pool (``HiCacheAck.num_tokens``);
* ``swa``: a sliding-window pool with a quarter of the layers that keeps only
  the last window of an op (its own bytes/token, its own token count);
* ``draft``: a 1-layer draft model's KV (speculative decoding), counted in
  ``num_bytes`` only, as SGLang's ``HiCacheAck.num_bytes`` includes draft and
  sidecar bytes.

Requests: every write-through backup writes one request's KV and every prefix-hit
load-back loads one request's prefix, so each such op's span links to that request's
span (``example.request``, the root of its own trace, as SGLang's request tracing
makes them; ``submit(requests=...)``); write-backs and storage prefetches serve no one
request and link to none.

Op sizes (pages per op) and directions come from a seeded RNG. Every copy is a
real ``copy_`` of page runs between the two pools (SGLang's ``direct`` I/O
backend); a tag written into each page by the simulated forward pass is checked
in both tiers at the end, so the copies are verified, not just timed.

On CUDA the host pools are pinned, each direction has its own side stream,
copies are ``non_blocking`` and timed by ``enable_timing=True`` events recorded
on that stream; ops are reported with ``TransferTelemetry.submit()`` and
acknowledged with ``ack()`` once a consumer sees ``finish_event.query()`` true
(as SGLang's ack queues), every fourth op with ``with tel.transfer(...,
stream=...)`` instead. On CPU the copies are synchronous and timed on the host
clock (``hicache.timing_source=host_clock``) by ``with tel.transfer(...)``,
every fourth op reported with ``submit()`` and the host times of its copy, and
acknowledged from the same ack queue.

Run it
------
::

    python examples/hicache_workload.py            # or: bash scripts/demo.sh (sets up a venv first)
    python examples/hicache_workload.py --ops 1000 --device cuda

By default nothing leaves the process: an embedded OTel SDK pipeline
(in-memory metric reader and span exporter) receives the telemetry and a
summary per direction is printed from the *exported* metrics, then checked
against the workload's own totals. To send spans and metrics to an
OpenTelemetry collector instead, set the standard variables::

    OTEL_SERVICE_NAME=hicache-demo \\
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 \\
    python examples/hicache_workload.py

(``OTEL_TRACES_EXPORTER``/``OTEL_METRICS_EXPORTER=console`` prints them
instead.) In that mode the workload's own totals are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

try:
    import otel_hicache
except ImportError:  # run as a script from a checkout where the package is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import otel_hicache

from opentelemetry import context as otel_context

from otel_hicache import environment_variables as ev
from otel_hicache import semconv as sc
from otel_hicache import TransferTelemetry
from otel_hicache.record import DIRECTIONS, OFFLOAD, ONBOARD
from otel_hicache.sinks.providers import build as build_providers

STEP_SPAN = "example.scheduler_step"
"""The span each op runs under, standing in for a server's scheduler step."""
REQUEST_SPAN = "example.request"
"""The root span of the request an op serves (its own trace): the op's span links to it."""

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        import torch
    except ImportError:  # torch is an optional dependency of otel-hicache
        torch = None

DEFAULT_SERVICE_NAME = "otel-hicache-demo"
IO_BACKEND = "direct"
TRANSFER_EVERY = 4
"""Every TRANSFER_EVERY-th op uses the other reporting path (tel.transfer on CUDA,
submit()+ack() with host times on CPU)."""

_OTLP_ENDPOINT_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)
_EXPORTER_VARS = ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER")


# --------------------------------------------------------------------------------------
# histogram quantiles and the summary built from exported metrics
# --------------------------------------------------------------------------------------
def histogram_quantile(q: float, bounds: Sequence[float], bucket_counts: Sequence[float]) -> float:
    """Estimate the ``q``-quantile of an explicit-bucket histogram like Prometheus'
    ``histogram_quantile``: find the bucket holding rank ``q * count`` and
    interpolate linearly inside it.

    ``bounds`` are the OTel explicit bounds (upper bounds, increasing);
    ``bucket_counts`` the OTel per-bucket counts, ``len(bounds) + 1`` of them, the
    last one being the ``+Inf`` bucket. The first bucket's lower bound is taken
    as 0 (if its upper bound is positive). A rank in the ``+Inf`` bucket returns
    the largest finite bound. NaN for an empty histogram; -Inf/+Inf for q < 0 / q > 1.
    """
    if len(bucket_counts) != len(bounds) + 1:
        raise ValueError(f"expected {len(bounds) + 1} bucket counts, got {len(bucket_counts)}")
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    cumulative = []
    total = 0.0
    for count in bucket_counts:
        total += count
        cumulative.append(total)
    if total == 0:
        return math.nan
    rank = q * total
    upper = list(bounds) + [math.inf]
    b = next((i for i in range(len(bounds)) if cumulative[i] >= rank), len(bounds))
    if b == len(bounds):  # the +Inf bucket
        return upper[b - 1] if b > 0 else math.nan
    if b == 0 and upper[0] <= 0:
        return upper[0]
    start = 0.0 if b == 0 else upper[b - 1]
    end = upper[b]
    in_bucket = cumulative[b] - (cumulative[b - 1] if b > 0 else 0.0)
    below = cumulative[b - 1] if b > 0 else 0.0
    return start + (end - start) * ((rank - below) / in_bucket)


@dataclass
class DirectionSummary:
    """Totals of one direction, from exported metrics or from the workload itself."""

    direction: str
    ops: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    blocks: int = 0
    bytes: int = 0
    busy_s: float | None = None
    duration_sum_s: float | None = None
    p50_s: float | None = None
    p99_s: float | None = None
    timing_sources: dict[str, int] = field(default_factory=dict)
    bytes_by_cause: dict[str, int] = field(default_factory=dict)  # hicache.cause -> bytes
    # host residence (offload: the bytes it wrote that were overwritten unread; onboard: the bytes it read)
    host_bytes: int = 0
    residence_p50_s: float | None = None
    residence_p99_s: float | None = None
    residence_count: int = 0
    request_links: int = 0  # ops whose span links to the request they served (sampled requests)

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second of busy time (overlapping ops counted once)."""
        if not self.busy_s:
            return None
        return self.bytes / self.busy_s


@dataclass
class MetricsSummary:
    directions: dict[str, DirectionSummary]
    dropped: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)


def summarize(metrics_data: Any) -> MetricsSummary:
    """Per-direction totals from OTel ``MetricsData`` (cumulative temporality),
    as a backend would compute them from what otel-hicache exported."""
    dirs = {d: DirectionSummary(d, busy_s=0.0, duration_sum_s=0.0) for d in DIRECTIONS}
    histograms: dict[str, tuple[tuple[float, ...], list[float]] | None] = {}
    dropped: dict[str, int] = {}
    failed: dict[str, int] = {}
    for resource_metrics in getattr(metrics_data, "resource_metrics", ()) or ():
        for scope_metrics in resource_metrics.scope_metrics:
            if scope_metrics.scope.name != sc.SCOPE_NAME:
                continue
            for metric in scope_metrics.metrics:
                name = metric.name
                for point in metric.data.data_points:
                    attrs = point.attributes or {}
                    if name in (sc.RECORDS_DROPPED[0], sc.RECORDS_FAILED[0]):
                        into = dropped if name == sc.RECORDS_DROPPED[0] else failed
                        reason = str(attrs.get(sc.REASON))
                        into[reason] = into.get(reason, 0) + int(point.value)
                        continue
                    summary = dirs.get(attrs.get(sc.DIRECTION))
                    if summary is None:
                        continue
                    if name == sc.TRANSFER_DURATION[0]:
                        summary.ops += int(point.count)
                        summary.duration_sum_s += float(point.sum)
                        if point.count:
                            source = str(attrs.get(sc.TIMING_SOURCE))
                            sources = summary.timing_sources
                            sources[source] = sources.get(source, 0) + int(point.count)
                        _merge_buckets(histograms, summary.direction, point)
                    elif name == sc.TRANSFER_TOKENS[0]:
                        pool = str(attrs.get(sc.POOL))
                        summary.tokens[pool] = summary.tokens.get(pool, 0) + int(point.value)
                    elif name == sc.TRANSFER_BLOCKS[0]:
                        summary.blocks += int(point.value)
                    elif name == sc.TRANSFER_BYTES[0]:
                        summary.bytes += int(point.value)
                        if point.value:
                            cause = str(attrs.get(sc.CAUSE))
                            summary.bytes_by_cause[cause] = summary.bytes_by_cause.get(cause, 0) + int(point.value)
                    elif name == sc.TRANSFER_BUSY_TIME[0]:
                        summary.busy_s += float(point.value)
                if name in (sc.HOST_WASTED_BYTES[0], sc.HOST_RELOADED_BYTES[0]):
                    summary = dirs[OFFLOAD if name == sc.HOST_WASTED_BYTES[0] else ONBOARD]
                    summary.host_bytes += sum(int(p.value) for p in metric.data.data_points)
                elif name == sc.HOST_RESIDENCE_TIME[0]:
                    for point in metric.data.data_points:
                        dirs[ONBOARD].residence_count += int(point.count)
                        _merge_buckets(histograms, "residence", point)
    residence = histograms.get("residence")
    if residence is not None and dirs[ONBOARD].residence_count:
        dirs[ONBOARD].residence_p50_s = histogram_quantile(0.50, *residence)
        dirs[ONBOARD].residence_p99_s = histogram_quantile(0.99, *residence)
    for direction, summary in dirs.items():
        merged = histograms.get(direction)
        if merged is not None and summary.ops:
            bounds, counts = merged
            summary.p50_s = histogram_quantile(0.50, bounds, counts)
            summary.p99_s = histogram_quantile(0.99, bounds, counts)
    return MetricsSummary(dirs, dropped, failed)


def _merge_buckets(histograms: dict[str, Any], direction: str, point: Any) -> None:
    """Sum explicit-bucket points of one direction (across io_backend/timing_source
    series); None once bounds differ or the points are exponential histograms."""
    bounds = getattr(point, "explicit_bounds", None)
    counts = getattr(point, "bucket_counts", None)
    if direction in histograms and histograms[direction] is None:
        return
    if bounds is None or counts is None:
        histograms[direction] = None
        return
    bounds = tuple(bounds)
    current = histograms.get(direction)
    if current is None:
        histograms[direction] = (bounds, [float(c) for c in counts])
    elif current[0] == bounds:
        histograms[direction] = (bounds, [a + b for a, b in zip(current[1], counts)])
    else:
        histograms[direction] = None


def compare(summary: MetricsSummary, truth: Mapping[str, DirectionSummary]) -> list[str]:
    """Differences between exported counters and the workload's ground truth (empty: all match)."""
    problems = []
    for direction in DIRECTIONS:
        got = summary.directions.get(direction) or DirectionSummary(direction)
        want = truth.get(direction) or DirectionSummary(direction)
        for what, g, w in (
            ("ops", got.ops, want.ops),
            ("blocks", got.blocks, want.blocks),
            ("bytes", got.bytes, want.bytes),
        ):
            if g != w:
                problems.append(f"{direction} {what}: metrics {g:,} != workload {w:,}")
        if got.host_bytes != want.host_bytes:
            what = "wasted (overwritten before any load-back)" if direction == OFFLOAD else "reloaded"
            problems.append(f"host bytes {what}: metrics {got.host_bytes:,} != workload {want.host_bytes:,}")
        if got.residence_count != want.residence_count:
            problems.append(f"{direction} host residence values: metrics {got.residence_count:,} != workload "
                            f"{want.residence_count:,}")
        if got.bytes_by_cause != want.bytes_by_cause:
            problems.append(f"{direction} bytes by cause: metrics {got.bytes_by_cause} != workload "
                            f"{want.bytes_by_cause}")
        got_tokens = {k: v for k, v in got.tokens.items() if v}
        want_tokens = {k: v for k, v in want.tokens.items() if v}
        if got_tokens != want_tokens:
            problems.append(f"{direction} tokens by pool: metrics {got_tokens} != workload {want_tokens}")
    for reason, count in sorted({**summary.dropped, **summary.failed}.items()):
        if count:
            problems.append(f"{count:,} records dropped/failed ({reason})")
    return problems


def format_causes(rows: Iterable[DirectionSummary]) -> str:
    """One line per direction: its bytes by ``hicache.cause``, largest first."""
    return "\n".join(
        f"  {row.direction}: " + (", ".join(f"{cause} {n / 1e9:.3f} GB ({n / row.bytes:.0%})" for cause, n in
                                            sorted(row.bytes_by_cause.items(), key=lambda kv: -kv[1])) or "-")
        for row in rows)


def format_residence(offload: DirectionSummary, onboard: DirectionSummary) -> str:
    """Host residence: how long load-backs' pages sat in L2, what was reloaded and wasted."""
    return (f"  {onboard.residence_count:,} load-back x writing-offload pairs, residence p50 {_ms(onboard.residence_p50_s)}"
            f" ms, p99 {_ms(onboard.residence_p99_s)} ms; reloaded {onboard.host_bytes / 1e9:.3f} GB, wasted "
            f"(overwritten before any load-back) {offload.host_bytes / 1e9:.3f} GB")


def request_links(spans: Iterable[Any]) -> tuple[dict[str, int], int]:
    """Per direction, the transfer spans that link to a request (``hicache.link_to=request``),
    and how many of those links point at no exported ``example.request`` span."""
    requests = {(s.context.trace_id, s.context.span_id) for s in spans if s.name == REQUEST_SPAN}
    linked = {d: 0 for d in DIRECTIONS}
    dangling = 0
    for span in spans:
        to = [link.context for link in span.links if (link.attributes or {}).get(sc.LINK_TO) == sc.LINK_TO_REQUEST]
        if to:
            linked[str(span.attributes.get(sc.DIRECTION))] += 1
            dangling += sum((c.trace_id, c.span_id) not in requests for c in to)
    return linked, dangling


def format_request_links(linked: Mapping[str, int], dangling: int) -> str:
    return (f"  {linked[OFFLOAD]:,} offload and {linked[ONBOARD]:,} load-back spans link to the request they "
            f"served; every link to an exported {REQUEST_SPAN} span: {'yes' if not dangling else f'NO ({dangling:,} not)'}")


def _ms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "-"
    return f"{seconds * 1e3:.3f}"


def format_table(rows: Iterable[DirectionSummary], token_pools: Sequence[str] | None = None,
                 timing: bool = True) -> str:
    """A fixed-width table, one row per direction; ``timing=False`` leaves out the
    duration, busy-time and bandwidth columns (ground truth has none)."""
    rows = list(rows)
    if token_pools is None:
        seen: dict[str, None] = {"kv": None}
        for row in rows:
            seen.update((p, None) for p in row.tokens)
        token_pools = list(seen)
    header = ["direction", "ops"] + [f"tokens {p}" for p in token_pools]
    header += ["blocks", "GB"]
    if timing:
        header += ["p50 ms", "p99 ms", "busy ms", "GB/s", "timing"]
    lines = [header]
    for row in rows:
        sources = "/".join(f"{k}" if len(row.timing_sources) == 1 else f"{k} {v}"
                           for k, v in sorted(row.timing_sources.items())) or "-"
        bandwidth = row.bandwidth
        line = [row.direction, f"{row.ops:,}"] + [f"{row.tokens.get(p, 0):,}" for p in token_pools]
        line += [f"{row.blocks:,}", f"{row.bytes / 1e9:.3f}"]
        if timing:
            line += [
                _ms(row.p50_s),
                _ms(row.p99_s),
                "-" if row.busy_s is None else f"{row.busy_s * 1e3:.1f}",
                "-" if bandwidth is None else f"{bandwidth / 1e9:.2f}",
                sources,
            ]
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    left = {0, len(header) - 1} if timing else {0}  # direction and timing source: left-aligned
    out = []
    for line in lines:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


# --------------------------------------------------------------------------------------
# telemetry pipelines
# --------------------------------------------------------------------------------------
def export_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """True when the standard OTEL_* variables ask for an exporter (OTLP or console)."""
    return any(environ.get(name, "").strip() for name in _OTLP_ENDPOINT_VARS + _EXPORTER_VARS)


class EmbeddedPipeline:
    """OTel SDK providers that keep everything in memory: no collector needed."""

    def __init__(self) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
        self.span_exporter = InMemorySpanExporter()
        self.metric_reader = InMemoryMetricReader()
        self.tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.span_exporter))
        self.meter_provider = MeterProvider(
            metric_readers=[self.metric_reader], resource=resource, shutdown_on_exit=False
        )

    def metrics_data(self) -> Any:
        return self.metric_reader.get_metrics_data()

    def spans(self) -> Sequence[Any]:
        return self.span_exporter.get_finished_spans()

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


# --------------------------------------------------------------------------------------
# the workload
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolSpec:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16
    window_tokens: int = 0
    """> 0: sliding window; an op keeps only the pages of its last window."""
    in_tokens: bool = True
    """False: draft/sidecar bytes, counted in num_bytes, not in tokens_by_pool."""

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V


@dataclass
class WorkloadConfig:
    ops: int = 200
    seed: int = 0
    layers: int = 28
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 64
    pool_tokens: int = 2048
    host_ratio: int = 2
    max_op_pages: int = 12
    swa_window: int = 256
    draft_layers: int = 1
    rate: float = 0.0  # ops per second; 0: as fast as the copies go

    def pools(self) -> list[PoolSpec]:
        specs = [PoolSpec("kv", self.layers, self.kv_heads, self.head_dim)]
        if self.swa_window > 0:
            specs.append(PoolSpec("swa", max(1, self.layers // 4), self.kv_heads, self.head_dim,
                                  window_tokens=self.swa_window))
        if self.draft_layers > 0:
            specs.append(PoolSpec("draft", self.draft_layers, self.kv_heads, self.head_dim, in_tokens=False))
        return specs

    @property
    def device_pages(self) -> int:
        return self.pool_tokens // self.page_size

    @property
    def host_pages(self) -> int:
        return self.device_pages * self.host_ratio


class Pool:
    """One KV pool in both tiers, plus the tag each page is expected to hold."""

    def __init__(self, spec: PoolSpec, cfg: WorkloadConfig, device: Any) -> None:
        self.spec = spec
        self.page_bytes = cfg.page_size * spec.bytes_per_token
        shape = (cfg.page_size, spec.bytes_per_token)
        pin = device.type != "cpu"
        self.device = torch.empty((cfg.device_pages, *shape), dtype=torch.uint8, device=device)
        self.device.fill_(0x5A)  # real data in L1 (copies from untouched memory would flatter the CPU)
        self.host = torch.empty((cfg.host_pages, *shape), dtype=torch.uint8, pin_memory=pin)
        self.host.zero_()  # resident, as pinned memory is: no first-touch page faults inside timed copies
        self.device_tags: list[int | None] = [None] * cfg.device_pages
        self.host_tags: list[int | None] = [None] * cfg.host_pages
        if spec.window_tokens > 0:
            self.window_pages = -(-spec.window_tokens // cfg.page_size)
        else:
            self.window_pages = 0

    @property
    def nbytes(self) -> int:
        return self.device.nbytes + self.host.nbytes

    def kept(self, pages: Sequence[int]) -> Sequence[int]:
        """The pages of an op this pool moves (a sliding window keeps the last ones)."""
        if self.window_pages and len(pages) > self.window_pages:
            return pages[-self.window_pages:]
        return pages


def write_tags(tensor: Any, pages: Sequence[int], tags: Sequence[int]) -> None:
    """Stamp each page's first and last 8 bytes (the simulated forward pass writing KV)."""
    index = torch.tensor(list(pages), dtype=torch.long, device=tensor.device)
    values = torch.tensor(list(tags), dtype=torch.int64).view(torch.uint8).view(len(tags), 8).to(tensor.device)
    tensor[index, 0, :8] = values
    tensor[index, -1, -8:] = values


def read_tags(tensor: Any) -> tuple[list[int], list[int]]:
    first = tensor[:, 0, :8].contiguous().view(torch.int64).view(-1).cpu().tolist()
    last = tensor[:, -1, -8:].contiguous().view(torch.int64).view(-1).cpu().tolist()
    return first, last


REQUEST_CAUSES = frozenset((sc.CAUSE_WRITE_THROUGH, sc.CAUSE_PREFIX_HIT))
"""The causes of the workload whose op serves one request (its span links to it)."""


def _cause(direction: str, index: int) -> str:
    """The ``hicache.cause`` the workload gives op ``index``, as a server's would vary: offloads
    are write-through backups of pages a forward pass just filled, every fifth a write-back
    before a device eviction; load-backs are prefix hits, every seventh a prefix prefetched
    from storage (L3) and loaded from its host staging pages."""
    if direction == OFFLOAD:
        return sc.CAUSE_WRITE_BACK if index % 5 == 0 else sc.CAUSE_WRITE_THROUGH
    return sc.CAUSE_STORAGE_PREFETCH if index % 7 == 0 else sc.CAUSE_PREFIX_HIT


def copy_pages(dst: Any, dst_pages: Sequence[int], src: Any, src_pages: Sequence[int], non_blocking: bool) -> int:
    """Copy pages ``src[src_pages[i]] -> dst[dst_pages[i]]``, one ``copy_`` per run of
    consecutive pages (SGLang's ``direct`` backend). Returns the bytes copied."""
    pairs = sorted(zip(src_pages, dst_pages))
    moved = 0
    i = 0
    while i < len(pairs):
        s0, d0 = pairs[i]
        n = 1
        while i + n < len(pairs) and pairs[i + n] == (s0 + n, d0 + n):
            n += 1
        target = dst[d0:d0 + n]
        target.copy_(src[s0:s0 + n], non_blocking=non_blocking)
        moved += target.nbytes
        i += n
    return moved


@dataclass
class InFlight:
    handle: Any  # from tel.submit(), acked by the consumer; None for tel.transfer() ops
    done: Any  # an event that completes with the copies; None for synchronous copies
    device_pages: Sequence[int]
    host_pages: Sequence[int]


class HiCacheWorkload:
    def __init__(self, cfg: WorkloadConfig, device: Any) -> None:
        self.cfg = cfg
        self.device = device
        self.cuda = device.type == "cuda"
        self.rng = random.Random(cfg.seed)
        self.pools = [Pool(spec, cfg, device) for spec in cfg.pools()]
        self.anchor = self.pools[0]
        self.host_free: deque[int] = deque(range(cfg.host_pages))
        self.host_valid: dict[int, None] = {}  # host pages holding data, least recently used first
        self.busy_device: set[int] = set()
        self.busy_host: set[int] = set()
        self.pending: deque[InFlight] = deque()
        self.next_tag = 1
        self.truth = {d: DirectionSummary(d, tokens={"kv": 0}) for d in DIRECTIONS}
        self.host_pool: Any = None  # tel.host_pool(), made in run()
        self.tracer: Any = None  # run()'s: request spans
        # host page -> [bytes the offload put on it, times read, which offload (its number)]
        self.page_state: dict[int, list[int]] = {}
        self.offloads_written = 0
        self.acked = 0
        if self.cuda:
            self.write_stream = torch.cuda.Stream(device=device)
            self.load_stream = torch.cuda.Stream(device=device)
        for pool in self.pools:  # the forward pass filled L1 once
            self._stamp(pool, range(cfg.device_pages))
        if self.cuda:
            torch.cuda.synchronize(device)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def _stamp(self, pool: Pool, pages: Sequence[int]) -> None:
        tags = list(range(self.next_tag, self.next_tag + len(pages)))
        self.next_tag += len(pages)
        write_tags(pool.device, pages, tags)
        for page, tag in zip(pages, tags):
            pool.device_tags[page] = tag

    # -- consumer: the ack queue ------------------------------------------------------
    def poll(self, tel: TransferTelemetry) -> None:
        still: deque[InFlight] = deque()
        for op in self.pending:
            if op.done is None or op.done.query():
                if op.handle is not None:
                    tel.ack(op.handle)
                    self.acked += 1
                self.busy_device.difference_update(op.device_pages)
                self.busy_host.difference_update(op.host_pages)
            else:
                still.append(op)
        self.pending = still

    def _wait_oldest(self, tel: TransferTelemetry) -> bool:
        if not self.pending:
            return False
        oldest = self.pending[0]
        if oldest.done is not None:
            oldest.done.synchronize()
        self.poll(tel)
        return True

    def drain(self, tel: TransferTelemetry) -> None:
        while self._wait_oldest(tel):
            pass
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # -- page choice ----------------------------------------------------------------
    def _free_device(self) -> list[int]:
        return [p for p in range(self.cfg.device_pages) if p not in self.busy_device]

    def _readable_host(self) -> list[int]:
        return [p for p in self.host_valid if p not in self.busy_host]

    def _writable_host_count(self) -> int:
        return len(self.host_free) + len(self._readable_host())

    def _alloc_host(self, n: int) -> list[int]:
        pages = []
        while self.host_free and len(pages) < n:
            pages.append(self.host_free.popleft())
        for page in list(self.host_valid):  # evict least recently used
            if len(pages) == n:
                break
            if page not in self.busy_host:
                del self.host_valid[page]
                pages.append(page)
        return pages

    # -- ops ------------------------------------------------------------------------
    def run(self, tel: TransferTelemetry, progress: Any = None, tracer: Any = None) -> dict[str, DirectionSummary]:
        """Run every op; with ``tracer``, each inside a ``example.scheduler_step`` span (the
        transfer spans become its children, as under a request span in a server)."""
        started = time.monotonic()
        self.tracer = tracer
        self.host_pool = tel.host_pool(self.cfg.host_pages * self.cfg.page_size, self.cfg.page_size)
        for i in range(self.cfg.ops):
            if self.cfg.rate > 0:  # paced: op i starts i/rate seconds in (a serving process is never flat out)
                delay = started + i / self.cfg.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            if tracer is None:
                self._step(tel, i)
            else:
                with tracer.start_as_current_span(STEP_SPAN, attributes={"example.step": i}):
                    self._step(tel, i)
            if progress is not None and (i + 1) % max(1, self.cfg.ops // 4) == 0:
                progress(i + 1)
        self.drain(tel)
        return self.truth

    def _step(self, tel: TransferTelemetry, i: int) -> None:
        """One scheduler step: poll acks, then one merged op."""
        self.poll(tel)
        want = self.rng.randint(1, self.cfg.max_op_pages)
        direction = OFFLOAD if self.rng.random() < 0.5 or not self.host_valid else ONBOARD
        while True:
            free_device = self._free_device()
            if direction == OFFLOAD:
                room = min(len(free_device), self._writable_host_count())
            else:
                room = min(len(free_device), len(self._readable_host()))
            if room >= want or not self._wait_oldest(tel):
                break
        n = min(want, room)
        if n == 0:  # nothing readable in L2 (all in flight): write back instead
            direction, n = OFFLOAD, min(want, len(free_device), self._writable_host_count())
        if direction == OFFLOAD:
            device_pages = self.rng.sample(free_device, n)
            host_pages = self._alloc_host(n)
            for pool in self.pools:  # a forward pass just filled these pages
                self._stamp(pool, device_pages)
        else:
            host_pages = self.rng.sample(self._readable_host(), n)
            device_pages = self.rng.sample(free_device, n)
        self._transfer(tel, i, direction, device_pages, host_pages)
        for page in host_pages:  # most recently used
            self.host_valid.pop(page, None)
            self.host_valid[page] = None

    def _transfer(self, tel: TransferTelemetry, index: int, direction: str,
                  device_pages: list[int], host_pages: list[int]) -> None:
        plan = []
        tokens_by_pool: dict[str, int] = {}
        num_bytes = 0
        for pool in self.pools:
            dev, host = pool.kept(device_pages), pool.kept(host_pages)
            plan.append((pool, dev, host))
            num_bytes += len(dev) * pool.page_bytes
            if pool.spec.in_tokens:
                tokens_by_pool[pool.spec.name] = len(dev) * self.cfg.page_size
        page_size = self.cfg.page_size

        def copies(non_blocking: bool) -> None:
            moved = 0
            for pool, dev, host in plan:
                if direction == OFFLOAD:
                    moved += copy_pages(pool.host, host, pool.device, dev, non_blocking)
                    for d, h in zip(dev, host):
                        pool.host_tags[h] = pool.device_tags[d]
                else:
                    moved += copy_pages(pool.device, dev, pool.host, host, non_blocking)
                    for d, h in zip(dev, host):
                        pool.device_tags[d] = pool.host_tags[h]
            if moved != num_bytes:
                raise AssertionError(f"copied {moved} bytes, reported {num_bytes}")

        self.busy_device.update(device_pages)
        self.busy_host.update(host_pages)
        other_path = index % TRANSFER_EVERY == TRANSFER_EVERY - 1
        cause = _cause(direction, index)
        host_slots = self._host_slots(direction, host_pages, num_bytes)
        request = self._request(direction, index, cause)
        requests = None if request is None else [request.get_span_context()]
        if self.cuda:
            stream = self.write_stream if direction == OFFLOAD else self.load_stream
            if direction == OFFLOAD:  # the KV was written on the compute stream
                stream.wait_stream(torch.cuda.current_stream(self.device))
            if other_path:
                with torch.cuda.stream(stream), tel.transfer(
                    direction, tokens_by_pool, num_bytes, page_size, stream=stream, io_backend=IO_BACKEND,
                    cause=cause, host_slots=host_slots, requests=requests,
                ):
                    copies(non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                self.pending.append(InFlight(None, done, device_pages, host_pages))
            else:
                start = torch.cuda.Event(enable_timing=True)
                finish = torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record(stream)
                    copies(non_blocking=True)
                    finish.record(stream)
                handle = tel.submit(direction, tokens_by_pool, num_bytes, page_size, start_event=start,
                                    finish_event=finish, timing_enabled=True, io_backend=IO_BACKEND, cause=cause,
                                    host_slots=host_slots, requests=requests)
                self.pending.append(InFlight(handle, finish, device_pages, host_pages))
        elif other_path:  # synchronous copy, host times known: submit now, ack from the queue
            t0 = time.time_ns()
            copies(non_blocking=False)
            t1 = time.time_ns()
            handle = tel.submit(direction, tokens_by_pool, num_bytes, page_size, io_backend=IO_BACKEND,
                                host_start_ns=t0, host_end_ns=t1, cause=cause, host_slots=host_slots,
                                requests=requests)
            self.pending.append(InFlight(handle, None, device_pages, host_pages))
        else:
            with tel.transfer(direction, tokens_by_pool, num_bytes, page_size, io_backend=IO_BACKEND, cause=cause,
                              host_slots=host_slots, requests=requests):
                copies(non_blocking=False)
            self.pending.append(InFlight(None, None, device_pages, host_pages))
        if request is not None:
            request.end()

        truth = self.truth[direction]
        truth.ops += 1
        for pool, tokens in tokens_by_pool.items():
            truth.tokens[pool] = truth.tokens.get(pool, 0) + tokens
        truth.blocks += -(-tokens_by_pool["kv"] // page_size)
        truth.bytes += num_bytes
        truth.bytes_by_cause[cause] = truth.bytes_by_cause.get(cause, 0) + num_bytes

    def _request(self, direction: str, index: int, cause: str) -> Any:
        """The span of the request op ``index`` serves (a new trace), or None: only for the causes
        of one request, and only with a tracer. A sampled one is a link the op's span must carry."""
        if self.tracer is None or cause not in REQUEST_CAUSES:
            return None
        span = self.tracer.start_span(REQUEST_SPAN, context=otel_context.Context(), attributes={"example.step": index})
        if span.get_span_context().trace_flags.sampled:
            self.truth[direction].request_links += 1
        return span

    def _host_slots(self, direction: str, host_pages: list[int], num_bytes: int) -> Any:
        """The op's host token slots for host residence, and its ground truth: an offload puts
        ``num_bytes`` over its pages (the remainder on the lowest pages, as otel-hicache does)
        and wastes what it overwrites unread; a load-back reloads what its pages hold."""
        if self.host_pool is None:
            return None
        truth = self.truth[direction]
        pages = sorted(host_pages)
        if direction == OFFLOAD:
            self.offloads_written += 1
            base, extra = divmod(num_bytes, len(pages))
            for k, page in enumerate(pages):
                old = self.page_state.get(page)
                if old is not None and old[1] == 0:
                    truth.host_bytes += old[0]
                self.page_state[page] = [base + (1 if k < extra else 0), 0, self.offloads_written]
        else:
            writers = set()
            for page in pages:
                state = self.page_state[page]
                truth.host_bytes += state[0]
                state[1] += 1
                writers.add(state[2])
            truth.residence_count += len(writers)  # one residence value per writing offload
        ps = self.cfg.page_size
        return self.host_pool, (torch.tensor(pages)[:, None] * ps + torch.arange(ps)).reshape(-1)

    def verify(self) -> tuple[int, list[str]]:
        """Check every page's tags in both tiers against the expected ones (after drain())."""
        checked = 0
        problems = []
        for pool in self.pools:
            tiers = (("L1", pool.device, pool.device_tags), ("L2", pool.host, pool.host_tags))
            for tier, tensor, expected in tiers:
                first, last = read_tags(tensor)
                for page, tag in enumerate(expected):
                    if tag is None:
                        continue
                    checked += 1
                    if first[page] != tag or last[page] != tag:
                        problems.append(
                            f"{pool.spec.name} {tier} page {page}: tag {first[page]}/{last[page]} != {tag}")
        return checked, problems


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------
def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = WorkloadConfig()
    parser = argparse.ArgumentParser(
        prog="hicache_workload.py",
        description="HiCache-shaped L1 (device) <-> L2 (host) KV-cache transfers on real tensors, "
        "reported as OpenTelemetry spans and metrics by otel-hicache.",
        epilog="With OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_TRACES_EXPORTER/OTEL_METRICS_EXPORTER) set, "
        "telemetry is exported per those variables; otherwise it stays in an in-memory SDK pipeline "
        "and is summarized here.",
    )
    parser.add_argument("--ops", type=_positive, default=defaults.ops, help="merged ops to run (default %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="RNG seed (default %(default)s)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where L1 lives: cuda if available with auto (default %(default)s)")
    parser.add_argument("--layers", type=_positive, default=defaults.layers,
                        help="layers of the kv pool (default %(default)s: Qwen3-0.6B)")
    parser.add_argument("--kv-heads", type=_positive, default=defaults.kv_heads, help="default %(default)s")
    parser.add_argument("--head-dim", type=_positive, default=defaults.head_dim, help="default %(default)s")
    parser.add_argument("--page-size", type=_positive, default=defaults.page_size,
                        help="tokens per page (default %(default)s)")
    parser.add_argument("--pool-tokens", type=_positive, default=defaults.pool_tokens,
                        help="device (L1) pool size in tokens; the host pool is --host-ratio times larger "
                        "(default %(default)s)")
    parser.add_argument("--host-ratio", type=_positive, default=defaults.host_ratio, help="default %(default)s")
    parser.add_argument("--max-op-pages", type=_positive, default=defaults.max_op_pages,
                        help="largest merged op in pages; sizes are uniform in [1, this] (default %(default)s)")
    parser.add_argument("--swa-window", type=_non_negative, default=defaults.swa_window,
                        help="sliding-window pool window in tokens, 0 for none (default %(default)s)")
    parser.add_argument("--draft-layers", type=_non_negative, default=defaults.draft_layers,
                        help="draft-model layers whose KV moves along (bytes only), 0 for none (default %(default)s)")
    parser.add_argument("--rate", type=_non_negative_float, default=defaults.rate, metavar="OPS_PER_S",
                        help="pace the ops at this many per second (default: unpaced), e.g. to watch the "
                        "series of a running collector")
    parser.add_argument("--cpu-threads", type=_positive, default=1,
                        help="torch threads for copies on CPU (default %(default)s, like one copy engine: "
                        "more is faster on an idle machine but far noisier when cores are shared)")
    parser.add_argument("--export", choices=("auto", "memory", "env"), default="auto",
                        help="memory: embedded in-memory SDK pipeline; env: otel_hicache.configure() from "
                        "OTEL_* variables; auto: env when an exporter or OTLP endpoint is set (default)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    parser.add_argument("--truth-json", metavar="PATH",
                        help="also write the workload's ground truth per direction (ops, tokens per pool, "
                        "blocks, bytes) as JSON, for checks downstream of a collector")
    args = parser.parse_args(argv)
    if args.pool_tokens < 2 * args.page_size:
        parser.error(f"--pool-tokens must hold at least 2 pages of --page-size {args.page_size}")
    if 2 * args.kv_heads * args.head_dim * 2 < 8:
        parser.error("a token must be at least 8 bytes per layer (tags)")
    return args


def _device(choice: str) -> Any:
    cuda = torch.cuda.is_available()
    if choice == "cuda" and not cuda:
        return None
    if choice == "cuda" or (choice == "auto" and cuda):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the example shows host residence, off by default in a server (docs/configuration.md)
    os.environ.setdefault(ev.OTEL_HICACHE_HOST_RESIDENCE, "true")
    if torch is None:
        print("hicache_workload.py needs torch: pip install torch (the CPU build is enough)", file=sys.stderr)
        return 2
    device = _device(args.device)
    if device is None:
        print("hicache_workload.py: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    cfg = WorkloadConfig(
        ops=args.ops, seed=args.seed, layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
        page_size=args.page_size, pool_tokens=args.pool_tokens, host_ratio=args.host_ratio,
        max_op_pages=min(args.max_op_pages, max(1, args.pool_tokens // args.page_size // 2)),
        swa_window=args.swa_window, draft_layers=args.draft_layers, rate=args.rate,
    )
    say = (lambda *a: None) if args.quiet else print
    use_env = args.export == "env" or (args.export == "auto" and export_requested())
    attributes = {"tp_rank": 0, "model": f"qwen3-like-{cfg.layers}L"}
    embedded = application = None
    if use_env:
        conf = otel_hicache.configure()
        tracer_provider = conf.tracer_provider
        if tracer_provider is None:  # the telemetry process exports ours: the application's own request spans
            application = build_providers(conf.resource)
            tracer_provider = application.tracer_provider
        tel = TransferTelemetry(attributes=attributes)
    else:
        embedded = EmbeddedPipeline()
        tracer_provider = embedded.tracer_provider
        tel = TransferTelemetry(tracer_provider=embedded.tracer_provider,
                                meter_provider=embedded.meter_provider, attributes=attributes)
    tracer = tracer_provider.get_tracer("hicache_workload")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(args.cpu_threads)
    try:
        return _run(cfg, device, tel, embedded, say, tracer, args.truth_json)
    finally:
        torch.set_num_threads(threads)
        tel.shutdown()
        if embedded is not None:
            embedded.shutdown()
        else:
            otel_hicache.shutdown()
        if application is not None:
            application.shutdown(5.0)


def _run(cfg: WorkloadConfig, device: Any, tel: TransferTelemetry, embedded: EmbeddedPipeline | None,
         say: Any, tracer: Any = None, truth_json: str | None = None) -> int:
    t_setup = time.perf_counter()
    workload = HiCacheWorkload(cfg, device)
    setup_s = time.perf_counter() - t_setup
    kv = workload.anchor.spec
    say(f"hicache_workload: HiCache L1 ({device}) <-> L2 (host{', pinned' if workload.cuda else ''}) "
        f"KV transfers, torch {torch.__version__}")
    say(f"  model shape: {kv.layers} layers x {kv.kv_heads} KV heads x head dim {kv.head_dim}, bf16 -> "
        f"{kv.bytes_per_token:,} B/token (K+V); pages of {cfg.page_size} tokens")
    for pool in workload.pools:
        extra = (f", window {pool.spec.window_tokens} tokens" if pool.spec.window_tokens else "")
        extra += "" if pool.spec.in_tokens else ", bytes only"
        layers = f"{pool.spec.layers} layer{'s' if pool.spec.layers > 1 else ''},"
        say(f"  pool {pool.spec.name:5s}: {layers:>10s} {pool.spec.bytes_per_token:,} B/token, "
            f"{cfg.device_pages} L1 / {cfg.host_pages} L2 pages{extra}")
    say(f"  {cfg.ops} merged ops of 1-{cfg.max_op_pages} pages (seed {cfg.seed}); "
        f"pools {workload.nbytes / 1e9:.2f} GB (set up in {setup_s:.2f} s); telemetry: "
        + ("OTEL_* exporters" if embedded is None else "embedded in-memory SDK pipeline"))
    t0 = time.perf_counter()
    truth = workload.run(tel, progress=lambda n: say(f"  ... {n} ops"), tracer=tracer)
    run_s = time.perf_counter() - t0
    checked, copy_problems = workload.verify()
    if truth_json:
        with open(truth_json, "w", encoding="utf-8") as out:
            json.dump({d: {"ops": t.ops, "tokens": t.tokens, "blocks": t.blocks, "bytes": t.bytes,
                           "bytes_by_cause": t.bytes_by_cause, "host_bytes": t.host_bytes,
                           "residence_count": t.residence_count, "request_links": t.request_links,
                           "model": f"qwen3-like-{cfg.layers}L"} for d, t in truth.items()}, out, indent=1)
    flushed = tel.force_flush(timeout_s=10.0 if embedded is not None else 5.0)
    gb = sum(t.bytes for t in truth.values()) / 1e9
    say(f"  ran {cfg.ops} ops, {gb:.2f} GB in {run_s:.2f} s; {workload.acked} acked through the ack queue")
    say("")
    exit_code = 0
    print(f"copies verified: {'yes' if not copy_problems else 'NO'} ({checked:,} page tags in L1 and L2)")
    for problem in copy_problems[:5]:
        print(f"  {problem}")
    if copy_problems:
        exit_code = 1
    if not tel.enabled:
        print("otel-hicache is disabled (OTEL_SDK_DISABLED / OTEL_HICACHE_ENABLED); workload ground truth:")
        print(format_table([truth[d] for d in DIRECTIONS], timing=False))
        return exit_code
    if embedded is None:
        endpoint = next((os.environ[v] for v in _OTLP_ENDPOINT_VARS if os.environ.get(v, "").strip()), None)
        where = (f"OTLP endpoint {endpoint}" if endpoint
                 else "the exporters named by OTEL_TRACES_EXPORTER/OTEL_METRICS_EXPORTER")
        if not flushed:
            where += " (flush did not complete: collector unreachable?)"
        print(f"spans and metrics went to {where}; workload ground truth:")
        print(format_table([truth[d] for d in DIRECTIONS], timing=False))
        return exit_code
    summary = summarize(embedded.metrics_data())
    exported = embedded.spans()
    spans = [span for span in exported if span.name not in (STEP_SPAN, REQUEST_SPAN)]
    linked, dangling = request_links(exported)
    by_name: dict[str, int] = {}
    for span in spans:
        by_name[span.name] = by_name.get(span.name, 0) + 1
    print("from the exported OTel metrics (p50/p99 interpolated in histogram buckets, GB/s = bytes / busy time):")
    print(format_table([summary.directions[d] for d in DIRECTIONS],
                       token_pools=list(dict.fromkeys(p for d in DIRECTIONS for p in truth[d].tokens))))
    print("bytes by cause (hicache.cause):")
    print(format_causes(summary.directions[d] for d in DIRECTIONS))
    print("host residence (hicache.host.*):")
    print(format_residence(summary.directions[OFFLOAD], summary.directions[ONBOARD]))
    print("links to requests (hicache.link_to=request):")
    print(format_request_links(linked, dangling))
    print(f"spans exported: {len(spans):,} ("
          + ", ".join(f"{name} {count:,}" for name, count in sorted(by_name.items())) + ")")
    problems = compare(summary, truth)
    if not os.environ.get("OTEL_TRACES_SAMPLER", "").strip():  # every span kept: every link is there
        if len(spans) != cfg.ops:
            problems.append(f"spans: exported {len(spans):,} != ops {cfg.ops:,}")
        for direction in DIRECTIONS:
            if linked[direction] != truth[direction].request_links:
                problems.append(f"{direction} spans linked to a request: {linked[direction]:,} != workload "
                                f"{truth[direction].request_links:,}")
    if dangling:
        problems.append(f"{dangling:,} links to requests point at no exported {REQUEST_SPAN} span")
    if not flushed:
        problems.append("force_flush did not complete")
    print(f"counters match ground truth: {'yes' if not problems else 'NO'}")
    for problem in problems:
        print(f"  {problem}")
    return 1 if problems else exit_code


if __name__ == "__main__":
    sys.exit(main())
