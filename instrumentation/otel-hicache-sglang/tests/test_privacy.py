"""Privacy: no token ids, prompt text, request ids, node ids or hashes leave the process.

One realistic run of the real SGLang 0.5.23 HiCache objects on CPU (``sglang_cpu``):
write-through with load-back, write-back eviction with load-back, decode retraction of
a real ``schedule_batch.Req``, dropped tokens, host eviction, prefix hits per tier and
an engine-level controller round trip, on the Python TreeCore and on SGLang's default
(Rust) TreeCore. The sensitive values are made distinctive so that a scan cannot
mistake a legitimate count for them:

* token ids: 7-digit ids in ``TOKEN_IDS`` (4,817,000 to 4,817,999); the counts this
  run produces are in the thousands at most;
* the request: ``rid`` and ``origin_input_text`` of a real ``Req``, also put on the
  request span that is current when the ops are submitted and in its baggage;
* node ids: the Python TreeCore's node counter and the ``CacheOperation`` counter
  start at 6,290,000 and 7,350,000, and the engine-level ops carry node ids from the
  same range on their ``HiCacheAck``;
* hashes: SGLang's own page hashes (``get_storage_hash_str``) of every inserted token
  sequence, and the ``hash_value`` of every node of the live Python trees (filled by
  ``backfill_missing_hash_values``, as SGLang does when a storage backend attaches),
  as hex strings, 16-hex-digit prefixes, SGLang's int64 form and raw digests.

Everything otel-hicache exports is captured as it leaves: the real OTLP/HTTP exporters
built by ``otel_hicache.configure()`` from ``OTEL_*`` (the adapter's production path)
send to ``otlp_receiver.HttpReceiver``, which keeps each request body as received; plus
every record of the ``otel_hicache`` logger at every level. otel-hicache exports no OTel log records (it builds no ``LoggerProvider``).

Scans: (a) no sensitive value in the raw bodies, in any string, integer or double of
the decoded requests (resource, scope, spans, events, links, status, metric points,
exemplars), or in any log record; (b) every attribute key is documented
(``docs/reference.md``, ``docs/sglang.md``) and none names an identifier. The last
tests inject leaks through the public API and check that the same scans catch them.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import math
import os
import re
import struct
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pytest
from google.protobuf.descriptor import FieldDescriptor
from opentelemetry import baggage, context
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator

import otel_hicache
from otel_hicache import semconv as sc
from otlp_receiver import HttpReceiver

DOCS = Path(__file__).resolve().parents[3] / "docs"

TOKEN_IDS = range(4_817_000, 4_818_000)
NODE_IDS = range(6_290_000, 6_300_000)
OP_IDS = range(7_350_000, 7_360_000)
ENGINE_NODE_IDS = (6_299_101, 6_299_102)  # node_id of the engine-level write and load
RID = "PRIVATE-RID-5d1f0c2e"
PROMPT = "PRIVATE-PROMPT-93b7: summarize the merger memo for account 118-2234"
RESOURCE = {"deployment.environment": "ci"}
SDK_RESOURCE_KEYS = {"telemetry.sdk.language", "telemetry.sdk.name", "telemetry.sdk.version"}

#: Words no attribute key may contain (split at ``.``, ``_`` and ``-``).
IDENTIFIER_WORDS = {
    "id", "ids", "uid", "uuid", "rid", "rids", "req", "request", "requests", "prompt", "prompts",
    "text", "texts", "input", "inputs", "output", "outputs", "node", "nodes", "hash", "hashes",
    "digest", "key", "keys", "session", "user", "content", "message", "messages",
}

#: Keys that name a request but carry no identity of it: a traced request's trace id (the
#: only thing of a request that may leave the process, docs/reference.md "Links to
#: requests") and a count. Their values are checked by scan_names().
TRACE_LINKAGE_KEYS = {sc.REQUEST_TRACE_ID, sc.REQUEST_LINKS_DROPPED}

_DIGITS = re.compile(r"(?<![0-9])[0-9]+(?![0-9])")
_RAW_DIGITS = re.compile(rb"(?<![0-9])[0-9]+(?![0-9])")
_STANDARD_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


# --------------------------------------------------------------------------
# what is forbidden
# --------------------------------------------------------------------------
@dataclass
class Secrets:
    """The sensitive values of a run, in every form a scan looks for."""

    token_ids: set[int] = field(default_factory=set)
    node_ids: set[int] = field(default_factory=set)
    op_ids: set[int] = field(default_factory=set)
    hashes: set[str] = field(default_factory=set)  # SHA-256 hex digests
    texts: set[str] = field(default_factory=lambda: {RID, PROMPT})
    token_sequences: list[list[int]] = field(default_factory=list)

    def add_hashes(self, values: Iterable[str]) -> None:
        self.hashes.update(v for v in values if v)

    def strings(self) -> set[str]:
        """Substrings that must appear nowhere (case-sensitive forms listed explicitly)."""
        out = set(self.texts) | {"PRIVATE-"}
        for h in self.hashes:
            out |= {h.lower(), h.upper(), h[:16].lower(), h[:16].upper()}
        return out

    def ints(self) -> set[int]:
        """Exact integers (besides the ranges): hashes as int64 (SGLang's
        ``hash_str_to_int64``) and unsigned, and every id of the run."""
        out = set(self.token_ids) | self.node_ids | self.op_ids
        for h in self.hashes:
            unsigned = int(h[:16], 16)
            signed = unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned
            out |= {unsigned, signed, abs(signed)}
        return out

    def raw_patterns(self) -> dict[bytes, str]:
        """Binary forms: raw digests and packed token ids (int64/int32, two in a row)."""
        out = {bytes.fromhex(h): "hash (raw digest)" for h in self.hashes}
        for tokens in self.token_sequences:
            for a, b in zip(tokens, tokens[1:]):
                out[struct.pack("<qq", a, b)] = "token ids (packed int64)"
                out[struct.pack("<ii", a, b)] = "token ids (packed int32)"
        return out

    def matcher(self) -> "Matcher":
        return Matcher(self)


class Matcher:
    """The forms of :class:`Secrets`, computed once for a scan."""

    def __init__(self, secrets: Secrets) -> None:
        self.secrets = secrets
        self.strings = secrets.strings()
        self.encoded = {s.encode() for s in self.strings}
        self.ints = secrets.ints()
        self.patterns = secrets.raw_patterns()

    def int_kind(self, value: int) -> str | None:
        """What a forbidden integer is; None for any other value (counts, sizes, times)."""
        s = self.secrets
        if value in TOKEN_IDS or value in s.token_ids:
            return "token id"
        if value in NODE_IDS or value in s.node_ids:
            return "node id"
        if value in OP_IDS or value in s.op_ids:
            return "cache op id"
        if value in self.ints:
            return "hash (int form)"
        return None

    def text(self, where: str, text: str) -> list[str]:
        found = [f"{where}: contains {s!r}" for s in self.strings if s in text]
        for match in _DIGITS.finditer(text):
            kind = self.int_kind(int(match.group()))
            if kind:
                found.append(f"{where}: {kind} {match.group()} in {text[:200]!r}")
        return found


# --------------------------------------------------------------------------
# capturing what is exported
# --------------------------------------------------------------------------
class OtlpCapture:
    """``otlp_receiver.HttpReceiver`` that also keeps every request body as received."""

    def __init__(self) -> None:
        self.receiver = HttpReceiver()
        self.endpoint = self.receiver.endpoint
        self.bodies: list[tuple[str, bytes]] = []
        bodies, lock = self.bodies, self.receiver.received.lock
        base = self.receiver.server.RequestHandlerClass

        class Tap(base):  # type: ignore[misc, valid-type]
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                plain = gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body
                with lock:
                    bodies.append((self.path, plain))
                self.rfile = io.BytesIO(body)  # the receiver decodes the same bytes
                super().do_POST()

        self.receiver.server.RequestHandlerClass = Tap  # before any request: nothing was exported yet

    @property
    def traces(self) -> list[Any]:
        return list(self.receiver.received.traces)

    @property
    def metrics(self) -> list[Any]:
        return list(self.receiver.received.metrics)

    def stop(self) -> None:
        self.receiver.stop()


class LogCapture(logging.Handler):
    """Every record of the given loggers, at every level (level 5 and DEBUG included)."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__(level=1)
        self.records: list[logging.LogRecord] = []
        self._loggers = [logging.getLogger(n) for n in names]
        self._levels: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "LogCapture":
        for logger in self._loggers:
            self._levels.append(logger.level)
            logger.setLevel(1)
            logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for logger, level in zip(self._loggers, self._levels):
            logger.removeHandler(self)
            logger.setLevel(level)


