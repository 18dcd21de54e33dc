"""An OTLP/HTTP traces endpoint on loopback, as a collector serves it: it decodes each
export's protobuf, and can hold every export until released (a collector that hangs)."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Receiver:
    """Each span received as (service, span); ``hold``: answer no export until
    ``release`` is set (``received`` is set by the first)."""

    def __init__(self, hold: bool = False) -> None:
        self.spans: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        self.received = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.set()
                receiver.release.wait(30)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.add(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource in request.resource_spans:
                service = next(
                    a.value.string_value
                    for a in resource.resource.attributes
                    if a.key == "service.name"
                )
                for scope in resource.scope_spans:
                    self.spans += [(service, span) for span in scope.spans]

    def of_trace(self, trace_id: str) -> list[tuple[str, Any]]:
        with self.lock:
            return [(s, span) for s, span in self.spans if span.trace_id.hex() == trace_id]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
