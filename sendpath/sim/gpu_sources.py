"""Published GPU serving measurements, one JSON file a source, that the GPU cost model is
checked against (issue 43).

A source says who measured what (title, URL, publisher, kind, date, engine and version),
on what (model and its size, precision, GPU and how many, tensor parallelism, the engine's
batch limits where known), and its figures: for each workload (dataset, input and output
lengths, how many prompts, the request rate, the concurrency, or all at once), the
throughputs and latencies it published, with the exact words they were read from
(``quote``). Nothing is estimated from a chart: a figure not printed as a number is not
kept. A file that lacks a required field is refused with a message naming the field.

A batch limit is either stated by the source (its launch command or build settings) or,
where the source sets none (it runs the engine with its defaults, or does not say how it
built it), the engine's own default at that version: such a limit is named in
``engine_defaults``, and ``engine_defaults_from`` says where the default was read (file
and lines at the version's tag or the commit read, or release notes) and what the source
leaves unsaid, so that nobody mistakes it for the source's word, and nobody has to read
the figures to find it (which would make the held-out check blind). ``setup`` takes no
other fields than these: a misspelt ``engine_defaults`` would leave its limits stated.

    {"source": {"title", "url", "publisher", "kind", "date", "engine", "engine_version"},
     "setup": {"model", "params_b", "precision", "gpu", "gpu_count", "tp",
               "max_num_seqs"?, "max_num_batched_tokens"?,
               "engine_defaults"?: [LIMITS named], "engine_defaults_from"?, "other"?},
     "measurements": [{"id", "workload": {"dataset", "input_len"?, "output_len"?,
                        "num_prompts"?, "request_rate"?, "concurrency"?, "offline"},
                       "figures": {FIGURES: number, ...}, "quote", "note"?}]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FIGURES",
    "LIMITS",
    "SOURCES",
    "Measurement",
    "Setup",
    "Source",
    "SourceFileError",
    "Workload",
    "load_source",
    "load_sources",
]

SOURCES = Path(__file__).parent / "gpu_sources"  # the files shipped with sendpath
FIGURES = (
    "output_throughput_tok_s",
    "total_throughput_tok_s",
    "request_throughput_req_s",
    "ttft_p50_ms",
    "ttft_mean_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_mean_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_mean_ms",
    "e2e_p50_s",
)
KINDS = ("blog", "docs", "paper", "mlperf", "repo")
PRECISIONS = ("bf16", "fp16", "fp8")
LIMITS = ("max_num_seqs", "max_num_batched_tokens")
SETUP_FIELDS = ("model", "params_b", "precision", "gpu", "gpu_count", "tp", *LIMITS,
                "engine_defaults", "engine_defaults_from", "other")  # fmt: skip


class SourceFileError(ValueError):
    """A source file that cannot be used, and why (the field, where it is missing)."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"GPU measurement source {str(path)!r}: {problem}")


@dataclass(frozen=True)
class Setup:
    model: str
    params_b: float  # billions of parameters
    precision: str  # bf16, fp16 or fp8
    gpu: str
    gpu_count: int
    tp: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    engine_defaults: tuple[str, ...] = ()  # the LIMITS that are the engine's defaults
    engine_defaults_from: str = ""  # where those defaults were read
    other: str = ""

    def limit_basis(self, limit: str) -> str:
        """How ``limit`` (one of LIMITS) is known: stated, the engine's default, or unknown."""
        if limit not in LIMITS:
            raise ValueError(f"{limit!r} is not a batch limit; the limits are {', '.join(LIMITS)}")
        if getattr(self, limit) is None:
            return "unknown"
        return "engine default" if limit in self.engine_defaults else "stated"


@dataclass(frozen=True)
class Workload:
    dataset: str  # random, fixed, sharegpt, ...
    input_len: int | None
    output_len: int | None
    num_prompts: int | None
    request_rate: float | None  # requests/s; None: offline or driven by concurrency
    concurrency: int | None
    offline: bool  # every request at once


@dataclass(frozen=True)
class Measurement:
    id: str
    workload: Workload
    figures: dict[str, float]
    quote: str
    note: str = ""


@dataclass(frozen=True)
class Source:
    name: str  # the file's stem
    title: str
    url: str
    publisher: str
    kind: str
    date: str
    engine: str
    engine_version: str
    setup: Setup
    measurements: tuple[Measurement, ...]

    @property
    def citation(self) -> str:
        engine = f"{self.engine} {self.engine_version}"
        return f"{self.publisher}, {self.title} ({self.date}; {engine}): {self.url}"