@dataclass
class Exported:
    bodies: list[tuple[str, bytes]]
    traces: list[Any]
    metrics: list[Any]
    logs: list[logging.LogRecord]


def _capture_of(capture: OtlpCapture, logs: LogCapture) -> Exported:
    exported = Exported(list(capture.bodies), capture.traces, capture.metrics, list(logs.records))
    # the bodies and the decoded requests are the same requests
    assert len(exported.bodies) == len(exported.traces) + len(exported.metrics)
    for path, body in exported.bodies:
        cls = (trace_service_pb2.ExportTraceServiceRequest if path == "/v1/traces"
               else metrics_service_pb2.ExportMetricsServiceRequest)
        cls().ParseFromString(body)  # a body that is not OTLP would raise
    return exported


# --------------------------------------------------------------------------
# scanning
# --------------------------------------------------------------------------
_INT_TYPES = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
              FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
              FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED32,
              FieldDescriptor.TYPE_SFIXED64}
_FLOAT_TYPES = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT}

#: Messages that carry attributes, and the allow-list each is checked against.
ATTRIBUTE_OWNERS = {
    "Resource": "resource", "InstrumentationScope": "scope", "Span": "span", "Event": "event",
    "Link": "link", "NumberDataPoint": "point", "HistogramDataPoint": "point",
    "ExponentialHistogramDataPoint": "point", "SummaryDataPoint": "point", "Exemplar": "exemplar",
}


