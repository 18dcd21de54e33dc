"""A step as the CPU model runner runs it: its shape, and the KV slots it gathers.

Each step the model runner (``model_runner.py``) reads the KV each sequence attends to
out of the paged cache: every prefill chunk its own whole context, and the decodes as
one batch padded to the longest one's blocks (B x its blocks). On a CPU those slots cost
a step time of their own, so the calibrated cost model (``sim/calibrated.py``) prices
them (``c_kv``); the engine core logs them with every step's shape for `sendpath
profile` to fit, and the simulator counts them for every step it prices. Torch-free:
the simulator imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sendpath.engine.scheduler import SchedulerOutput
from sendpath.engine.steps import StepShape

__all__ = ["CpuStepShape", "padded_decode_kv"]


def padded_decode_kv(decodes: int, longest: int, block_size: int) -> int:
    """KV slots of ``decodes`` decodes gathered as one batch padded to the longest
    context (``longest`` tokens, rounded up to whole blocks)."""
    return decodes * -(-longest // block_size) * block_size


@dataclass(frozen=True)
class CpuStepShape(StepShape):
    """A step's shape, and the KV slots the CPU runner gathers for its attention."""

    kv_gathered: int = 0  # each prefill chunk's context + the decodes' padded batch

    @classmethod
    def of(
        cls,
        plan: SchedulerOutput,
        block_size: int = 16,
        more_decodes: tuple[int, int, int] = (0, 0, 0),
    ) -> CpuStepShape:
        """The step that runs ``plan``, as the runner gathers it in blocks of
        ``block_size``. ``more_decodes``: decodes that run in the step beside the plan's
        (how many, their computed tokens summed, the most computed): the simulator's
        parked ones (``sim/decode_lane.py``)."""
        shape = StepShape.of(plan)
        count, computed, most = more_decodes
        decodes, longest, chunks_kv = count, most + 1 if count else 0, 0
        for item in plan.requests:
            n, start = len(item.token_ids), item.start_pos
            if n == 1 and start > 0:  # a decode, as ``StepShape.of`` tells them apart
                decodes += 1
                if start >= longest:
                    longest = start + 1
            else:
                chunks_kv += start + n
        added = computed + count  # each parked decode attends to its context and its token
        return cls(
            shape.num_tokens + count,
            shape.num_seqs + count,
            shape.context_tokens + added,
            shape.kv_tokens + added,
            shape.prompt_tokens,
            shape.prefills,
            shape.resumed,
            chunks_kv + padded_decode_kv(decodes, longest, block_size),
        )
