"""The sinks: spans, metrics, host residence, sampling, links, logs, self-metrics and export,
built from the capture's records in a telemetry process of their own (:mod:`.process`) or
embedded on the poller thread (:mod:`.embedded`)."""