def _fields(message: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """Every (path, field descriptor, scalar value) below ``message``, depth first."""
    for descriptor, value in message.ListFields():
        repeated = descriptor.is_repeated
        items = enumerate(value) if repeated else [(None, value)]
        for index, item in items:
            where = f"{path}.{descriptor.name}" + (f"[{index}]" if index is not None else "")
            if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
                if descriptor.message_type.name == "KeyValue":
                    where = f"{path}.{descriptor.name}[{item.key!r}]"
                yield from _fields(item, where)
            else:
                yield where, descriptor, item


def _messages(message: Any, path: str) -> Iterator[tuple[str, Any]]:
    yield path, message
    for descriptor, value in message.ListFields():
        if descriptor.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        items = enumerate(value) if descriptor.is_repeated else [(None, value)]
        for index, item in items:
            yield from _messages(item, f"{path}.{descriptor.name}" + (f"[{index}]" if index is not None else ""))


def scan_values(exported: Exported, secrets: Secrets) -> tuple[list[str], dict[str, int]]:
    """Every sensitive value found in what was exported, and what was scanned."""
    findings: list[str] = []
    stats = {"requests": len(exported.bodies), "raw_bytes": 0, "strings": 0, "ints": 0, "doubles": 0,
             "log_records": 0}
    counted = {"Span": "spans", "Event": "span_events", "Link": "links", "NumberDataPoint": "points",
               "HistogramDataPoint": "points", "ExponentialHistogramDataPoint": "points", "Exemplar": "exemplars",
               "KeyValue": "attributes"}
    match_ = secrets.matcher()
    for index, (path, body) in enumerate(exported.bodies):
        where = f"raw body {index} ({path})"
        stats["raw_bytes"] += len(body)
        findings += [f"{where}: contains {s!r}" for s in match_.encoded if s in body]
        findings += [f"{where}: {kind}" for p, kind in match_.patterns.items() if p in body]
        for match in _RAW_DIGITS.finditer(body):
            kind = match_.int_kind(int(match.group()))
            if kind:
                findings.append(f"{where}: {kind} {match.group().decode()} as text")
    requests = [("traces", r) for r in exported.traces] + [("metrics", r) for r in exported.metrics]
    for index, (signal, request) in enumerate(requests):
        for _, message in _messages(request, ""):
            name = counted.get(message.DESCRIPTOR.name)
            if name:
                stats[name] = stats.get(name, 0) + 1
        for where, descriptor, value in _fields(request, f"{signal}[{index}]"):
            if descriptor.type == FieldDescriptor.TYPE_STRING:
                stats["strings"] += 1
                findings += match_.text(where, value)
            elif descriptor.type in _INT_TYPES:
                if descriptor.name.endswith("time_unix_nano"):
                    continue  # timestamps
                stats["ints"] += 1
                kind = match_.int_kind(value)
                if kind:
                    findings.append(f"{where} = {value}: {kind}")
            elif descriptor.type in _FLOAT_TYPES:
                stats["doubles"] += 1
                if math.isfinite(value) and float(value).is_integer():
                    kind = match_.int_kind(int(value))
                    if kind:
                        findings.append(f"{where} = {value}: {kind}")
    for index, record in enumerate(exported.logs):
        stats["log_records"] += 1
        where = f"log record {index} ({record.levelname} {record.msg[:40]!r})"
        findings += match_.text(where, record.getMessage())
        for name, value in vars(record).items():
            if name in _STANDARD_RECORD_FIELDS:
                continue
            findings += match_.text(f"{where} extra {name}", repr(value))
        if record.exc_info:
            findings += match_.text(f"{where} exception", logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            findings += match_.text(f"{where} stack", record.stack_info)
    return findings, stats


def attribute_keys(exported: Exported) -> list[tuple[str, str, str]]:
    """(owner kind, path, key) of every attribute of every message that has attributes."""
    keys = []
    requests = [("traces", r) for r in exported.traces] + [("metrics", r) for r in exported.metrics]
    for index, (signal, request) in enumerate(requests):
        for path, message in _messages(request, f"{signal}[{index}]"):
            names = [d.name for d, _ in message.ListFields()]
            for attr_field in ("attributes", "filtered_attributes"):
                if attr_field not in names:
                    continue
                owner = ATTRIBUTE_OWNERS.get(message.DESCRIPTOR.name, f"unknown:{message.DESCRIPTOR.name}")
                for kv in getattr(message, attr_field):
                    keys.append((owner, f"{path}.{attr_field}", kv.key))
    return keys


def identifier_words(key: str) -> set[str]:
    return set(re.split(r"[._\-]", key.lower())) & IDENTIFIER_WORDS


def scan_keys(exported: Exported, allowed: dict[str, set[str]]) -> list[str]:
    findings = []
    for owner, path, key in attribute_keys(exported):
        if key not in allowed.get(owner, set()):
            findings.append(f"{path}: {owner} attribute key {key!r} is not documented")
        # the SDK's service.instance.id; a request's trace id (checked by scan_names)
        words = identifier_words(key) if owner != "resource" and key not in TRACE_LINKAGE_KEYS else set()
        if words:
            findings.append(f"{path}: {owner} attribute key {key!r} names an identifier ({', '.join(sorted(words))})")
    return findings


def scan_names(exported: Exported, documented: dict[str, set[str]],
               requests: frozenset[tuple[int, int]] = frozenset()) -> list[str]:
    """Span, event and metric names, and the scope, are the documented ones; links go to
    exported offload spans or to ``requests`` (the traced requests' root spans, as
    ``(trace id, span id)``), and a ``hicache.request`` event names a linked request's trace id."""
    from opentelemetry.trace import SpanContext
    from otlp_receiver import attributes

    from otel_hicache.sinks.spans import trace_id_hex

    findings = []
    spans = [span for request in exported.traces for rs in request.resource_spans for ss in rs.scope_spans
             for span in ss.spans]
    offloads = {(span.trace_id, span.span_id) for span in spans if span.name == sc.SPAN_OFFLOAD}
    for request in exported.traces:
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                if ss.scope.name != sc.SCOPE_NAME:
                    findings.append(f"span scope {ss.scope.name!r}")
                for span in ss.spans:
                    if span.name not in documented["span_names"]:
                        findings.append(f"span name {span.name!r}")
                    findings += [f"event name {e.name!r}" for e in span.events
                                 if e.name not in documented["event_names"]]
                    # links: a load-back's to the exported offload spans that wrote its pages, and
                    # any op's to the traced requests' root spans; ids and hicache.link_to only
                    linked_requests = set()
                    for link in span.links:
                        ids = (int.from_bytes(link.trace_id, "big"), int.from_bytes(link.span_id, "big"))
                        to = attributes(link.attributes)
                        if to == {sc.LINK_TO: sc.LINK_TO_OFFLOAD}:
                            if span.name != sc.SPAN_ONBOARD or (link.trace_id, link.span_id) not in offloads:
                                findings.append(f"span {span.name} has an offload link to no exported offload span")
                        elif to == {sc.LINK_TO: sc.LINK_TO_REQUEST}:
                            if ids not in requests:
                                findings.append(f"span {span.name} has a request link to no traced request")
                            linked_requests.add(trace_id_hex(SpanContext(ids[0], ids[1], is_remote=True)))
                        else:
                            findings.append(f"span {span.name} has a link with attributes {to!r}")
                        if link.trace_state:
                            findings.append(f"span {span.name} has a link with trace state")
                    for event in span.events:
                        got = attributes(event.attributes)
                        if event.name == sc.EVENT_REQUEST:
                            if set(got) != {sc.REQUEST_TRACE_ID} or got[sc.REQUEST_TRACE_ID] not in linked_requests:
                                findings.append(f"span {span.name}: a {event.name} event names no linked request")
                        elif got:
                            findings.append(f"span {span.name}: event {event.name} has attributes")
    for request in exported.metrics:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                if sm.scope.name != sc.SCOPE_NAME:
                    findings.append(f"metric scope {sm.scope.name!r}")
                findings += [f"metric name {m.name!r}" for m in sm.metrics
                             if m.name not in documented["metric_names"]]
    return findings


# --------------------------------------------------------------------------
# the allow-list, from the docs
# --------------------------------------------------------------------------
def _section(doc: str, heading: str) -> str:
    lines = doc.splitlines()
    assert heading in lines, f"no heading {heading!r}"
    start = lines.index(heading) + 1
    level = heading.split(" ")[0]
    stops = ("## ",) if level == "##" else ("## ", "### ")
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(stops)), len(lines))
    return "\n".join(lines[start:end])


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def _ticked_names(text: str) -> set[str]:
    """Ticked names, without calls such as `submit()`."""
    return {t for t in _ticked(text) if re.fullmatch(r"[A-Za-z0-9_.]+", t)}


