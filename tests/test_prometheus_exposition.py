"""Exact Prometheus exposition of the seed's load-back, through the OTel Prometheus exporter.

The same naming rules (dots to underscores, unit suffixes, ``_total``) apply to
the Collector's prometheus exporter; docs/reference.md lists these names.
"""

from __future__ import annotations

import prometheus_client
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

from otel_hicache import TransferTelemetry, __version__
from simulated import SimulatedDevice

SCOPE = f'otel_scope_name="otel_hicache",otel_scope_schema_url="",otel_scope_version="{__version__}"'


@pytest.fixture
def exposition():
    reader = PrometheusMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    device = SimulatedDevice()
    tel = TransferTelemetry(TracerProvider(shutdown_on_exit=False), provider, {"tp_rank": 0},
                            clock=device.time_ns, anchor_event_factory=device.anchor_event)
    start, finish = device.copy(device.time_ns() + 200_000, 6.781)
    handle = tel.submit("onboard", {"kv": 1408}, 161_480_704, page_size=64, start_event=start, finish_event=finish,
                        io_backend="kernel", cause="prefix_hit")
    device.advance(ms=7)
    device.advance(seconds=5.75)
    tel.ack(handle)
    assert tel._pipeline.flush(5.0)  # pylint: disable=protected-access
    yield prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    tel.shutdown()
    provider.shutdown()  # the reader unregisters its collector


def test_counters(exposition):
    lines = set(exposition.splitlines())
    onboard = f'hicache_direction="onboard",{SCOPE},tp_rank="0"'
    merged = f'hicache_direction="onboard",hicache_origin="merged_op",{SCOPE},tp_rank="0"'
    expected = [
        f'hicache_transfer_bytes_total{{hicache_cause="prefix_hit",hicache_direction="onboard",hicache_dst_tier="L1",'
        f'hicache_origin="merged_op",hicache_src_tier="L2",{SCOPE},tp_rank="0"}} 1.61480704e+08',
        f"hicache_transfer_blocks_total{{{merged}}} 22.0",
        f'hicache_transfer_tokens_total{{hicache_cause="prefix_hit",hicache_direction="onboard",'
        f'hicache_origin="merged_op",hicache_pool="kv",{SCOPE},tp_rank="0"}} 1408.0',
        f"hicache_transfer_busy_time_seconds_total{{{onboard}}} 0.006781",
        f"hicache_transfer_inflight{{{onboard}}} 0.0",
        # zero series for every cause of each direction, with the origin its copies have, from start-up
        f'hicache_transfer_bytes_total{{hicache_cause="write_back",hicache_direction="offload",hicache_dst_tier="L2",'
        f'hicache_origin="merged_op",hicache_src_tier="L1",{SCOPE},tp_rank="0"}} 0.0',
        f'hicache_transfer_bytes_total{{hicache_cause="retraction_restore",hicache_direction="onboard",'
        f'hicache_dst_tier="L1",hicache_origin="direct",hicache_src_tier="L2",{SCOPE},tp_rank="0"}} 0.0',
        f'hicache_transfer_tokens_total{{hicache_cause="other",hicache_direction="onboard",'
        f'hicache_origin="direct",hicache_pool="kv",{SCOPE},tp_rank="0"}} 0.0',
        f'otel_hicache_records_dropped_total{{{SCOPE},reason="queue_full",tp_rank="0"}} 0.0',
    ]
    missing = [line for line in expected if line not in lines]
    assert not missing, "\n".join(missing)
    # a cause is never paired with an origin its copies cannot have
    assert not [line for line in lines if 'hicache_cause="retraction_restore"' in line
                and 'hicache_origin="merged_op"' in line]
    assert not [line for line in lines if 'hicache_cause="prefix_hit"' in line and 'hicache_origin="direct"' in line]
    missing = [line for line in expected if line not in lines]
    assert not missing, "\n".join(missing)


def test_histograms(exposition):
    lines = set(exposition.splitlines())
    duration = ('hicache_cause="prefix_hit",hicache_direction="onboard",hicache_dst_tier="L1",hicache_io_backend="kernel",'
                'hicache_origin="merged_op",hicache_src_tier="L2",hicache_timing_source="device_event"')
    onboard = f'hicache_direction="onboard",{SCOPE},tp_rank="0"'
    expected = [
        f'hicache_transfer_duration_seconds_bucket{{{duration},le="0.005",{SCOPE},tp_rank="0"}} 0.0',
        f'hicache_transfer_duration_seconds_bucket{{{duration},le="0.01",{SCOPE},tp_rank="0"}} 1.0',
        f"hicache_transfer_duration_seconds_count{{{duration},{SCOPE},tp_rank=\"0\"}} 1.0",
        f"hicache_transfer_duration_seconds_sum{{{duration},{SCOPE},tp_rank=\"0\"}} 0.006781",
        f"hicache_transfer_ack_delay_seconds_sum{{{onboard}}} 5.750019",
        f"hicache_transfer_queue_wait_seconds_sum{{{onboard}}} 0.0002",
        f'hicache_transfer_bandwidth_bytes_per_second_bucket{{hicache_direction="onboard",'
        f'hicache_timing_source="device_event",le="25000000000.0",{SCOPE},tp_rank="0"}} 1.0',
    ]
    missing = [line for line in expected if line not in lines]
    assert not missing, "\n".join(missing)
