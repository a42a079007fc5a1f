"""A minimal in-process OTLP receiver (gRPC and HTTP/protobuf) for tests.

It decodes what real OTLP exporters send and keeps the requests, so tests can
assert on spans and metric points exactly as a collector would receive them.
"""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Received:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.traces: list[Any] = []
        self.metrics: list[Any] = []
        self.headers: list[dict[str, str]] = []  # request headers (HTTP) or metadata (gRPC), lower-case keys
        self.refused: list[tuple[str, int]] = []  # (signal, items in the request) answered with an error status

    def refuse(self, signal: str, request: Any) -> None:
        """Count a request answered with an error: its spans, or its metric data points."""
        if signal == "traces":
            items = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        else:
            items = sum(len(getattr(m, m.WhichOneof("data")).data_points) for rm in request.resource_metrics
                        for sm in rm.scope_metrics for m in sm.metrics if m.WhichOneof("data"))
        with self.lock:
            self.refused.append((signal, items))

    def refused_items(self, signal: str) -> int:
        with self.lock:
            return sum(items for kind, items in self.refused if kind == signal)

    def spans(self) -> list[tuple[Any, Any]]:
        """(resource, span) pairs."""
        with self.lock:
            return [(rs.resource, span) for req in self.traces for rs in req.resource_spans
                    for ss in rs.scope_spans for span in ss.spans]

    def last_points(self, name: str) -> list[Any]:
        """Data points of metric ``name`` from the last request that had it (cumulative)."""
        with self.lock:
            for req in reversed(self.metrics):
                points = [p for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                          if m.name == name
                          for p in (m.sum.data_points if m.HasField("sum") else m.gauge.data_points
                                    if m.HasField("gauge") else m.histogram.data_points)]
                if points:
                    return points
        return []


def attributes(items: Any) -> dict[str, Any]:
    out = {}
    for kv in items:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = tuple(getattr(v, v.WhichOneof("value")) for v in value.array_value.values)
        else:
            out[kv.key] = getattr(value, kind)
    return out


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received, status: Any = None) -> None:
        self.received = received
        self.status = status

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        if self.status is not None:
            self.received.refuse("traces", request)
            context.abort(self.status, "refused by the test receiver")
        with self.received.lock:
            self.received.traces.append(request)
            self.received.headers.append({k.lower(): v for k, v in context.invocation_metadata()})
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, received: Received, status: Any = None) -> None:
        self.received = received
        self.status = status

    def Export(self, request, context):  # noqa: N802
        if self.status is not None:
            self.received.refuse("metrics", request)
            context.abort(self.status, "refused by the test receiver")
        with self.received.lock:
            self.received.metrics.append(request)
            self.received.headers.append({k.lower(): v for k, v in context.invocation_metadata()})
        return metrics_service_pb2.ExportMetricsServiceResponse()


class GrpcReceiver:
    """``tls=(cert_file, key_file)`` serves TLS on ``https://localhost:<port>``; ``status`` (a
    ``grpc.StatusCode``) answers every export with that error instead (counted in ``received.refused``)."""

    def __init__(self, tls: tuple[str, str] | None = None, status: Any = None) -> None:
        self.received = Received()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self.received, status), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self.received, status), self.server)
        if tls is None:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            self.endpoint = f"http://127.0.0.1:{self.port}"
        else:
            cert, key = (open(path, "rb").read() for path in tls)
            self.port = self.server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
            self.endpoint = f"https://localhost:{self.port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


class HttpReceiver:
    """``tls=(cert_file, key_file)`` serves TLS on ``https://localhost:<port>``; ``status`` answers
    every export with that HTTP status instead (counted in ``received.refused``), with ``headers``
    (a ``Location`` for a redirect, ``{path}`` in it the request's path; a ``Retry-After``)."""

    def __init__(self, tls: tuple[str, str] | None = None, status: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        received = self.received = Received()
        routes = {
            "/v1/traces": (trace_service_pb2.ExportTraceServiceRequest,
                           trace_service_pb2.ExportTraceServiceResponse(), received.traces, "traces"),
            "/v1/metrics": (metrics_service_pb2.ExportMetricsServiceRequest,
                            metrics_service_pb2.ExportMetricsServiceResponse(), received.metrics, "metrics"),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    import gzip

                    body = gzip.decompress(body)
                route = routes.get(self.path)
                if route is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                request_cls, response, store, signal = route
                request = request_cls()
                request.ParseFromString(body)
                if status is not None:
                    received.refuse(signal, request)
                    self.send_response(status)
                    for name, value in (headers or {}).items():
                        self.send_header(name, value.replace("{path}", self.path))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with received.lock:
                    store.append(request)
                    received.headers.append({k.lower(): v for k, v in self.headers.items()})
                payload = response.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        if tls is not None:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.endpoint = f"https://localhost:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class StallingServer:
    """Accepts TCP connections, reads whatever arrives and never answers: a collector
    that stalls (or a load balancer with nothing behind it)."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.connections: list[Any] = []
        self.received_bytes = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: Any) -> None:
        while not self._stop.is_set():
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            self.received_bytes += len(data)

    def stop(self) -> None:
        self._stop.set()
        for conn in self.connections:
            try:
                conn.close()
            except OSError:
                pass
        self.sock.close()


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_certificates(directory: Any, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> dict[str, str]:
    """A throw-away CA, a server certificate it signed for ``hosts`` (names and IP addresses),
    and an unrelated CA (the wrong certificate), made with the ``openssl`` command.

    Returns paths: ``ca``, ``cert``, ``key``, ``wrong_ca``."""
    import ipaddress
    import shutil
    import subprocess
    from pathlib import Path

    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the TLS tests need the openssl command (Debian package openssl)")
    d = Path(directory)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=d)

    for name in ("ca", "wrong_ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN=otel-hicache test {name}",
            "-keyout", f"{name}.key", "-out", f"{name}.pem")
    def san(host: str) -> str:
        try:
            return f"IP:{ipaddress.ip_address(host)}"
        except ValueError:
            return f"DNS:{host}"

    (d / "san.cnf").write_text(f"subjectAltName={','.join(san(h) for h in hosts)}\n", encoding="ascii")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
        "-out", "server.csr")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "san.cnf", "-out", "server.pem")
    return {"ca": str(d / "ca.pem"), "cert": str(d / "server.pem"), "key": str(d / "server.key"),
            "wrong_ca": str(d / "wrong_ca.pem")}