def _first_column(table: str) -> set[str]:
    return {_ticked(line)[0] for line in table.splitlines() if line.startswith("| `")}


def _row(section: str, name: str) -> str:
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] == name:
            return cells[1]
    raise AssertionError(f"no {name!r} row")


def documented() -> dict[str, set[str]]:
    """Attribute keys per owner, and the names, that docs/reference.md and docs/sglang.md document."""
    from otel_hicache_sglang.ranks import RANK_LABELS

    reference = (DOCS / "reference.md").read_text(encoding="utf-8")
    sglang_doc = (DOCS / "sglang.md").read_text(encoding="utf-8")
    span_keys = _first_column(_section(reference, "### Span attributes"))
    metric_names = {m.group(1) for m in re.finditer(r"^### `([^`]+)`$", reference, flags=re.M)}
    point_keys = set()
    for name in metric_names:
        point_keys |= set(_ticked(_row(_section(reference, f"### `{name}`"), "Attributes")))
    adapter = _section(sglang_doc, "## Attributes")
    adapter_span_keys = _first_column(adapter)
    missing = [r for r in RANK_LABELS if f"`{r}`" not in adapter]
    assert not missing, f"rank labels not documented in docs/sglang.md: {missing}"
    ranks = set(RANK_LABELS)
    spans = _section(reference, "### Names, kind, parent, times")
    events = _row(spans, "Events")
    event_keys = {sc.REQUEST_TRACE_ID} & set(_ticked(events))  # the one event attribute
    link_keys = {sc.LINK_TO} if f"`{sc.LINK_TO}=" in _row(spans, "Links") else set()
    # resource attributes come from the SDK, OTEL_* and (a telemetry process) the ranks: the SDK's
    # defaults (service.instance.id is a random UUID per process) and what this test sets
    assert "`service.name`" in reference and "`service.instance.id`" in reference
    return {
        "span": span_keys | adapter_span_keys | ranks,
        "point": point_keys | ranks,
        "exemplar": point_keys | ranks,
        "resource": {"service.name", "service.instance.id"} | SDK_RESOURCE_KEYS | set(RESOURCE) | ranks,
        "scope": set(),
        "event": event_keys,
        "link": link_keys,
        "span_names": _ticked_names(_row(spans, "Names")),
        "event_names": _ticked_names(events) - event_keys,
        "metric_names": metric_names,
    }


def test_the_documented_allow_list_names_no_identifier():
    allowed = documented()
    assert {"hicache.direction", "hicache.tokens", "hicache.controller", "tp_rank"} <= allowed["span"]
    assert {"hicache.pool", "reason", "hicache.origin", "attn_cp_rank"} <= allowed["point"]
    assert allowed["span_names"] == {sc.SPAN_OFFLOAD, sc.SPAN_ONBOARD}
    assert allowed["event_names"] == {sc.EVENT_REQUEST}
    assert allowed["event"] == {sc.REQUEST_TRACE_ID} and allowed["link"] == {sc.LINK_TO}
    metric_specs = [v for v in vars(sc).values() if isinstance(v, tuple) and len(v) == 3 and "." in str(v[0])]
    assert allowed["metric_names"] == {spec[0] for spec in metric_specs}
    offending = {k: identifier_words(k) for owner in ("span", "point", "exemplar") for k in allowed[owner]
                 if identifier_words(k) and k not in TRACE_LINKAGE_KEYS}
    assert not offending, f"documented attribute keys that name identifiers: {offending}"


# --------------------------------------------------------------------------
# the realistic run
# --------------------------------------------------------------------------
@dataclass
class Run:
    exported: Exported
    secrets: Secrets
    facts: dict[str, Any]


