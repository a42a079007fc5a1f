"""A HiCache-shaped KV-cache workload on real torch tensors, reported by otel-hicache.

Merged ops copy KV pages between L1 (device) and L2 (host) pools shaped like Qwen3-0.6B's; without
an OTEL_* exporter an in-memory pipeline is checked against the workload's own totals."""

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Sequence

try:
    import otel_hicache
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import otel_hicache
import torch
from opentelemetry import context as otel_context
from opentelemetry.sdk.metrics import MeterProvider, export as metrics_export
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, export as trace_export
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_hicache import TransferTelemetry, environment_variables as ev, semconv as sc
from otel_hicache.record import DIRECTIONS, OFFLOAD, ONBOARD
from otel_hicache.sinks.providers import build as build_providers

STEP_SPAN = "example.scheduler_step"  # the scheduler step an op runs in
REQUEST_SPAN = "example.request"  # the root span of an op's request
REQUEST_CAUSES = frozenset(("write_through", "prefix_hit"))  # ops serving one request
TRANSFER_EVERY = 4  # every fourth op takes the other reporting path
PAGE_SIZE = 64  # tokens per page
KV_HEADS, HEAD_DIM, DTYPE_BYTES = 8, 128, 2  # Qwen3-0.6B's, in bf16
HOST_RATIO = 2  # L2 pages per L1 page
SWA_WINDOW = 256  # an op's tokens the sliding-window pool keeps
EXPORT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
               "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER")
TRUTH = ("ops", "tokens", "blocks", "bytes", "bytes_by_cause", "host_bytes", "residence_count", "request_links")


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float:
    """Prometheus' histogram_quantile: linear in rank q * count's bucket."""
    total = sum(counts)
    if total == 0:
        return math.nan
    rank, below = q * total, 0.0
    for b, upper in enumerate(bounds):
        if counts[b] and below + counts[b] >= rank:
            start = bounds[b - 1] if b else 0.0
            return start + (upper - start) * (rank - below) / counts[b]
        below += counts[b]
    return bounds[-1]


@dataclass
class DirectionSummary:
    """One direction's totals, exported or the workload's own."""

    direction: str
    ops: int = 0
    tokens: dict = field(default_factory=Counter)
    blocks: int = 0
    bytes: int = 0
    bytes_by_cause: dict = field(default_factory=Counter)
    host_bytes: int = 0  # offload: overwritten unread; onboard: read back
    residence_count: int = 0  # onboard: load-back x writing-offload pairs
    request_links: int = 0  # spans linked to the request they served
    busy_s: float = 0.0
    timing_sources: dict = field(default_factory=Counter)
    p50_s: float | None = None
    p99_s: float | None = None

    @property
    def bandwidth(self) -> float | None:  # per second busy (overlaps counted once)
        return self.bytes / self.busy_s if self.busy_s else None


@dataclass
class MetricsSummary:
    directions: dict[str, DirectionSummary]
    dropped: dict = field(default_factory=Counter)  # dropped or failed, by reason
    residence_s: tuple[float, float] | None = None  # p50, p99


def summarize(metrics_data) -> MetricsSummary:
    """Per-direction totals of the exported metrics, as a backend sees them."""
    summary = MetricsSummary({d: DirectionSummary(d) for d in DIRECTIONS})
    buckets = {}  # series key -> (bounds, summed counts)
    for resource_metrics in metrics_data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics if scope_metrics.scope.name == sc.SCOPE_NAME else ():
                for point in metric.data.data_points:
                    _add_point(summary, buckets, metric.name, point)
    for key, (bounds, counts) in buckets.items():
        quantiles = histogram_quantile(0.50, bounds, counts), histogram_quantile(0.99, bounds, counts)
        if key == "residence":
            summary.residence_s = quantiles
        else:
            summary.directions[key].p50_s, summary.directions[key].p99_s = quantiles
    return summary


