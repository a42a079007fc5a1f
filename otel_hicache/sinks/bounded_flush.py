"""``force_flush`` or ``shutdown`` within a bound, on a daemon thread (the SDK's waits have none)."""

import threading
from typing import Any

from ..diagnostics import warn_once

_stuck: dict = {}  # providers' ids -> their blocked thread


def bounded(method: str, tracer_provider: Any, meter_provider: Any, timeout_s: float) -> bool:
    key, millis, result = (id(tracer_provider), id(meter_provider)), int(timeout_s * 1000), [True]

    def run() -> None:
        for provider, args in ((tracer_provider, () if method == "shutdown" else (millis,)),
                               (meter_provider, (millis,))):
            call = getattr(provider, method, None)
            try:
                result[0] = (call is None or call(*args) is not False) and result[0]
            except Exception as exc:  # pylint: disable=broad-except
                result[0] = False
                warn_once(f"bounded:{type(exc).__name__}", "otel-hicache: flush/shutdown failed: %r", exc)

    stuck = _stuck.pop(key, None)
    if stuck is not None and stuck.is_alive():
        if method == "shutdown":  # run once the blocked call returns
            stuck = threading.Thread(target=lambda blocked=stuck: (blocked.join(), run()), daemon=True)
            stuck.start()
        _stuck[key] = stuck
        warn_once("bounded:stuck", "otel-hicache: an earlier telemetry flush is still blocked; not waiting")
        return False
    thread = threading.Thread(target=run, name="otel-hicache-flush", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _stuck[key] = thread
        warn_once("bounded:timeout", "otel-hicache: telemetry flush/shutdown did not finish within %.1f s "
                  "(collector unreachable?)", timeout_s)
        return False
    return result[0]