def _walk_python_tree(root: Any) -> Iterator[Any]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


class _LetterIds(IdGenerator):
    """Ids spelled with the hex letters a-f only: a request's trace id, exported as 32 hex
    digits, never has a run of decimal digits that the value scan would read as a number."""

    def __init__(self) -> None:
        self._n = 0

    def _next(self, digits: int) -> int:
        self._n += 1
        n, letters = self._n, []
        for _ in range(digits):
            n, r = divmod(n, 6)
            letters.append("abcdef"[r])
        return int("".join(reversed(letters)), 16)

    def generate_span_id(self) -> int:
        return self._next(16)

    def generate_trace_id(self) -> int:
        return self._next(32)


def _traced_requests(sglang_cpu: Any, secrets: Secrets, facts: dict[str, Any], base: int,
                     python_stacks: list[Any]) -> None:
    """SGLang's own request tracing (``TraceReqContext``, root spans with the request id):
    a request's insert backs its KV up (write-through), a later request's admission loads it
    back. Both ops link to their request's root span; only its trace and span ids leave."""
    stack = sglang_cpu.build_stack("write_through", tree_core_backend="python")
    python_stacks.append(stack)
    did = sglang_cpu.traced_round_trip(stack, n=12, start=base + 700)
    facts["request_roots"] = frozenset((did[r].trace_id, did[r].span_id) for r in ("writer", "reader"))
    tokens = list(range(base + 700, base + 712))
    secrets.token_ids.update(tokens)
    secrets.token_sequences.append(tokens)
    secrets.texts |= {f"rid-writer-{base + 700}", f"rid-reader-{base + 700}"}  # the requests' ids


def _scenarios(sglang_cpu: Any, secrets: Secrets, facts: dict[str, Any]) -> None:
    base = TOKEN_IDS.start
    python_stacks = []

    # SGLang's own request tracing (--enable-trace), on before the first cache controller
    # exists (as in a scheduler), so the request sites are wrapped; its spans stay here
    request_provider = TracerProvider(shutdown_on_exit=False, id_generator=_LetterIds())
    tracing = sglang_cpu.request_tracing(request_provider)
    tracing.__enter__()
    try:
        _scenarios_traced(sglang_cpu, secrets, facts, base, python_stacks, request_provider)
    finally:
        tracing.__exit__(None, None, None)
    _scenarios_untraced(sglang_cpu, secrets, facts, base, python_stacks)


def _scenarios_traced(sglang_cpu: Any, secrets: Secrets, facts: dict[str, Any], base: int, python_stacks: list[Any],
                      request_provider: Any) -> None:
    from sglang.srt.managers import schedule_batch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    # a span with the request's identity is current on the scheduler thread, and baggage carries it too
    request_tracer = request_provider.get_tracer("sglang")
    ctx = baggage.set_baggage("sglang.rid", RID)
    ctx = baggage.set_baggage("sglang.prompt", PROMPT, ctx)
    token = context.attach(ctx)
    try:
        retracted_ids = list(range(base + 200, base + 208))
        with request_tracer.start_as_current_span(
                "sglang.request", attributes={"rid": RID, "prompt": PROMPT, "input_ids": retracted_ids}) as request:
            wt = sglang_cpu.build_stack("write_through", tree_core_backend="python")
            python_stacks.append(wt)
            did = sglang_cpu.write_through_round_trip(wt, n=12, start=base + 100)
            # a request with that prefix: a host hit (loaded back) then a device hit
            key = RadixKey(array("q", range(base + 100, base + 112)))
            hit = wt.cache.match_prefix(MatchPrefixParams(key=key))
            assert hit.device_prefix_len == 12
            schedule_batch.split_cached_prefix_by_tier(prefix_len=hit.device_prefix_len,
                                                       host_hit_len=did["onboard_tokens"], storage_hit_len=0)
            schedule_batch.split_cached_prefix_by_tier(prefix_len=hit.device_prefix_len, host_hit_len=0,
                                                       storage_hit_len=0)
            req = Req(RID, PROMPT, array("q", retracted_ids), SamplingParams())
            sglang_cpu.decode_retraction(wt, n=len(retracted_ids), req=req)
            secrets.token_ids.update(retracted_ids)
            secrets.token_sequences.append(retracted_ids)
        facts["request_span_id"] = request.get_span_context().span_id
    finally:
        context.detach(token)
    _traced_requests(sglang_cpu, secrets, facts, base, python_stacks)


def _scenarios_untraced(sglang_cpu: Any, secrets: Secrets, facts: dict[str, Any], base: int,
                        python_stacks: list[Any]) -> None:
    wb = sglang_cpu.build_stack("write_back", tree_core_backend="python")
    python_stacks.append(wb)
    sglang_cpu.write_back_eviction(wb, n=12, start=base + 300, load_back=True)

    small_host = sglang_cpu.build_stack("write_through", host_ratio=0.25, tree_core_backend="python")
    python_stacks.append(small_host)
    facts["dropped"] = sglang_cpu.unbacked_eviction_drop(small_host, start=base + 400)["dropped_tokens"]

    he = sglang_cpu.build_stack("write_through", tree_core_backend="python")
    python_stacks.append(he)
    facts["host_evicted"] = sglang_cpu.host_eviction(he, start=base + 500)["host_evicted_tokens"]

    # SGLang's default TreeCore (Rust): its node ids are small integers, not
    # distinguishable from counts; tokens, request and hashes are checked
    rust = sglang_cpu.build_stack("write_through")
    facts["rust_tree_core"] = type(rust.cache.tree_core).__name__
    sglang_cpu.write_through_round_trip(rust, n=12, start=base + 600)

    controller, kv, allocator = sglang_cpu.build_controller()
    acks = sglang_cpu.controller_round_trip(controller, kv, allocator, write_node_id=ENGINE_NODE_IDS[0],
                                            load_node_id=ENGINE_NODE_IDS[1])
    facts["ack_node_ids"] = list(acks["write_ack"].node_ids) + list(acks["load_ack"].node_ids)

    # the Python trees: node ids, keys and page hashes (filled in as SGLang does
    # when a storage backend attaches to a live tree)
    facts["tree_nodes"] = 0
    for stack in python_stacks:
        core = stack.cache.tree_core
        core.backfill_missing_hash_values()
        for node in _walk_python_tree(core.root_node):
            facts["tree_nodes"] += 1
            secrets.node_ids.add(node.id)
            secrets.add_hashes(node.hash_value or ())
            if node.key is not None:
                secrets.token_ids.update(int(t) for t in node.key.token_ids)


