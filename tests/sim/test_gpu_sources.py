"""Published GPU measurement sources: a complete file loads; one lacking a required field
is refused with a message naming the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from sendpath.sim.gpu_sources import SourceFileError, load_source, load_sources

GOOD: dict[str, Any] = {
    "source": {
        "title": "A performance post",
        "url": "https://example.org/post",
        "publisher": "Example",
        "kind": "blog",
        "date": "2024-09-05",
        "engine": "vLLM",
        "engine_version": "0.6.0",
    },
    "setup": {
        "model": "Llama-3.1-8B-Instruct",
        "params_b": 8.03,
        "precision": "bf16",
        "gpu": "H100-SXM-80GB",
        "gpu_count": 1,
        "tp": 1,
        "max_num_seqs": None,
        "max_num_batched_tokens": None,
        "other": "",
    },
    "measurements": [
        {
            "id": "r32",
            "workload": {
                "dataset": "random",
                "input_len": 1024,
                "output_len": 128,
                "num_prompts": 500,
                "request_rate": 32,
                "concurrency": None,
                "offline": False,
            },
            "figures": {"output_throughput_tok_s": 3500.5, "tpot_p50_ms": 12.5},
            "quote": "3500.5 tok/s, 12.5 ms TPOT",
        }
    ],
}


def write(tmp_path: Path, data: dict[str, Any], name: str = "source.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_a_complete_source_loads(tmp_path: Path) -> None:
    source = load_source(write(tmp_path, GOOD))
    assert source.name == "source" and source.engine == "vLLM" and source.setup.tp == 1
    assert source.setup.max_num_seqs is None and source.setup.params_b == 8.03
    (m,) = source.measurements
    assert m.workload.input_len == 1024 and m.workload.request_rate == 32
    assert m.figures == {"output_throughput_tok_s": 3500.5, "tpot_p50_ms": 12.5}
    assert "https://example.org/post" in source.citation
    assert [s.name for s in load_sources(tmp_path)] == ["source"]


@pytest.mark.parametrize(
    ("where", "key", "named"),
    [
        ("source", "url", "source.url is missing"),
        ("source", "engine_version", "source.engine_version is missing"),
        ("source", "date", "source.date is missing"),
        ("setup", "model", "setup.model is missing"),
        ("setup", "precision", "setup.precision is missing"),
        ("setup", "gpu", "setup.gpu is missing"),
        ("setup", "gpu_count", "setup.gpu_count is missing"),
        ("setup", "tp", "setup.tp is missing"),
        ("workload", "input_len", "measurements[0].workload.input_len is missing"),
        ("workload", "offline", "measurements[0].workload.offline is missing"),
        ("measurement", "quote", "measurements[0].quote is missing"),
        ("measurement", "figures", "measurements[0].figures must be an object"),
    ],
)
def test_a_source_without_a_required_field_is_refused_naming_it(
    tmp_path: Path, where: str, key: str, named: str
) -> None:
    data = copy.deepcopy(GOOD)
    part = {
        "source": data["source"],
        "setup": data["setup"],
        "measurement": data["measurements"][0],
        "workload": data["measurements"][0]["workload"],
    }[where]
    del part[key]
    with pytest.raises(SourceFileError, match=named.replace("[", r"\[").replace("]", r"\]")):
        load_source(write(tmp_path, data))


def test_sharegpt_needs_no_lengths_but_every_workload_needs_a_load(tmp_path: Path) -> None:
    data = copy.deepcopy(GOOD)
    workload = data["measurements"][0]["workload"]
    workload.update(dataset="sharegpt", input_len=None, output_len=None)
    assert load_source(write(tmp_path, data)).measurements[0].workload.input_len is None
    workload.update(request_rate=None)
    with pytest.raises(SourceFileError, match="no request_rate or concurrency"):
        load_source(write(tmp_path, data))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"figures": {"speed": 3.0}}, "figures has speed; the figures are"),
        ({"figures": {}}, "figures has no figure"),
        ({"figures": {"tpot_p50_ms": -1}}, "tpot_p50_ms must be a number > 0"),
    ],
)
def test_figures_are_the_named_positive_numbers(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    data = copy.deepcopy(GOOD)
    data["measurements"][0].update(change)
    with pytest.raises(SourceFileError, match=message):
        load_source(write(tmp_path, data))


def test_a_precision_or_kind_not_known_lists_the_known_ones(tmp_path: Path) -> None:
    data = copy.deepcopy(GOOD)
    data["setup"]["precision"] = "int3"
    with pytest.raises(SourceFileError, match=r"setup\.precision is 'int3'; use one of bf16"):
        load_source(write(tmp_path, data))
    with pytest.raises(SourceFileError, match="source must be an object"):
        load_source(write(tmp_path, {}, "empty.json"))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SourceFileError, match="not JSON"):
        load_source(tmp_path / "broken.json")


def test_a_limit_is_stated_or_the_engines_cited_default_or_unknown(tmp_path: Path) -> None:
    data = copy.deepcopy(GOOD)
    data["setup"].update(
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        engine_defaults=["max_num_batched_tokens"],
        engine_defaults_from="vllm/config.py L973-981 at v0.6.0",
    )
    setup = load_source(write(tmp_path, data)).setup
    assert setup.limit_basis("max_num_seqs") == "stated"
    assert setup.limit_basis("max_num_batched_tokens") == "engine default"
    assert setup.engine_defaults_from == "vllm/config.py L973-981 at v0.6.0"
    assert load_source(write(tmp_path, GOOD)).setup.limit_basis("max_num_seqs") == "unknown"
    with pytest.raises(ValueError, match="'model' is not a batch limit"):
        setup.limit_basis("model")
    data["setup"].update(engine_defaults=None, engine_defaults_from=None)  # JSON null: none
    assert load_source(write(tmp_path, data)).setup.engine_defaults == ()


def test_the_shipped_sources_carry_their_engines_limits() -> None:
    """The limits the calibration replays, as their files cite them (benchmarks/README.md)."""
    found = {s.name: s.setup for s in load_sources()}
    tp8 = found["trtllm-docs-v0.14.0-llama31-70b-fp16-h100-tp8"]
    assert (tp8.max_num_seqs, tp8.max_num_batched_tokens) == (8192, 16384)
    assert "tp8_pp1" in tp8.engine_defaults_from
    tp4 = found["trtllm-docs-v0.14.0-llama31-70b-fp16-h100-tp4"]
    assert (tp4.max_num_seqs, tp4.max_num_batched_tokens) == (2048, 1024)
    lmdeploy = found["lmdeploy-docs-2023-12-06-llama2-7b-fp16-a100"]
    assert lmdeploy.limit_basis("max_num_seqs") == "stated"
    for setup in found.values():
        assert all(setup.limit_basis(k) == "engine default" for k in setup.engine_defaults)
        assert bool(setup.engine_defaults) == bool(setup.engine_defaults_from)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"max_num_seqs": 256, "engine_defaults": ["max_num_seqs"]},
            r"setup\.engine_defaults_from is missing: say where",
        ),
        (
            {"max_num_seqs": 256, "engine_defaults": ["max_num_seqs"], "engine_defaults_from": " "},
            r"setup\.engine_defaults_from is missing",
        ),
        (
            {"engine_defaults": ["max_num_seqs"], "engine_defaults_from": "arg_utils.py"},
            r"setup\.engine_defaults names max_num_seqs, but setup\.max_num_seqs has no value: "
            r"give it the engine's default",
        ),
        (
            {"max_num_seqs": 256, "engine_defaults": ["max_seqs"], "engine_defaults_from": "x"},
            r"setup\.engine_defaults names 'max_seqs' which is no limit; name each of "
            r"max_num_seqs, max_num_batched_tokens at most once",
        ),
        (
            {
                "max_num_seqs": 256,
                "engine_defaults": ["max_num_seqs", "max_num_seqs"],
                "engine_defaults_from": "x",
            },
            r"setup\.engine_defaults names 'max_num_seqs' twice",
        ),
        (
            {"max_num_seqs": 256, "engine_defaults": "max_num_seqs", "engine_defaults_from": "x"},
            r"setup\.engine_defaults is 'max_num_seqs'; it must be a JSON list naming some of",
        ),
        (
            {"max_num_seqs": 256, "engine_defaults": [True], "engine_defaults_from": "x"},
            r"setup\.engine_defaults is \[True\]; it must be a JSON list",
        ),
        (
            {"max_num_seqs": 256, "engine_defaults_from": "arg_utils.py L90"},
            r"setup\.engine_defaults_from cites defaults, but setup\.engine_defaults names none: "
            r"name the limits",
        ),
        (
            {"max_num_seqs": 256, "engine_default": ["max_num_seqs"]},
            r"setup has engine_default; its fields are model, params_b",
        ),
    ],
)
def test_an_engine_default_without_its_value_or_citation_is_refused(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    data = copy.deepcopy(GOOD)
    data["setup"].update(change)
    with pytest.raises(SourceFileError, match=message):
        load_source(write(tmp_path, data))
