"""The main job over real OTLP: the example workload, configured only by OTEL_*
variables, exports to a receiver that decodes what a collector would get."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from otlp_receiver import GrpcReceiver, HttpReceiver, attributes

pytestmark = pytest.mark.slow  # processes, receivers, seconds each: CI's later step (pytest -m slow)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_demo_exports_spans_and_exact_metrics_over_otlp(protocol):
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            OTEL_SERVICE_NAME="hicache-test",
            OTEL_RESOURCE_ATTRIBUTES="deployment.environment=ci",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
            OTEL_METRIC_EXPORT_INTERVAL="600000",  # only the final export at shutdown
        )
        done = subprocess.run(
            [sys.executable, os.path.join(ROOT, "examples", "hicache_workload.py"), "--ops", "24", "--layers", "2",
             "--pool-tokens", "512", "--seed", "3"],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        received = receiver.received
        spans = received.spans()
        resource = attributes(spans[0][0].attributes)
        assert resource["service.name"] == "hicache-test"
        assert resource["deployment.environment"] == "ci"
        steps = {span.span_id for _, span in spans if span.name == "example.scheduler_step"}
        requests = {(span.trace_id, span.span_id) for _, span in spans if span.name == "example.request"}
        spans = [(r, span) for r, span in spans if span.name not in ("example.scheduler_step", "example.request")]
        assert len(spans) == len(steps) == 24  # each op's transfer span and the scheduler step it ran in
        names = {span.name for _, span in spans}
        assert names <= {"hicache.offload", "hicache.onboard"}
        # every transfer span is the child of the scheduler step it was submitted in
        assert steps and all(span.parent_span_id in steps for _, span in spans)
        # write-throughs and prefix hits link to the request each served, the others to none
        linked = {span.span_id: [(link.trace_id, link.span_id) for link in span.links
                                 if attributes(link.attributes).get("hicache.link_to") == "request"]
                  for _, span in spans}
        served = {span.span_id for _, span in spans
                  if attributes(span.attributes)["hicache.cause"] in ("write_through", "prefix_hit")}
        assert served and {k for k, v in linked.items() if v} == served
        assert sorted(to for v in linked.values() for to in v) == sorted(requests)
        by_direction: dict[tuple[str, str, str], dict[str, int]] = {}
        for _, span in spans:
            attrs = attributes(span.attributes)
            assert attrs["hicache.timing_source"] == "host_clock"  # CPU: no timing events
            assert attrs["hicache.blocks"] == -(-attrs["hicache.tokens"] // attrs["hicache.page_size"])
            assert span.end_time_unix_nano >= span.start_time_unix_nano
            key = (attrs["hicache.direction"], attrs["hicache.origin"], attrs["hicache.cause"])
            totals = by_direction.setdefault(key, {"bytes": 0, "blocks": 0, "ops": 0})
            totals["bytes"] += attrs["hicache.bytes"]
            totals["blocks"] += attrs["hicache.blocks"]
            totals["ops"] += 1
        # the metrics the collector got are exactly what the spans add up to
        def key(point):
            attrs = attributes(point.attributes)
            return attrs["hicache.direction"], attrs["hicache.origin"], attrs.get("hicache.cause")

        for point in received.last_points("hicache.transfer.bytes"):
            assert point.as_int == by_direction.get(key(point), {}).get("bytes", 0)
        blocks: dict[tuple[str, str], int] = {}  # blocks are not by cause
        for point in received.last_points("hicache.transfer.blocks"):
            blocks[key(point)[:2]] = point.as_int
        assert {k: v for k, v in blocks.items() if v} == {
            k[:2]: sum(t["blocks"] for kk, t in by_direction.items() if kk[:2] == k[:2]) for k in by_direction}
        counts = {}
        for point in received.last_points("hicache.transfer.duration"):
            counts[key(point)] = counts.get(key(point), 0) + point.count
            assert list(point.explicit_bounds)[0] == 1e-5 and list(point.explicit_bounds)[-1] == 60.0
        assert counts == {d: t["ops"] for d, t in by_direction.items()}
        assert "counters match ground truth: yes" not in done.stdout  # OTLP mode prints ground truth only
    finally:
        receiver.stop()