@pytest.fixture(scope="module")
def sglang_run(sglang_cpu: Any) -> Run:
    from sglang.srt.managers.cache_controller import CacheOperation
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeNode
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from otel_hicache_sglang import SGLangHiCacheInstrumentor

    secrets = Secrets()
    facts: dict[str, Any] = {}
    capture = OtlpCapture()
    inserted: list[tuple[int, list[int]]] = []
    original_insert = sglang_cpu.insert_sequence

    def insert_sequence(stack: Any, start: int, n: int) -> Any:
        tokens, reference, match = original_insert(stack, start, n)
        inserted.append((stack.cache.page_size, list(tokens)))
        return tokens, reference, match

    instrumentor = SGLangHiCacheInstrumentor()
    assert not instrumentor.is_instrumented_by_opentelemetry, "left instrumented by an earlier test"
    with pytest.MonkeyPatch.context() as mp, LogCapture(("otel_hicache", "otel_hicache_sglang")) as logs:
        for key in list(os.environ):
            if key.startswith("OTEL_"):
                mp.delenv(key)
        mp.setenv("OTEL_SERVICE_NAME", "sglang")
        mp.setenv("OTEL_RESOURCE_ATTRIBUTES", ",".join(f"{k}={v}" for k, v in RESOURCE.items()))
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", capture.endpoint)
        mp.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        mp.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")  # exports at force_flush and shutdown
        mp.setenv("OTEL_HICACHE_POLL_INTERVAL_MS", "0.5")
        mp.setenv("OTEL_HICACHE_HOST_RESIDENCE", "true")  # its links and attributes are scanned too
        # embedded: the sinks' log records are then this process's, which the scan reads
        mp.setenv("OTEL_HICACHE_TELEMETRY_PROCESS", "false")
        mp.setattr(UnifiedTreeNode, "counter", NODE_IDS.start)
        mp.setattr(CacheOperation, "counter", OP_IDS.start)
        mp.setattr(sglang_cpu, "insert_sequence", insert_sequence)
        otel_hicache.configure(force=True)  # what the adapter's configure() then returns
        instrumentor.instrument()  # no providers: the production path, OTEL_* only
        try:
            _scenarios(sglang_cpu, secrets, facts)
            telemetry = instrumentor.telemetry
            assert telemetry is not None and telemetry.force_flush(10.0)
        finally:
            instrumentor.uninstrument()
            otel_hicache.shutdown(10.0)
            capture.stop()
        # every node and cache op SGLang created in this run (evicted ones too)
        secrets.node_ids.update(range(NODE_IDS.start, UnifiedTreeNode.counter))
        secrets.op_ids.update(range(OP_IDS.start, CacheOperation.counter))
        facts["python_nodes_created"] = UnifiedTreeNode.counter - NODE_IDS.start
        facts["cache_ops_created"] = CacheOperation.counter - OP_IDS.start
    secrets.node_ids.update(ENGINE_NODE_IDS)
    for page_size, tokens in inserted:
        secrets.token_ids.update(tokens)
        secrets.token_sequences.append(tokens)
        secrets.add_hashes(get_storage_hash_str(RadixKey(array("q", tokens)), None, page_size=page_size))
    facts["inserted_sequences"] = len(inserted)
    return Run(_capture_of(capture, logs), secrets, facts)


def _spans(exported: Exported) -> list[Any]:
    return [span for request in exported.traces for rs in request.resource_spans for ss in rs.scope_spans
            for span in ss.spans]


def _attributes(items: Any) -> dict[str, Any]:
    from otlp_receiver import attributes

    return attributes(items)


def _points(exported: Exported) -> list[tuple[str, Any]]:
    points = []
    for request in exported.metrics:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    data = getattr(metric, metric.WhichOneof("data"))
                    points += [(metric.name, p) for p in data.data_points]
    return points