def _add_point(summary, buckets, name, point):
    attrs = point.attributes or {}
    n = int(point.value if hasattr(point, "value") else point.count)  # a sum's value, a histogram's count
    row = summary.directions.get(attrs.get(sc.DIRECTION))
    if name in (sc.RECORDS_DROPPED[0], sc.RECORDS_FAILED[0]):
        summary.dropped[str(attrs.get(sc.REASON))] += n
    elif name in (sc.HOST_WASTED_BYTES[0], sc.HOST_RELOADED_BYTES[0]):
        summary.directions[OFFLOAD if name == sc.HOST_WASTED_BYTES[0] else ONBOARD].host_bytes += n
    elif name == sc.HOST_RESIDENCE_TIME[0]:
        summary.directions[ONBOARD].residence_count += n
        _add_buckets(buckets, "residence", point)
    elif row is None:
        return
    elif name == sc.TRANSFER_DURATION[0]:
        row.ops += n
        if n:
            row.timing_sources[str(attrs.get(sc.TIMING_SOURCE))] += n
        _add_buckets(buckets, row.direction, point)
    elif name == sc.TRANSFER_TOKENS[0]:
        row.tokens[str(attrs.get(sc.POOL))] += n
    elif name == sc.TRANSFER_BLOCKS[0]:
        row.blocks += n
    elif name == sc.TRANSFER_BYTES[0] and n:
        row.bytes += n
        row.bytes_by_cause[str(attrs.get(sc.CAUSE))] += n
    elif name == sc.TRANSFER_BUSY_TIME[0]:
        row.busy_s += float(point.value)


def _add_buckets(buckets, key, point):
    _, counts = buckets.setdefault(key, (tuple(point.explicit_bounds), [0.0] * len(point.bucket_counts)))
    for i, count in enumerate(point.bucket_counts):
        counts[i] += count


def compare(summary, truth):
    """How the exported counters differ from the ground truth."""
    def value(row, attr):
        got = getattr(row, attr)
        return {k: v for k, v in got.items() if v} if isinstance(got, dict) else got

    problems = [f"{d} {attr.replace('_', ' ').replace('tokens', 'tokens by pool')}: metrics {got} != workload {want}"
                for d in DIRECTIONS for attr in TRUTH[:-1]  # request links: from the spans
                if (got := value(summary.directions[d], attr)) != (want := value(truth[d], attr))]
    return problems + [f"{n:,} records dropped/failed ({reason})" for reason, n in sorted(summary.dropped.items()) if n]


def request_links(spans):
    """Spans linked to a request per direction, and dangling links."""
    requests = {(s.context.trace_id, s.context.span_id) for s in spans if s.name == REQUEST_SPAN}
    linked, dangling = dict.fromkeys(DIRECTIONS, 0), 0
    for span in spans:
        to = [link.context for link in span.links if (link.attributes or {}).get(sc.LINK_TO) == sc.LINK_TO_REQUEST]
        if to:
            linked[str(span.attributes.get(sc.DIRECTION))] += 1
            dangling += sum((c.trace_id, c.span_id) not in requests for c in to)
    return linked, dangling


def _ms(seconds):
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.3f}"


