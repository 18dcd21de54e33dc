"""Traffic and scheduler settings that reach every path of a simulated replica, shared by
the tests that compare two runs (fleet against detailed mode, compiled against Python)."""

from __future__ import annotations

from sendpath.bench.workload import LengthSpec
from sendpath.config import SchedulerConfig
from sendpath.sim.traffic import Traffic


def mixed_traffic(num_requests: int) -> Traffic:
    """Prompts of 32-512 tokens after a shared prefix of 64, answers of 8-300, three-turn
    conversations with a second of thought, two tenants."""
    return Traffic(
        rate=12, num_requests=num_requests, input_len=LengthSpec(32, 512),
        output_len=LengthSpec(8, 300), shared_prefix=64, turns=3, think_s=1.0, tenants=2,
        seed=5,
    )  # fmt: skip


# a step budget and a chunk cap small enough that prompts are chunked beside decodes and
# admissions (a prompt admitted later can finish first), and a sequence cap that leaves
# some waiting while others decode
CHUNKED = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=160,
                          long_prefill_token_threshold=96)  # fmt: skip