def test_the_run_exercised_what_the_scan_claims(sglang_run):
    """Not a vacuous scan: the sensitive values existed and everything was exported."""
    exported, secrets, facts = sglang_run.exported, sglang_run.secrets, sglang_run.facts
    # the sensitive values were really in the objects the adapter wraps
    assert secrets.token_ids and all(t in TOKEN_IDS for t in secrets.token_ids)
    assert len(secrets.token_ids) >= 80 and facts["inserted_sequences"] >= 6
    assert facts["python_nodes_created"] >= 10 and facts["tree_nodes"] >= 5
    assert all(n in NODE_IDS for n in secrets.node_ids)
    assert facts["ack_node_ids"] == list(ENGINE_NODE_IDS)  # node ids rode on the HiCacheAcks
    assert facts["cache_ops_created"] >= 8
    assert len(secrets.hashes) >= 15 and all(len(h) == 64 for h in secrets.hashes)  # one per page
    assert facts["rust_tree_core"] == "RustUnifiedTreeCore"

    spans = _spans(exported)
    kinds = {(_attributes(s.attributes)["hicache.direction"], _attributes(s.attributes)["hicache.origin"])
             for s in spans}
    assert kinds == {(d, o) for d in ("offload", "onboard") for o in ("merged_op", "direct")}
    # write-through 2, retraction 2, traced requests 2, write-back 2, unbacked drop 1, host eviction 1,
    # Rust core 2, engine 2
    assert len(spans) == 14
    # the traced requests' write-through and load-back (exported in the order they end), each linked to
    # its request (trace ids only)
    to_requests = [s for s in spans for link in s.links
                   if _attributes(link.attributes) == {sc.LINK_TO: sc.LINK_TO_REQUEST}]
    assert sorted(_attributes(s.attributes)["hicache.cause"] for s in to_requests) == ["prefix_hit", "write_through"]
    assert {(int.from_bytes(l.trace_id, "big"), int.from_bytes(l.span_id, "big")) for s in to_requests
            for l in s.links if _attributes(l.attributes)[sc.LINK_TO] == sc.LINK_TO_REQUEST} == facts["request_roots"]
    assert [e.name for s in spans for e in s.events] == [sc.EVENT_REQUEST] * 2  # the only events
    assert any(s.links for s in spans)  # a load-back linked to the offload that wrote its pages
    assert any(_attributes(s.attributes).get(sc.ACKED) is True for s in spans)
    # the request span (with rid and prompt) was current at submit: it is the parent
    assert sum(s.parent_span_id == facts["request_span_id"].to_bytes(8, "big") for s in spans) >= 4

    exemplars = [e for _, p in _points(exported) for e in getattr(p, "exemplars", ())]
    assert exemplars and all(len(e.trace_id) == 16 for e in exemplars)  # trace-based exemplars were exported
    names = {name for name, _ in _points(exported)}
    # every metric; queue wait needs device timing events (none on CPU)
    # and the telemetry process's own CPU (this run is embedded)
    assert names == documented()["metric_names"] - {sc.TRANSFER_QUEUE_WAIT[0], sc.EXPORT_CPU_TIME[0]}
    assert {p for p, _ in exported.bodies} == {"/v1/traces", "/v1/metrics"}


def test_no_sensitive_value_is_exported(sglang_run):
    findings, stats = scan_values(sglang_run.exported, sglang_run.secrets)
    print(f"privacy scan: {len(_spans(sglang_run.exported))} spans, {len(_points(sglang_run.exported))} points, "
          f"{stats}, {len(sglang_run.secrets.token_ids)} token ids, {len(sglang_run.secrets.node_ids)} node ids, "
          f"{len(sglang_run.secrets.op_ids)} op ids, {len(sglang_run.secrets.hashes)} hashes")
    assert stats["raw_bytes"] > 0 and stats["strings"] > 0 and stats["log_records"] > 0
    assert not findings, "PRIVACY LEAK: sensitive values exported:\n" + "\n".join(findings[:50])


def test_every_attribute_key_is_documented_and_names_no_identifier(sglang_run):
    keys = attribute_keys(sglang_run.exported)
    owners = {owner for owner, _, _ in keys}
    assert {"resource", "span", "point"} <= owners
    findings = scan_keys(sglang_run.exported, documented())
    assert not findings, "undocumented or identifier attribute keys exported:\n" + "\n".join(sorted(set(findings)))


def test_every_name_is_documented(sglang_run):
    findings = scan_names(sglang_run.exported, documented(), sglang_run.facts["request_roots"])
    assert not findings, "\n".join(findings)


def test_otel_hicache_exports_no_otel_log_records():
    """What this file captures is all there is: spans and metrics over OTLP, and Python
    log records. Neither package builds an OTel ``LoggerProvider`` or log exporter (if
    one ever does, its records must be captured and scanned here too)."""
    import otel_hicache_sglang

    sources = [*Path(otel_hicache.__file__).parent.glob("*.py"), *Path(otel_hicache_sglang.__file__).parent.glob("*.py")]
    assert len(sources) > 10
    for source in sources:
        text = source.read_text(encoding="utf-8")
        for marker in ("_logs", "LoggerProvider", "LoggingHandler", "LogExporter", "log_exporter"):
            assert marker not in text, f"{source.name} uses {marker}: capture and scan OTel log records too"


