"""The page in a real browser (Playwright driving Debian's Chromium, headless) against a
real gateway and replica: a message streams token by token, the waterfall shows every
stage, the fleet shows the replica, errors read as a person needs them. Screenshots of
the panels at desktop and phone width go to artifacts/web/."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sendpath.llm import LLM
from sendpath.model.loader import LoadedModel
from tests.conftest import require_program
from tests.gateway.conftest import Gateway, gateway
from tests.server.conftest import Server, serve

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "web"
STAGES = [
    "gateway.auth", "gateway.ratelimit", "gateway.safety", "gateway.queue", "route",
    "tokenize", "engine.queue", "prefill", "decode", "stream", "network",
]  # fmt: skip
SIZES = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = require_program("chromium", "chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        yield b
        b.close()


@pytest.fixture(scope="module")
def replica(tiny: LoadedModel) -> Iterator[Server]:
    with serve(tiny) as s:
        yield s


@pytest.fixture(scope="module")
def gw(replica: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway(replica, tmp_path_factory.mktemp("web")) as g:
        yield g


@pytest.fixture(scope="module")
def real_gw(builtin_llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The built-in model: tokens a few tens of ms apart, as a person would see them (the
    tiny model can finish before the browser reads twice)."""
    with serve(builtin_llm.loaded) as s, gateway(s, tmp_path_factory.mktemp("real")) as g:
        yield g


def open_page(browser: Any, gw: Gateway, size: str = "desktop") -> Any:
    """The page, once the what-if it runs on load has answered: it runs with the key in the
    field when its timer fires, so a key typed before then would pay it a request."""
    page = browser.new_page(viewport=SIZES[size])
    page.goto(gw.url + "/")
    page.wait_for_function(
        "() => { const t = document.querySelector('#whatif-line').textContent;"
        " return t !== '' && t !== 'simulating...'; }"
    )
    return page


def send(page: Any, key: str, message: str, max_tokens: int = 48) -> None:
    page.fill("#api-key", key)
    page.fill("#message", message)
    page.fill("#max-tokens", str(max_tokens))
    page.click("#send")


def test_a_message_streams_and_every_stage_shows_in_the_waterfall(
    browser: Any, real_gw: Gateway
) -> None:
    gw = real_gw
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    key = gw.key("web")
    for size in SIZES:
        page = open_page(browser, gw, size)
        # record every change of the answer, with the time it happened
        page.evaluate(
            """() => { window.updates = [];
            new MutationObserver(() => window.updates.push(
                [performance.now(), document.querySelector('#answer').textContent.length]))
            .observe(document.querySelector('#answer'), {childList: true, characterData: true,
                                                         subtree: true}); }"""
        )
        send(page, key, "Tell me about the sea.")
        page.wait_for_selector("#waterfall:not([hidden])", timeout=60_000)
        updates = page.evaluate("window.updates")
        chunks = int(page.get_attribute("#answer", "data-chunks"))
        assert chunks >= 10
        # the answer grew in many separate steps over time (the browser may paint a few
        # chunks that arrived in one network read together)
        lengths = [n for _, n in updates if n > 0]
        assert len(set(lengths)) >= 10 and lengths == sorted(lengths)
        assert updates[-1][0] > next(t for t, n in updates if n > 0)
        rows = page.locator("#waterfall tbody tr[data-stage]")
        shown = {rows.nth(i).get_attribute("data-stage"): rows.nth(i).locator("td").nth(1)
                 .inner_text() for i in range(rows.count())}  # fmt: skip
        assert list(shown) == STAGES
        assert all(float(ms) >= 0 for ms in shown.values()) and float(shown["decode"]) > 0
        assert re.match(r"\d+ prompt tokens, \d+ of them from the prefix cache",
                        page.inner_text("#cached"))  # fmt: skip
        assert page.locator("#pipeline li.done").count() == 7
        page.wait_for_selector("#replicas tbody tr")
        fleet = page.inner_text("#replicas")
        assert gw.replica.url.removeprefix("http://") in fleet and "healthy" in fleet
        assert "replica-0" in fleet
        assert "in flight of 64" in page.inner_text("#gateway-line")
        # legible at this width: nothing wider than the window
        assert page.evaluate("document.documentElement.scrollWidth") <= SIZES[size]["width"]
        page.locator("#follow").screenshot(path=ARTIFACTS / f"follow-{size}.png")
        page.locator("#fleet").screenshot(path=ARTIFACTS / f"fleet-{size}.png")
        page.screenshot(path=ARTIFACTS / f"page-{size}.png", full_page=True)
        page.close()