def format_table(rows, timing=True):
    """One fixed-width row per direction."""
    pools = list(dict.fromkeys(["kv", *(pool for row in rows for pool in row.tokens)]))
    lines = [["direction", "ops", *(f"tokens {p}" for p in pools), "blocks", "GB"]
             + (["p50 ms", "p99 ms", "busy ms", "GB/s", "timing"] if timing else [])]
    for row in rows:
        lines.append([row.direction, f"{row.ops:,}", *(f"{row.tokens.get(p, 0):,}" for p in pools),
                      f"{row.blocks:,}", f"{row.bytes / 1e9:.3f}"])
        if timing:
            lines[-1] += [_ms(row.p50_s), _ms(row.p99_s), f"{row.busy_s * 1e3:.1f}",
                          f"{row.bandwidth / 1e9:.2f}" if row.bandwidth else "-", "/".join(row.timing_sources) or "-"]
    widths = [max(len(cell) for cell in column) for column in zip(*lines)]
    left = {0, len(widths) - 1} if timing else {0}  # direction and timing
    return "\n".join("  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in lines)


def check_exported(embedded, truth, ops, flushed):
    """Print what the pipeline received; returns how it differs from the truth."""
    summary = summarize(embedded.metric_reader.get_metrics_data())
    exported = embedded.span_exporter.get_finished_spans()
    spans = [span for span in exported if span.name not in (STEP_SPAN, REQUEST_SPAN)]
    linked, dangling = request_links(exported)
    offload, onboard = rows = [summary.directions[d] for d in DIRECTIONS]
    print("from the exported OTel metrics (p50/p99 interpolated in histogram buckets, GB/s = bytes / busy time):")
    print(format_table(rows))
    print("bytes by cause (hicache.cause):")
    for row in rows:
        causes = ", ".join(f"{c} {n / 1e9:.3f} GB ({n / row.bytes:.0%})" for c, n in row.bytes_by_cause.most_common())
        print(f"  {row.direction}: {causes or '-'}")
    p50, p99 = summary.residence_s or (None, None)
    print("host residence (hicache.host.*):")
    print(f"  {onboard.residence_count:,} load-back x writing-offload pairs, residence p50 {_ms(p50)} ms, p99 "
          f"{_ms(p99)} ms; reloaded {onboard.host_bytes / 1e9:.3f} GB, wasted (overwritten before any load-back) "
          f"{offload.host_bytes / 1e9:.3f} GB")
    print("links to requests (hicache.link_to=request):")
    print(f"  {linked[OFFLOAD]:,} offload and {linked[ONBOARD]:,} load-back spans link to the request they served; "
          f"every link to an exported {REQUEST_SPAN} span: {'yes' if not dangling else f'NO ({dangling:,} not)'}")
    names = sorted(Counter(span.name for span in spans).items())
    print(f"spans exported: {len(spans):,} (" + ", ".join(f"{name} {n:,}" for name, n in names) + ")")
    problems = compare(summary, truth)
    if not os.environ.get("OTEL_TRACES_SAMPLER", "").strip():  # every span kept
        if len(spans) != ops:
            problems.append(f"spans: exported {len(spans):,} != ops {ops:,}")
        problems += [f"{d} spans linked to a request: {linked[d]:,} != workload {truth[d].request_links:,}"
                     for d in DIRECTIONS if linked[d] != truth[d].request_links]
    if dangling:
        problems.append(f"{dangling:,} links to requests point at no exported {REQUEST_SPAN} span")
    return problems + ([] if flushed else ["force_flush did not complete"])


def export_requested(environ=os.environ):
    """Whether OTEL_* names an OTLP endpoint or an exporter."""
    return any(environ.get(name, "").strip() for name in EXPORT_VARS)


class EmbeddedPipeline:
    """In-memory SDK providers: no collector needed."""

    def __init__(self):
        resource = Resource.create()
        if str(resource.attributes.get("service.name")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "otel-hicache-demo"}))
        self.span_exporter, self.metric_reader = InMemorySpanExporter(), metrics_export.InMemoryMetricReader()
        self.tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(trace_export.SimpleSpanProcessor(self.span_exporter))
        self.meter_provider = MeterProvider([self.metric_reader], resource=resource, shutdown_on_exit=False)

    def shutdown(self):
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@dataclass
class WorkloadConfig:
    ops: int = 200
    seed: int = 0
    layers: int = 28  # of the kv pool: Qwen3-0.6B's
    pool_tokens: int = 2048  # L1's; L2 holds HOST_RATIO times more
    max_op_pages: int = 12  # op sizes are uniform in [1, this]
    rate: float = 0.0  # ops per second; 0: unpaced

    def __post_init__(self):
        self.device_pages = self.pool_tokens // PAGE_SIZE
        self.host_pages = self.device_pages * HOST_RATIO
        self.max_op_pages = min(self.max_op_pages, self.device_pages // 2)


class Pool:
    """One KV pool in both tiers, and each page's expected tag."""

    def __init__(self, name, layers, cfg, device, window_tokens=0):
        self.name, self.in_tokens = name, name != "draft"  # draft KV: in bytes only
        shape = (PAGE_SIZE, 2 * layers * KV_HEADS * HEAD_DIM * DTYPE_BYTES)  # K and V per token
        self.page_bytes, self.window_pages = shape[0] * shape[1], -(-window_tokens // PAGE_SIZE)
        # real data: copies from untouched memory would flatter the CPU
        self.device = torch.full((cfg.device_pages, *shape), 0x5A, dtype=torch.uint8, device=device)
        # zeroed: no first-touch page fault in a timed copy
        self.host = torch.zeros((cfg.host_pages, *shape), dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device_tags = [None] * cfg.device_pages
        self.host_tags = [None] * cfg.host_pages

    def kept(self, pages):  # a sliding window moves an op's last pages
        return pages[-self.window_pages:] if self.window_pages else pages


def read_tags(tensor):
    first = tensor[:, 0, :8].contiguous().view(torch.int64).view(-1).tolist()
    return list(zip(first, tensor[:, -1, -8:].contiguous().view(torch.int64).view(-1).tolist()))


def copy_pages(dst, dst_pages, src, src_pages, non_blocking):
    """One copy_ per run of consecutive pages, like SGLang's direct backend."""
    pairs = sorted(zip(src_pages, dst_pages))
    moved = i = 0
    while i < len(pairs):
        (s, d), n = pairs[i], 1
        while i + n < len(pairs) and pairs[i + n] == (s + n, d + n):
            n += 1
        dst[d:d + n].copy_(src[s:s + n], non_blocking=non_blocking)
        moved += dst[d:d + n].nbytes
        i += n
    return moved


def _cause(direction, index):
    """Op index's hicache.cause, mixed as a server's might be."""
    if direction == OFFLOAD:
        return "write_back" if index % 5 == 0 else "write_through"
    return "storage_prefetch" if index % 7 == 0 else "prefix_hit"


class HiCacheWorkload:
    """A cache controller's merged ops between the tiers, and their ground truth."""

    def __init__(self, cfg, device):
        self.cfg, self.device, self.cuda = cfg, device, device.type == "cuda"
        self.rng = random.Random(cfg.seed)
        swa = Pool("swa", max(1, cfg.layers // 4), cfg, device, SWA_WINDOW)
        self.pools = [Pool("kv", cfg.layers, cfg, device), swa, Pool("draft", 1, cfg, device)]
        self.host_free = deque(range(cfg.host_pages))
        self.host_valid = {}  # L2 pages holding data, LRU first
        self.pending = deque()  # the ack queue: (handle, copies' end event)
        self.next_tag, self.acked, self.offloads = 1, 0, 0
        self.truth = {d: DirectionSummary(d) for d in DIRECTIONS}
        self.page_state = {}  # L2 page -> [bytes written, reads, writing offload]
        self.tracer = self.host_pool = None
        if self.cuda:
            self.streams = {d: torch.cuda.Stream(device=device) for d in DIRECTIONS}
        for pool in self.pools:  # a forward pass filled L1
            self._stamp(pool, range(cfg.device_pages))

    def _stamp(self, pool, pages):
        """Tag L1 pages' first and last 8 bytes, as a forward pass writes KV."""
        tags = list(range(self.next_tag, self.next_tag + len(pages)))
        self.next_tag += len(pages)
        index = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        values = torch.tensor(tags, dtype=torch.int64).view(torch.uint8).view(len(tags), 8).to(self.device)
        pool.device[index, 0, :8] = pool.device[index, -1, -8:] = values
        for page, tag in zip(pages, tags):
            pool.device_tags[page] = tag

    def poll(self, tel, wait=False):
        """Ack the ops whose copies completed (with wait, all)."""
        while self.pending and (wait or self.pending[0][1] is None or self.pending[0][1].query()):
            handle, done = self.pending.popleft()
            if done is not None:
                done.synchronize()
            if handle is not None:
                tel.ack(handle)
                self.acked += 1

    def _alloc_host(self, n):
        """Free L2 pages first, then the least recently used."""
        pages = [self.host_free.popleft() for _ in range(min(n, len(self.host_free)))]
        for page in list(self.host_valid)[:n - len(pages)]:
            del self.host_valid[page]
            pages.append(page)
        return pages

    def run(self, tel, tracer=None):
        """Every op, under a step span with a tracer; returns the ground truth."""
        started = time.monotonic()
        self.tracer = tracer
        self.host_pool = tel.host_pool(self.cfg.host_pages * PAGE_SIZE, PAGE_SIZE)
        for i in range(self.cfg.ops):
            if self.cfg.rate > 0:  # a serving process is never flat out
                time.sleep(max(0.0, started + i / self.cfg.rate - time.monotonic()))
            step = tracer.start_as_current_span(STEP_SPAN, attributes={"example.step": i}) if tracer else None
            with step or contextlib.nullcontext():
                self.poll(tel)
                self._step(tel, i)
        self.poll(tel, wait=True)
        return self.truth

    def _step(self, tel, i):
        """One merged op: new pages to L2, or a prefix hit's back to L1."""
        n = self.rng.randint(1, self.cfg.max_op_pages)
        if self.rng.random() < 0.5 or not self.host_valid:
            direction, device_pages = OFFLOAD, self.rng.sample(range(self.cfg.device_pages), n)
            host_pages = self._alloc_host(n)
            for pool in self.pools:  # a forward pass just wrote these
                self._stamp(pool, device_pages)
        else:
            direction, host_pages = ONBOARD, self.rng.sample(list(self.host_valid), min(n, len(self.host_valid)))
            device_pages = self.rng.sample(range(self.cfg.device_pages), len(host_pages))
        self._transfer(tel, i, direction, device_pages, host_pages)
        for page in host_pages:  # now the most recently used
            self.host_valid.pop(page, None)
            self.host_valid[page] = None

    def _transfer(self, tel, index, direction, device_pages, host_pages):
        plan = [(pool, pool.kept(device_pages), pool.kept(host_pages)) for pool in self.pools]
        tokens = {pool.name: len(dev) * PAGE_SIZE for pool, dev, _ in plan if pool.in_tokens}
        num_bytes = sum(len(dev) * pool.page_bytes for pool, dev, _ in plan)
        cause = _cause(direction, index)
        request = self._request(direction, index, cause)
        report = dict(tokens_by_pool=tokens, num_bytes=num_bytes, page_size=PAGE_SIZE, io_backend="direct",
                      cause=cause, host_slots=self._host_slots(direction, host_pages, num_bytes),
                      requests=None if request is None else [request.get_span_context()])
        if self.cuda:
            self.pending.append(self._on_stream(tel, direction, plan, report))
        elif index % TRANSFER_EVERY == TRANSFER_EVERY - 1:  # submit now, ack from the queue
            start = time.time_ns()
            self._copy(plan, direction, non_blocking=False)
            self.pending.append((tel.submit(direction, host_start_ns=start, host_end_ns=time.time_ns(), **report),
                                 None))
        else:
            with tel.transfer(direction, **report):
                self._copy(plan, direction, non_blocking=False)
        if request is not None:
            request.end()
        truth = self.truth[direction]
        truth.ops += 1
        truth.tokens.update(tokens)
        truth.blocks += -(-tokens["kv"] // PAGE_SIZE)
        truth.bytes += num_bytes
        truth.bytes_by_cause[cause] += num_bytes

    def _on_stream(self, tel, direction, plan, report):
        """Copies on the direction's stream, timed by events."""
        stream, compute = self.streams[direction], torch.cuda.current_stream(self.device)
        # both ways: no op touches a page another still moves
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self._copy(plan, direction, non_blocking=True)
            done.record(stream)
        compute.wait_stream(stream)
        return tel.submit(direction, start_event=start, finish_event=done, **report), done

    @staticmethod
    def _copy(plan, direction, non_blocking):
        for pool, dev, host in plan:
            tiers = [(pool.device, pool.device_tags, dev), (pool.host, pool.host_tags, host)]
            (src, src_tags, src_pages), (dst, dst_tags, dst_pages) = tiers if direction == OFFLOAD else tiers[::-1]
            copy_pages(dst, dst_pages, src, src_pages, non_blocking)
            for s, d in zip(src_pages, dst_pages):
                dst_tags[d] = src_tags[s]

    def _request(self, direction, index, cause):
        """The span of the request the op serves (a trace's root), or None."""
        if self.tracer is None or cause not in REQUEST_CAUSES:
            return None
        span = self.tracer.start_span(REQUEST_SPAN, context=otel_context.Context(), attributes={"example.step": index})
        self.truth[direction].request_links += span.get_span_context().trace_flags.sampled
        return span

    def _host_slots(self, direction, host_pages, num_bytes):
        """The op's L2 slots for host residence, and their truth."""
        if self.host_pool is None:  # host residence or otel-hicache off
            return None
        truth, pages = self.truth[direction], sorted(host_pages)
        if direction == OFFLOAD:
            self.offloads += 1
            base, extra = divmod(num_bytes, len(pages))
            for k, page in enumerate(pages):
                written, reads, _ = self.page_state.get(page, (0, 0, 0))
                truth.host_bytes += 0 if reads else written  # overwritten unread
                self.page_state[page] = [base + (k < extra), 0, self.offloads]
        else:
            for page in pages:
                truth.host_bytes += self.page_state[page][0]
                self.page_state[page][1] += 1
            truth.residence_count += len({self.page_state[page][2] for page in pages})
        return self.host_pool, (torch.tensor(pages)[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(-1)

    def verify(self):
        """Check every page's tags in both tiers."""
        checked, problems = 0, []
        for pool in self.pools:
            for tier, tensor, expected in (("L1", pool.device, pool.device_tags), ("L2", pool.host, pool.host_tags)):
                for page, (tags, tag) in enumerate(zip(read_tags(tensor.cpu()), expected)):
                    checked += tag is not None
                    if tag is not None and tags != (tag, tag):
                        problems.append(f"{pool.name} {tier} page {page}: tags {tags} != {tag}")
        return checked, problems


def parse_args(argv):
    defaults = WorkloadConfig()
    parser = argparse.ArgumentParser(prog="hicache_workload.py", description=__doc__.split("\n\n")[0],
                                     epilog="With OTEL_EXPORTER_OTLP_ENDPOINT set, telemetry is exported there.")
    for flag, kind, default, what in (("--ops", int, defaults.ops, "merged ops"), ("--seed", int, 0, "RNG seed"),
                                      ("--layers", int, defaults.layers, "layers of the kv pool"),
                                      ("--pool-tokens", int, defaults.pool_tokens, "L1 tokens (L2: twice)"),
                                      ("--rate", float, 0.0, "ops per second (0: unpaced)")):
        parser.add_argument(flag, type=kind, default=default, help=f"{what} (default %(default)s)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where L1 lives")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    parser.add_argument("--truth-json", metavar="PATH", help="also write the workload's ground truth there")
    args = parser.parse_args(argv)
    if min(args.ops, args.layers, args.pool_tokens // PAGE_SIZE // 2) < 1:
        parser.error(f"--ops and --layers must be >= 1, --pool-tokens >= {2 * PAGE_SIZE}")
    return args


def telemetry(attributes):
    """otel-hicache (OTEL_* or embedded), a tracer, the pipeline, closers."""
    if not export_requested():
        embedded = EmbeddedPipeline()
        tel = TransferTelemetry(tracer_provider=embedded.tracer_provider, meter_provider=embedded.meter_provider,
                                attributes=attributes)
        return tel, embedded.tracer_provider.get_tracer(__name__), embedded, [tel.shutdown, embedded.shutdown]
    conf = otel_hicache.configure()
    tel = TransferTelemetry(attributes=attributes)
    closing, tracer_provider = [tel.shutdown, otel_hicache.shutdown], conf.tracer_provider
    if tracer_provider is None:  # a telemetry process exports otel-hicache's spans
        application = build_providers(conf.resource)
        tracer_provider = application.tracer_provider
        closing.append(lambda: application.shutdown(5.0))
    return tel, tracer_provider.get_tracer(__name__), None, closing


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault(ev.OTEL_HICACHE_HOST_RESIDENCE, "true")  # off by default in a server
    if args.device == "cuda" and not torch.cuda.is_available():
        print("hicache_workload.py: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = WorkloadConfig(args.ops, args.seed, args.layers, args.pool_tokens, rate=args.rate)
    tel, tracer, embedded, closing = telemetry({"tp_rank": 0, "model": f"qwen3-like-{cfg.layers}L"})
    threads = torch.get_num_threads()
    if not cuda:  # one thread, like one copy engine: less noise
        torch.set_num_threads(1)
    try:
        return run(cfg, device, tel, tracer, embedded, args)
    finally:
        torch.set_num_threads(threads)
        for close in closing:
            close()


def run(cfg, device, tel, tracer, embedded, args):
    workload, started = HiCacheWorkload(cfg, device), time.perf_counter()
    truth = workload.run(tel, tracer=tracer)
    if not args.quiet:
        print(f"hicache_workload: {cfg.ops} ops, L1 {device} <-> L2 host, "
              f"{sum(t.bytes for t in truth.values()) / 1e9:.2f} GB in {time.perf_counter() - started:.2f} s, "
              f"{workload.acked} acked; torch {torch.__version__}")
    checked, copy_problems = workload.verify()
    if args.truth_json:
        with open(args.truth_json, "w", encoding="utf-8") as out:
            json.dump({d: {k: getattr(t, k) for k in TRUTH} for d, t in truth.items()}, out, indent=1)
    flushed = tel.force_flush(timeout_s=10.0 if embedded is not None else 5.0)
    print(f"copies verified: {'yes' if not copy_problems else 'NO'} ({checked:,} page tags in L1 and L2)")
    for problem in copy_problems[:5]:
        print(f"  {problem}")
    if embedded is None or not tel.enabled:
        where = ", ".join(f"{v}={os.environ[v]}" for v in EXPORT_VARS if os.environ.get(v, "").strip())
        print(("otel-hicache is disabled (OTEL_SDK_DISABLED / OTEL_HICACHE_ENABLED)" if not tel.enabled else
               f"spans and metrics went to {where}" + ("" if flushed else " (flush incomplete: collector down?)"))
              + "; workload ground truth:")
        print(format_table([truth[d] for d in DIRECTIONS], timing=False))
        return 1 if copy_problems else 0
    problems = check_exported(embedded, truth, cfg.ops, flushed)
    print(f"counters match ground truth: {'yes' if not problems else 'NO'}")
    for problem in problems:
        print(f"  {problem}")
    return 1 if problems or copy_problems else 0


if __name__ == "__main__":
    sys.exit(main())
