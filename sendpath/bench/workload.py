"""What `sendpath bench` sends: datasets of chat conversations, lengths in tokens.

Prompts are built from common English words that most tokenizers (SmolLM2's, Llama's,
GPT's) encode as one token each with their leading space, so ``input_len`` words is about
``input_len`` prompt tokens on any server; the real counts come back in ``usage``.

- ``random``: independent single-turn requests of ``input_len`` words.
- ``shared-prefix``: multi-turn conversations that share one system prompt; each turn adds
  a question of ``input_len`` words and resends the whole history (the answers included),
  so prefix caching and prefix-aware routing have something to find.
- ``long-document``: a pasted document of ``input_len`` words and a short question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["DATASETS", "Conversation", "LengthSpec", "build", "random_text"]

DATASETS = ("random", "shared-prefix", "long-document")
_COMMON = (
        "the of and to in is was for on are as with his they at be this from have or by "
        "one had not but what all were when we there can an your which their said if do "
        "will each about how up out them then she many some so these would other into "
        "has more her two like him see time could no make than first been its who now "
        "people my made over did down only way find use may water long little very after "
        "words called just where most know get through back much go good new write our "
        "me man too any day same right look think also around another came come work "
        "three must because does part even place well"
)  # fmt: skip
_WORDS = tuple(_COMMON.split())
SYSTEM_WORDS = 120


@dataclass(frozen=True)
class LengthSpec:
    """A fixed length (``128``) or a uniform range (``64-256``)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        try:
            low, _, high = text.partition("-")
            spec = cls(int(low), int(high or low))
        except ValueError:
            raise ValueError(f"a length is N or LOW-HIGH (tokens), got {text!r}") from None
        if spec.low < 1 or spec.high < spec.low:
            raise ValueError(f"a length must be >= 1 and LOW <= HIGH, got {text!r}")
        return spec

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2


@dataclass
class Conversation:
    """One conversation: its system prompt (if any), its user turns, and per turn the
    number of tokens to generate. Single-turn datasets have one turn."""

    system: str | None
    turns: list[str]
    output_lens: list[int]
    history: list[dict[str, str]] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The messages of ``turn``: the system prompt, the history, the next question."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.history, {"role": "user", "content": self.turns[turn]}]

    def answered(self, turn: int, answer: str) -> None:
        self.history += [
            {"role": "user", "content": self.turns[turn]},
            {"role": "assistant", "content": answer},
        ]


def random_text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def build(
    dataset: str,
    num_requests: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    seed: int = 0,
    turns: int = 4,
) -> list[Conversation]:
    """Conversations totalling ``num_requests`` requests (the same for the same seed)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; use one of {', '.join(DATASETS)}")
    rng = random.Random(seed)
    if dataset == "random":
        return [
            Conversation(None, [random_text(rng, input_len.sample(rng))], [output_len.sample(rng)])
            for _ in range(num_requests)
        ]
    if dataset == "long-document":
        out = []
        for _ in range(num_requests):
            document = random_text(rng, input_len.sample(rng))
            question = f"Here is a document:\n\n{document}\n\nSummarise it in one sentence."
            out.append(Conversation(None, [question], [output_len.sample(rng)]))
        return out
    system = "You are a helpful assistant. " + random_text(rng, SYSTEM_WORDS)
    conversations = []
    left = num_requests
    while left > 0:
        n = min(turns, left)
        conversations.append(
            Conversation(
                system,
                [random_text(rng, input_len.sample(rng)) for _ in range(n)],
                [output_len.sample(rng) for _ in range(n)],
            )
        )
        left -= n
    return conversations