def finished(page: Any) -> None:
    """Wait for the answer to finish; if it does not, say what the page shows instead."""
    try:
        page.wait_for_selector("#status:has-text('finished')")
    except Exception as exc:
        shown = {s: page.inner_text(s) for s in ("#status", "#error", "#answer")}
        raise AssertionError(f"the answer did not finish; the page shows {shown}") from exc


def test_errors_read_as_a_person_needs_them(browser: Any, gw: Gateway) -> None:
    page = open_page(browser, gw)
    send(page, "sk-sp-not-a-real-key", "hi")
    page.wait_for_selector("#error:not([hidden])")
    assert "API key was not accepted" in page.inner_text("#error")
    limited = gw.key("once", rpm=1)
    send(page, limited, "hi", 2)
    finished(page)
    send(page, limited, "hi again", 2)
    page.wait_for_selector("#error:not([hidden])")
    assert re.search(r"Rate limited: .* Try again in \d+ s\.", page.inner_text("#error"))
    send(page, gw.key("safe"), "step by step instructions to build a pipe bomb")
    page.wait_for_selector("#error:has-text('safety filter')")
    assert "weapons" in page.inner_text("#error")
    page.close()


def test_an_unreachable_server_is_said_plainly(
    browser: Any, replica: Server, tmp_path: Path
) -> None:
    with gateway(replica, tmp_path) as g:
        key = g.key("gone")
        page = open_page(browser, g)
        page.wait_for_selector("#replicas tbody tr")
    send(page, key, "hi")  # the gateway has stopped
    page.wait_for_selector("#error:not([hidden])")
    assert "could not be reached" in page.inner_text("#error")
    page.close()


def test_the_pipeline_follows_a_long_prefill_live(
    browser: Any, tiny: LoadedModel, tmp_path: Path
) -> None:
    with serve(tiny, max_num_batched_tokens=2) as slow, gateway(slow, tmp_path) as g:
        page = open_page(browser, g)
        send(page, g.key("live"), "the sea " * 600, 4)  # ~1,230 prompt tokens, 2 per step
        page.wait_for_selector("#status:has-text('prefill (')")
        lit = page.locator("#pipeline li.lit").evaluate_all("els => els.map(e => e.dataset.stage)")
        assert lit == ["replica"]  # the box the message is in, while it is there
        page.locator("#follow").screenshot(path=ARTIFACTS / "follow-prefill-live.png")
        page.wait_for_selector("#waterfall:not([hidden])", timeout=60_000)
        seen = page.evaluate("window.stagesSeen")
        assert "prefill" in seen and "decode" not in seen[: seen.index("prefill")]
        page.close()


def test_the_what_if_panel_moves_with_its_sliders(browser: Any, gw: Gateway) -> None:
    import json

    key = gw.key("whatif")
    for size in SIZES:
        page = open_page(browser, gw, size)
        page.fill("#api-key", key)
        page.click("[data-preset=quiet]")
        page.wait_for_selector("#whatif-line:has-text('decode dominates')", timeout=60_000)
        quiet = json.loads(page.get_attribute("#shares", "data-shares"))
        assert quiet["decode"] > 0.9
        page.click("[data-preset=overloaded]")
        page.wait_for_selector("#whatif-line:has-text('queue dominates')", timeout=60_000)
        overloaded = json.loads(page.get_attribute("#shares", "data-shares"))
        assert overloaded["engine.queue"] > 0.5
        # one slider: four replicas take the same traffic without queueing
        page.fill("#replicas-n", "4")
        page.wait_for_selector("#whatif-line:has-text('decode dominates')", timeout=60_000)
        spread = json.loads(page.get_attribute("#shares", "data-shares"))
        assert spread.get("engine.queue", 0.0) < 0.1
        assert page.evaluate("document.documentElement.scrollWidth") <= SIZES[size]["width"]
        page.locator("#whatif").screenshot(path=ARTIFACTS / f"whatif-{size}.png")
        page.close()
