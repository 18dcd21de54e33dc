"""What exporting a gateway request's spans costs the gateway's CPU, in one process.

`gateway_overhead.py --otlp` measures the same end to end, but on a shared 2-core host
its run-to-run drift is larger than the difference; this times each piece alone, with
``time.process_time`` over many requests: building a request's span tree from its context
(``gateway/spans.py``), and encoding it to OTLP protobuf, by the SDK's encoder (through
``ReadableSpan`` records) and by ``telemetry/otlp.py`` (in C, ``otlp_native.c``, and in
Python; both timed); and both in one C call (``gateway/spans_native.c``: what the
gateway does where it builds).

    .venv/bin/python benchmarks/span_export.py

Results: ``benchmarks/results/span_export.json``.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from sendpath.clock import RealClock
from sendpath.gateway import spans
from sendpath.gateway.context import AttemptRecord, GatewayContext
from sendpath.gateway.spans import gateway_span
from sendpath.telemetry.export import _resource, _resource_attributes, readable_spans
from sendpath.telemetry.otlp import (
    SpanTree,
    encode_request,
    encode_resource,
    encode_tree,
    prefer_native,
)
from sendpath.telemetry.trace_context import TraceParent
from sendpath.trace import Stage

RESULTS = Path(__file__).parent / "results" / "span_export.json"
N = 5000
BATCH = 512  # the SDK's batch processor's default batch size


def context(clock: RealClock, i: int) -> GatewayContext:
    """A streamed chat as the gateway overhead benchmark's requests end up."""
    ctx = GatewayContext(clock, clock.now(), request_id=f"req-{i:012x}")
    t = ctx.start
    stages = (
        Stage.GATEWAY_AUTH,
        Stage.GATEWAY_RATELIMIT,
        Stage.GATEWAY_SAFETY,
        Stage.GATEWAY_QUEUE,
    )
    for n, stage in enumerate(stages, start=1):
        ctx.marks[stage] = t + 0.0001 * n
    ctx.body = {"model": "mock", "stream": True, "max_tokens": 32, "messages": []}
    ctx.status = 200
    ctx.routing = {"policy": "prefix_aware", "match": "approximate", "predicted_cached_tokens": 0}
    url = "http://127.0.0.1:9001"
    ctx.attempts.append(AttemptRecord("replica-0", url, t + 5e-4, i + 1, t + 0.01, 200))
    ctx.replica_arrival = t + 6e-4
    ctx.replica_timings = {"tokenize": 0.1, "engine.queue": 0.1, "prefill": 1.0, "decode": 5.0}
    ctx.usage, ctx.response_id, ctx.finish_reasons = (20, 14), f"chatcmpl-{i}", ["length"]
    ctx.first_token_at, ctx.trace = t + 0.002, TraceParent.child_of(None)
    ctx.finish()
    return ctx


def per_request_us(seconds: float) -> float:
    return round(seconds / N * 1e6, 1)


def main() -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    clock = RealClock()
    contexts = [context(clock, i) for i in range(N)]
    resource = _resource("sendpath-gateway")
    parts = encode_resource(_resource_attributes(resource), "sendpath", "0")

    def tree_of(ctx: GatewayContext) -> SpanTree:
        assert ctx.trace is not None
        span = gateway_span(ctx, "chat", clock.now())
        return SpanTree(span, ctx.trace.trace_id, ctx.trace.span_id, None, 1, 0.0)

    t0 = time.process_time()
    for ctx in contexts:
        tree_of(ctx)
    build = time.process_time() - t0
    at_end = {}
    for encoder in ("python", "c"):
        how = prefer_native(encoder == "c")
        if encoder == "c" and not how.startswith("in C"):
            print(f"the C encoder is not timed: encoded {how}")
            continue
        t0 = time.process_time()
        encoded = [encode_tree(tree_of(ctx)) for ctx in contexts]
        at_end[encoder] = per_request_us(time.process_time() - t0)
    prefer_native(False)
    how = spans.prefer_native()
    if how.startswith("in C"):  # what the gateway does: build and encode in one C call
        native, own = spans.native_spans(), spans._OWN
        t0 = time.process_time()
        for ctx in contexts:
            assert ctx.trace is not None
            ids = ctx.trace.trace_id.to_bytes(16, "big"), ctx.trace.span_id.to_bytes(8, "big")
            native.encode_gateway(ctx, "chat", clock.now(), own, *ids, None, 0.0)
        at_end["c_in_one_call"] = per_request_us(time.process_time() - t0)
    else:
        print(f"the one-call C build is not timed: spans built {how}")
    t0 = time.process_time()
    direct = sum(len(encode_request(*parts, encoded[i : i + BATCH])) for i in range(0, N, BATCH))
    batches = time.process_time() - t0
    trees = [tree_of(ctx) for ctx in contexts]
    t0 = time.process_time()
    sdk_bytes = 0
    for i in range(0, N, BATCH):
        sdk_bytes += len(
            encode_spans(readable_spans(trees[i : i + BATCH], resource)).SerializePartialToString()
        )
    sdk = time.process_time() - t0
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "requests": N,
        "spans_per_request": len(trees[0].root.walk()),
        "build_us_per_request": per_request_us(build),
        "build_and_encode_us_per_request": at_end,
        "batch_us_per_request": per_request_us(batches),
        "encode_sdk_us_per_request": per_request_us(sdk),
        "bytes_per_request": {"direct": direct // N, "sdk": sdk_bytes // N},
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
