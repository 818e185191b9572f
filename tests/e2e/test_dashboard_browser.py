"""The live KV page in a real headless Chromium (Debian's, driven by Playwright) against a running
``folio serve`` (tiny random model with SmolLM2's tokenizer, 256 blocks, a host tier, an API key): while a
forked request (n=2) runs among other traffic, the grid shows blocks shared with ref count 2 and
pinning the request (a click on its row) shows its block table; after it finishes, its blocks show as cached.
Screenshots land in ``tests/artifacts/`` (git-ignored)."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from folio.testing.models import write_tiny_chat_model
from folio.testing.server import start_server, stop_server

KEY = "dashboard-key"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# a prompt of several full blocks: the fork shares them (and the partly filled last one)
PROMPT = " ".join(f"line {i} of the shared prompt" for i in range(20))


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:  # never a silent skip: CI must run this
        pytest.fail("chromium is missing: `bash scripts/setup.sh --test` installs Debian's chromium package")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_tokenizer_dir):
    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-dash"), smollm_tokenizer_dir, max_position_embeddings=1024)
    srv = start_server(model, "--served-model-name", "m", "--dtype", "float32", "--num-kv-blocks", "256",
                       "--block-size", "16", "--max-num-seqs", "8", "--num-host-blocks", "16", "--api-key", KEY)
    yield srv
    stop_server(srv)


def post(base: str, body: dict, timeout_s: float = 120.0) -> dict:
    req = urllib.request.Request(base + "/completions", json.dumps({"model": "m", **body}).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


@pytest.mark.slow  # about 7 s: a server and a browser
def test_the_page_draws_shared_then_cached_blocks_of_a_forked_request(server):
    from playwright.sync_api import sync_playwright

    origin = server.base_url.removesuffix("/v1")
    with pytest.raises(urllib.error.HTTPError) as refused:  # the data needs the key
        urllib.request.urlopen(origin + "/dashboard/api/state", timeout=10)
    assert refused.value.code == 401
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(origin + "/dashboard")
            page.wait_for_selector("#key-form:not([hidden])", timeout=20_000)  # asked for the key
            page.fill("#key-input", KEY)
            page.click("#key-form button")
            page.wait_for_selector("#device-grid .cell", timeout=20_000)
            assert page.locator("#device-grid .cell").count() == 256  # one cell per block
            assert page.locator("#device-grid .cell.s-free").count() == 256
            fork = run_in_background(lambda: post(server.base_url, {
                "prompt": PROMPT, "n": 2, "max_tokens": 700, "ignore_eos": True, "temperature": 1.0, "seed": 1}))
            traffic = [run_in_background(lambda i=i: post(server.base_url, {
                "prompt": f"request {i} of the background traffic", "max_tokens": 64, "ignore_eos": True}))
                for i in range(3)]
            # while the fork runs: its prompt blocks are held by both choices
            page.wait_for_selector('#device-grid .cell.s-shared[data-refs="2"]', timeout=60_000)
            row = page.locator("#requests tbody tr", has=page.locator("td:nth-child(3):not(:text-is('0'))")).first
            # pinned by a click, not only hovered: a background request that finishes removes its
            # row above this one, and the row that then lies under a still mouse takes the hover
            row.click()
            page.wait_for_selector("#table-view:not([hidden]) .chip.shared", timeout=20_000)
            # the table and the grid come from one snapshot: one outlined cell per block of the table
            outlined, chips, shared_chips = page.evaluate(
                "[document.querySelectorAll('#device-grid .cell.hl').length,"
                " document.querySelectorAll('#table-blocks .chip').length,"
                " document.querySelectorAll('#table-blocks .chip.shared').length]")
            assert outlined == chips and shared_chips >= 8  # the prompt's full blocks at least
            page.screenshot(path=str(ARTIFACTS / "dashboard-fork.png"), full_page=True)
            result = fork.join_result()
            for t in traffic:
                t.join_result()
            assert [len(c["text"]) > 0 for c in result["choices"]] == [True, True]
            # finished: nothing held, the full blocks it computed stay cached (free, findable)
            page.mouse.move(0, 0)
            page.wait_for_function("document.querySelectorAll('#device-grid .cell.s-shared').length === 0"
                                   " && document.querySelectorAll('#device-grid .cell.s-owned').length === 0"
                                   " && document.querySelectorAll('#device-grid .cell.s-cached').length >= 8",
                                   timeout=30_000)
            page.wait_for_function("document.querySelector('#plot-step_ms').dataset.value !== ''", timeout=20_000)
            assert page.locator("#plots .plot").count() == 11
            assert page.locator("#plot-step_ms polyline").get_attribute("points")
            assert page.locator("#host-grid .cell.s-free").count() == 16  # the host tier, unused
            page.screenshot(path=str(ARTIFACTS / "dashboard-after.png"), full_page=True)
            # the key in the address once: the page uses it and drops it from the address bar
            keyed = browser.new_page()
            keyed.goto(origin + f"/dashboard?key={KEY}&cells=64")
            keyed.wait_for_selector("#device-grid .cell.s-cached", timeout=20_000)
            assert keyed.locator("#device-grid .cell").count() == 64  # four blocks a cell
            assert KEY not in keyed.url and keyed.locator("#key-form").is_hidden()
        finally:
            browser.close()


class run_in_background(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except Exception as exc:  # handed to the test's thread
            self.error = exc

    def join_result(self, timeout_s: float = 120.0):
        self.join(timeout_s)
        assert not self.is_alive(), "the request did not finish"
        if self.error is not None:
            raise self.error
        return self.result
