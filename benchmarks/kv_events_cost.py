"""What publishing KV events costs the engine step, measured on the KV manager itself.

A step's share of the work is what the KV manager does to record events and what the
engine does to hand them over (``KVEventPublisher.publish``: one ``put_nowait``);
encoding and sending happen on the publisher's own thread, timed here separately since
that thread shares the interpreter with the engine's. The workload is the KV side of a
busy replica: each step prefills one 512-token chunk of a new 1,024-token prompt (its full
blocks are cached, so a BlockStored) and the cache is small enough that new prompts evict
old ones (a BlockRemoved), for ``--steps`` steps with events off and on, alternated.

    .venv/bin/python -m benchmarks.kv_events_cost [--steps 4000] [--out ...json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from sendpath.config import KVEventsConfig
from sendpath.kvcache.event_wire import encode_batch
from sendpath.kvcache.events import KVEvent
from sendpath.kvcache.manager import KVCacheManager
from sendpath.model.quant import cpu_model
from sendpath.request import Request, SamplingParams
from sendpath.server.kv_events import KVEventPublisher

RESULTS = Path(__file__).parent / "results" / "kv_events_cost.json"
PROMPT, CHUNK, BLOCK, BLOCKS = 1024, 512, 16, 1024


def run(steps: int, publish: KVEventPublisher | None) -> tuple[float, list[list[KVEvent]]]:
    """Seconds per step of the KV work (and the handing over), and the batches made."""
    kv = KVCacheManager(BLOCKS, BLOCK)
    kv.events = [] if publish is not None else None
    batches: list[list[KVEvent]] = []
    live: list[Request] = []
    start = time.perf_counter()
    for step in range(steps):
        if step % 2 == 0:  # a new prompt: its own tokens, so nothing is a cache hit
            ids = list(range(step * PROMPT, (step + 1) * PROMPT))
            live.append(Request(f"r{step}", ids, SamplingParams(max_tokens=1)))
        request = live[-1]
        hits, _ = kv.get_computed_blocks(request)
        if kv.allocate_slots(request, CHUNK, hits) is None:
            raise RuntimeError("the cache is too small for one prompt")
        request.num_computed_tokens += CHUNK
        kv.cache_computed_blocks(request)
        if step % 2 == 1:  # prefilled: its blocks go back (still cached, evictable)
            kv.free(request)
        if publish is not None and kv.events:
            events, kv.events = kv.events, []
            publish.publish(events)
            batches.append(events)
    return (time.perf_counter() - start) / steps, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*")
    publisher = KVEventPublisher(config, "CPU")
    off, on = [], []
    batches: list[list[KVEvent]] = []
    for _ in range(args.rounds):
        off.append(run(args.steps, None)[0])
        seconds, batches = run(args.steps, publisher)
        on.append(seconds)
    publisher.close()
    start = time.perf_counter()
    for events in batches:
        encode_batch(0.0, events, "CPU")
    encode_s = (time.perf_counter() - start) / len(batches)
    off_us, on_us = statistics.median(off) * 1e6, statistics.median(on) * 1e6
    report = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "workload": {"prompt": PROMPT, "chunk": CHUNK, "block_size": BLOCK, "blocks": BLOCKS},
        "kv_step_us_events_off": round(off_us, 1),
        "kv_step_us_events_on": round(on_us, 1),
        "added_us_per_step": round(on_us - off_us, 1),
        "encode_and_send_thread_us_per_batch": round(encode_s * 1e6, 1),
        "events_per_batch": round(statistics.fmean(len(b) for b in batches), 2),
        "tokens_per_batch": CHUNK,
    }
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