class _Fields:
    """Reads one JSON object's fields, naming ``where`` in what it refuses."""

    def __init__(self, path: Path, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise SourceFileError(path, f"{where} must be an object")
        self.path, self.data, self.where = path, data, where

    def _field(self, key: str) -> str:
        return f"{self.where}.{key}"

    def text(self, key: str, optional: bool = False) -> str:
        value = self.data.get(key)
        if optional and (value is None or value == ""):
            return ""
        if not isinstance(value, str) or not value.strip():
            raise SourceFileError(self.path, self._missing(key, "a non-empty string"))
        return value

    def number(self, key: str, optional: bool = False, whole: bool = False) -> Any:
        value = self.data.get(key)
        if value is None and optional:
            return None
        kind = int if whole else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
            what = "a whole number > 0" if whole else "a number > 0"
            raise SourceFileError(self.path, self._missing(key, what))
        return value

    def flag(self, key: str) -> bool:
        value = self.data.get(key)
        if not isinstance(value, bool):
            raise SourceFileError(self.path, self._missing(key, "true or false"))
        return value

    def choice(self, key: str, choices: tuple[str, ...]) -> str:
        value = self.text(key)
        if value not in choices:
            raise SourceFileError(
                self.path, f"{self._field(key)} is {value!r}; use one of {', '.join(choices)}"
            )
        return value

    def _missing(self, key: str, what: str) -> str:
        if key not in self.data or self.data[key] is None:
            return f"{self._field(key)} is missing (it must be {what})"
        return f"{self._field(key)} must be {what}, not {self.data[key]!r}"


def _workload(path: Path, data: Any, where: str) -> Workload:
    f = _Fields(path, data, where)
    dataset = f.text("dataset")
    lengths_needed = dataset in ("random", "fixed")
    workload = Workload(
        dataset,
        f.number("input_len", optional=not lengths_needed, whole=True),
        f.number("output_len", optional=not lengths_needed, whole=True),
        f.number("num_prompts", optional=True, whole=True),
        f.number("request_rate", optional=True),
        f.number("concurrency", optional=True, whole=True),
        f.flag("offline"),
    )
    if not workload.offline and workload.request_rate is None and workload.concurrency is None:
        raise SourceFileError(
            path, f"{where} has no request_rate or concurrency and is not offline: no load"
        )
    return workload


def _setup(path: Path, data: Any) -> Setup:
    f = _Fields(path, data, "setup")
    unknown = sorted(set(f.data) - set(SETUP_FIELDS))
    if unknown:  # a misspelt engine_defaults would leave its limits read as stated
        raise SourceFileError(
            path, f"setup has {', '.join(unknown)}; its fields are {', '.join(SETUP_FIELDS)}"
        )
    limits = {k: f.number(k, optional=True, whole=True) for k in LIMITS}
    defaults = f.data.get("engine_defaults")
    defaults = [] if defaults is None else defaults  # null, as for every optional field
    listed = ", ".join(LIMITS)
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise SourceFileError(
            path,
            f"setup.engine_defaults is {defaults!r}; it must be a JSON list naming "
            f"some of {listed}",
        )
    for limit in defaults:
        if limit not in LIMITS or defaults.count(limit) > 1:
            raise SourceFileError(
                path,
                f"setup.engine_defaults names {limit!r} "
                f"{'twice' if limit in LIMITS else 'which is no limit'}; name each of "
                f"{listed} at most once",
            )
        if limits[limit] is None:
            raise SourceFileError(
                path,
                f"setup.engine_defaults names {limit}, but setup.{limit} has no value: "
                f"give it the engine's default, or drop {limit} from engine_defaults",
            )
    if defaults and not str(f.data.get("engine_defaults_from") or "").strip():
        raise SourceFileError(
            path,
            "setup.engine_defaults_from is missing: say where the defaults that "
            "setup.engine_defaults names were read (file and lines, or release notes)",
        )
    cited = f.text("engine_defaults_from", optional=True)
    if cited and not defaults:
        raise SourceFileError(
            path,
            "setup.engine_defaults_from cites defaults, but setup.engine_defaults "
            "names none: name the limits it covers there, or remove it",
        )
    return Setup(
        f.text("model"),
        float(f.number("params_b")),
        f.choice("precision", PRECISIONS),
        f.text("gpu"),
        f.number("gpu_count", whole=True),
        f.number("tp", whole=True),
        limits["max_num_seqs"],
        limits["max_num_batched_tokens"],
        tuple(defaults),
        cited,
        f.text("other", optional=True),
    )


def _measurement(path: Path, data: Any, where: str) -> Measurement:
    f = _Fields(path, data, where)
    figures = _Fields(path, data.get("figures"), f"{where}.figures")
    found = {k: float(figures.number(k)) for k in FIGURES if k in figures.data}
    unknown = sorted(set(figures.data) - set(FIGURES))
    if unknown:
        raise SourceFileError(
            path, f"{where}.figures has {', '.join(unknown)}; the figures are {', '.join(FIGURES)}"
        )
    if not found:
        raise SourceFileError(path, f"{where}.figures has no figure ({', '.join(FIGURES)})")
    return Measurement(
        f.text("id"),
        _workload(path, data.get("workload"), f"{where}.workload"),
        found,
        f.text("quote"),
        f.text("note", optional=True),
    )


def load_source(path: str | Path) -> Source:
    """One source file; ``SourceFileError`` (a ValueError) names what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SourceFileError(path, "no such file") from None
    except (OSError, ValueError) as exc:
        raise SourceFileError(path, f"not JSON, or unreadable ({exc})") from None
    top = _Fields(path, data, "the file")
    src = _Fields(path, top.data.get("source"), "source")
    listed = top.data.get("measurements")
    if not isinstance(listed, list) or not listed:
        raise SourceFileError(path, "measurements is missing (a list of at least one)")
    measurements = tuple(_measurement(path, m, f"measurements[{i}]") for i, m in enumerate(listed))
    ids = [m.id for m in measurements]
    if len(set(ids)) != len(ids):
        raise SourceFileError(path, "two measurements share an id")
    return Source(
        path.stem,
        src.text("title"),
        src.text("url"),
        src.text("publisher"),
        src.choice("kind", KINDS),
        src.text("date"),
        src.text("engine"),
        src.text("engine_version"),
        _setup(path, top.data.get("setup")),
        measurements,
    )


def load_sources(folder: str | Path = SOURCES) -> list[Source]:
    """Every ``*.json`` source in ``folder``, by name."""
    return [load_source(p) for p in sorted(Path(folder).glob("*.json"))]