# --------------------------------------------------------------------------
# the scans catch leaks
# --------------------------------------------------------------------------
def test_the_scans_flag_leaks_injected_through_the_public_api(sglang_cpu, monkeypatch):
    """A span attribute, a static (metric) attribute and a log line carrying each kind
    of sensitive value are all reported, with the undocumented keys."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    page_hash = hashlib.sha256(b"a page").hexdigest()
    secrets = Secrets(token_ids={4_817_001, 4_817_002}, node_ids={6_290_007}, hashes={page_hash},
                      token_sequences=[[4_817_001, 4_817_002]])
    signed = int(page_hash[:16], 16) - (1 << 64) if int(page_hash[:16], 16) >= 1 << 63 else int(page_hash[:16], 16)
    capture = OtlpCapture()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=capture.endpoint + "/v1/traces")))
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=capture.endpoint + "/v1/metrics"),
                                           export_interval_millis=600_000)
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    with LogCapture(("otel_hicache",)) as logs:
        tel = otel_hicache.TransferTelemetry(tracer_provider, meter_provider,
                                             attributes={"tp_rank": 0, "request_id": RID})
        try:
            clean = {"hicache.controller": "HiCacheController"}
            tel.submit("offload", {"kv": 64}, 12_288, page_size=4, attributes=clean, expect_ack=False,
                       host_start_ns=1, host_end_ns=2_000)
            leaky = {"prompt_text": PROMPT, "input_ids": [4_817_001, 4_817_002], "node_id": 6_290_007,
                     "page_hash": page_hash, "page_hash_int": signed, "note": "first id 4817001",
                     "score": 4_817_002.0}
            tel.submit("onboard", {"kv": 64}, 12_288, page_size=4, attributes=leaky, expect_ack=False,
                       host_start_ns=3_000, host_end_ns=5_000)
            assert tel.force_flush(10.0)
            logging.getLogger("otel_hicache").debug("reused prefix of request %s: tokens=%d", RID, 4_817_001)
        finally:
            tel.shutdown()
            tracer_provider.shutdown()
            meter_provider.shutdown()
            capture.stop()
    exported = _capture_of(capture, logs)
    findings, _ = scan_values(exported, secrets)
    text = "\n".join(findings)

    def flagged(*parts: str) -> bool:
        return any(all(p in f for p in parts) for f in findings)

    assert flagged("raw body", "PRIVATE-PROMPT"), text
    assert flagged("raw body", "token id 4817001 as text"), text
    assert flagged("traces[", "['prompt_text']", "PRIVATE-PROMPT"), text
    assert flagged("traces[", "['input_ids']", "token id"), text
    assert flagged("traces[", "['node_id']", "node id"), text
    assert flagged("traces[", "['page_hash']", page_hash[:16]), text
    assert flagged("traces[", "['page_hash_int']", "hash (int form)"), text
    assert flagged("traces[", "['note']", "token id 4817001"), text
    assert flagged("traces[", "['score']", "token id"), text
    assert flagged("metrics[", "['request_id']", "PRIVATE-RID"), text  # static attributes reach every point
    assert flagged("log record", "PRIVATE-RID") and flagged("log record", "token id 4817001"), text
    assert not any("['hicache." in f for f in findings), text

    keys = "\n".join(scan_keys(exported, documented()))
    for key in ("prompt_text", "input_ids", "node_id", "page_hash", "request_id"):
        assert f"{key!r} names an identifier" in keys, (key, keys)
    assert "'note' is not documented" in keys and "'score' is not documented" in keys, keys
    assert "'hicache.controller' is not documented" not in keys, keys


def test_the_raw_scan_finds_binary_forms():
    page_hash = hashlib.sha256(b"another page").hexdigest()
    secrets = Secrets(token_ids={4_817_001, 4_817_002}, hashes={page_hash},
                      token_sequences=[[4_817_001, 4_817_002]])
    clean = Exported([("/v1/traces", b"\x0a\x05hello\x10\x2a")], [], [], [])
    assert scan_values(clean, secrets)[0] == []
    for payload, kind in ((struct.pack("<qq", 4_817_001, 4_817_002), "token ids (packed int64)"),
                          (struct.pack("<ii", 4_817_001, 4_817_002), "token ids (packed int32)"),
                          (bytes.fromhex(page_hash), "hash (raw digest)"),
                          (page_hash[:16].upper().encode(), page_hash[:16].upper())):
        leaky = Exported([("/v1/traces", b"\x0a\x05hello" + payload)], [], [], [])
        assert any(kind in f for f in scan_values(leaky, secrets)[0]), kind


def test_the_log_scan_reads_messages_and_extra_fields():
    secrets = Secrets(token_ids={4_817_123})
    record = logging.LogRecord("otel_hicache", logging.DEBUG, __file__, 1, "reused tokens=%d of %s", (12, "ab" * 16),
                               None)
    exported = Exported([], [], [], [record])
    assert scan_values(exported, secrets)[0] == []
    record.args = (4_817_123, "ab" * 16)
    assert any("token id 4817123" in f for f in scan_values(exported, secrets)[0])
    record.args = (12, "4817123")  # a string argument is scanned as text
    assert any("token id 4817123" in f for f in scan_values(exported, secrets)[0])
    record.args, record.otelTraceID = (12, "ab" * 16), "rid 4817123"
    assert any("extra otelTraceID" in f for f in scan_values(exported, secrets)[0])


def test_the_name_scan_flags_links_to_anything_but_traced_requests():
    """A link to a span that is no traced request's root, and a hicache.request event naming
    a trace the span does not link to, are reported."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import SpanContext, TraceFlags

    capture = OtlpCapture()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=capture.endpoint + "/v1/traces")))
    request = SpanContext(0xABCDEF, 0xFEDCBA, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    with LogCapture(("otel_hicache",)) as logs:
        tel = otel_hicache.TransferTelemetry(tracer_provider, MeterProvider(shutdown_on_exit=False), {})
        try:
            tel.submit("onboard", {"kv": 4}, 4096, page_size=4, expect_ack=False, host_start_ns=1, host_end_ns=2_000,
                       requests=[request])
            assert tel.force_flush(10.0)
        finally:
            tel.shutdown()
            tracer_provider.shutdown()
            capture.stop()
    exported = _capture_of(capture, logs)
    assert scan_names(exported, documented(), frozenset({(0xABCDEF, 0xFEDCBA)})) == []
    findings = scan_names(exported, documented(), frozenset({(0xABCDEF, 0x1)}))
    assert findings == ["span hicache.onboard has a request link to no traced request"]
    # the event names the trace of a link: take the link away and the event names no linked request
    for request_ in exported.traces:
        for rs in request_.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    del span.links[:]
    assert scan_names(exported, documented(), frozenset({(0xABCDEF, 0xFEDCBA)})) == [
        "span hicache.onboard: a hicache.request event names no linked request"]
