"""The chat page at `/` (issue 22), driven in headless Chromium as a person would use it, against
`voltllm serve` on the default model, with and without `--api-key`: a question typed and sent
streams its answer into the page (the text grows over time, then completes), the conversation is
sent back as history, and a server with a key lists no model until the key is entered.

The browser is Debian's `chromium` (tools/test.sh installs it), driven by Playwright pointed at that
executable (no browser download). Set VOLTLLM_CHAT_SCREENSHOT=path to keep a screenshot."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from voltllm_cli import serving

pytestmark = pytest.mark.slow

API_KEY = "page-test-key"


def chromium_executable() -> str:
    """The system Chromium; a missing one fails where tools/test.sh requires it and skips elsewhere."""
    path = os.environ.get("VOLTLLM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    message = (
        "no chromium executable: install Debian's chromium package (apt-get install chromium), "
        "or set VOLTLLM_CHROMIUM to a Chromium binary"
    )
    if os.environ.get("VOLTLLM_REQUIRE_BROWSER") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = chromium_executable()
    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module", params=[None, API_KEY], ids=["open", "api-key"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str | None]]:
    key = request.param
    args = ["--num-kv-blocks", "256"] + (["--api-key", key] if key else [])
    with serving(*args) as (_, base):
        yield base, key


# Records (time, answer length, answer state) on every change to the conversation, so the test sees
# what a person would: the text of the last answer as it grows.
RECORD_GROWTH = """() => {
  window.__growth = [];
  const conversation = document.getElementById("conversation");
  new MutationObserver(() => {
    const answers = conversation.querySelectorAll(".message.assistant");
    const last = answers[answers.length - 1];
    if (last) window.__growth.push([performance.now(), last.firstChild ? last.firstChild.data.length : 0,
                                    last.dataset.state]);
  }).observe(conversation, { childList: true, subtree: true, characterData: true, attributes: true });
}"""


def send(page: Page, question: str) -> dict:
    """Types `question`, presses Enter, waits for the answer to complete; returns the answer's text,
    its meta line and the growth record."""
    page.evaluate(RECORD_GROWTH)
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    answer = page.locator(".message.assistant").last
    page.wait_for_function(
        "() => { const a = [...document.querySelectorAll('.message.assistant')].pop();"
        " return a && a.dataset.state !== 'streaming'; }",
        timeout=120_000,
    )
    return {
        "state": answer.get_attribute("data-state"),
        "text": answer.evaluate("a => a.firstChild.data"),
        "meta": answer.locator(".meta").text_content(),
        "growth": page.evaluate("window.__growth"),
    }


def test_a_question_streams_its_answer_into_the_page(
    browser: Browser, server: tuple[str, str | None], tmp_path: Path
) -> None:
    base, key = server
    page = browser.new_page(viewport={"width": 1000, "height": 640})
    sent: list[dict] = []
    page.on(
        "request",
        lambda r: (
            sent.append({"body": json.loads(r.post_data), "auth": r.headers.get("authorization")})
            if r.url.endswith("/v1/chat/completions")
            else None
        ),
    )
    page.goto(base)
    if key:
        # Without the key the page can list no model and says so.
        page.wait_for_function("() => document.getElementById('status').textContent.includes('API key')")
        assert page.locator("#model option").count() == 0
        page.fill("#api-key", key)
        page.press("#api-key", "Tab")  # `change` reloads the models with the key
    page.wait_for_function("() => document.getElementById('model').options.length > 0")
    assert page.locator("#model").input_value() == "SmolLM2-135M-Instruct"
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "40")

    first = send(page, "What is the capital of France?")
    assert first["state"] == "done", first
    assert "Paris" in first["text"]
    assert "tokens in" in first["meta"]
    streaming = [(t, n) for t, n, state in first["growth"] if state == "streaming" and n > 0]
    lengths = [n for _, n in streaming]
    # Streamed, not delivered at once: several partial lengths, growing, over a measurable time,
    # all shorter than the final text.
    assert len(set(lengths)) >= 3, first["growth"]
    assert lengths == sorted(lengths)
    assert lengths[0] < len(first["text"])
    assert streaming[-1][0] - streaming[0][0] > 20  # ms between the first and last partial text

    second = send(page, "Say that again in one word.")
    assert second["state"] == "done", second
    assert second["text"]
    request = sent[-1]["body"]
    assert [m["role"] for m in request["messages"]] == ["user", "assistant", "user"]
    assert request["messages"][1]["content"] == first["text"]
    assert request["temperature"] == 0 and request["max_tokens"] == 40 and request["stream"] is True
    assert sent[-1]["auth"] == (f"Bearer {key}" if key else None)

    page.screenshot(path=str(tmp_path / "chat_page.png"))
    if not key and os.environ.get("VOLTLLM_CHAT_SCREENSHOT"):
        page.screenshot(path=os.environ["VOLTLLM_CHAT_SCREENSHOT"])
    page.close()
