"""The chat page at `GET /`, driven in a real headless Chromium against real `just serve` processes.

Chromium comes from the system (Debian's `chromium`); Playwright only drives it and downloads
nothing. Without a browser these tests skip, saying why; with ASTRAI_REQUIRE_BROWSER=1 (set
by .ci/run) a missing browser fails them instead.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import httpx
import pytest
from page_server import (
    HELLO_A,
    HELLO_Q,
    HTML_A,
    HTML_Q,
    TICK_Q,
    build_page_model,
    serve_processes,
)

API_KEY = "sk-page-test"
NAME = "page-test"
REPLY = ".msg.assistant .body"
DONE = ".msg.assistant:not(.pending)"


def chromium_path() -> str | None:
    """ASTRAI_CHROMIUM, else the system's chromium on PATH."""
    path = os.environ.get("ASTRAI_CHROMIUM") or shutil.which("chromium")
    return path or shutil.which("chromium-browser")


def no_browser(reason: str):
    if os.environ.get("ASTRAI_REQUIRE_BROWSER") == "1":
        pytest.fail(f"ASTRAI_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(f"{reason}; the chat page tests need it (apt-get install chromium)")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(open URL, URL of a server started with --api-key), both serving the page model."""
    model = build_page_model(tmp_path_factory.mktemp("page-model"))
    with serve_processes(model, [], ["--api-key", API_KEY]) as urls:
        yield urls


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        no_browser("the playwright package is not installed")
    executable = chromium_path()
    if executable is None or not os.path.isfile(executable):
        no_browser(f"no Chromium on this machine ({executable or 'chromium is not on PATH'})")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable)
        yield browser
        browser.close()


class Page:
    """A fresh browser profile (empty localStorage) on one page, recording what went wrong."""

    def __init__(self, browser, url: str, **context_args):
        self.context = browser.new_context(**context_args)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", self._dialog)
        self.page.goto(url)

    def _dialog(self, dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def settings(self, **values: str) -> None:
        if self.page.is_hidden("#settings"):
            self.page.click("#toggle-settings")
        for field, value in values.items():
            self.page.fill(f"#{field.replace('_', '-')}", value)

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def reply(self, index: int = -1) -> str:
        return self.page.locator(REPLY).nth(index).text_content()

    def wait_reply_done(self, count: int = 1) -> None:
        self.page.wait_for_function(
            f"() => document.querySelectorAll('{DONE}').length >= {count}", timeout=30_000
        )

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def open_page(browser, servers):
    page = Page(browser, servers[0])
    yield page
    page.close()


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats").json()


# ---------------------------------------------------------------- without a browser


def test_page_routes_are_public_and_send_security_headers(servers):
    for url in servers:  # the page holds no secret: it loads without the key
        response = httpx.get(f"{url}/")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        csp = response.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert "unsafe-inline" not in csp and "http" not in csp
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
        html = response.text
        assert all(' src="/static/' in tag for tag in re.findall(r"<script[^>]*>", html))
        assert " style=" not in html and "http" not in html  # nothing inline, nothing remote
    script = httpx.get(f"{servers[0]}/static/chat.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert script.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(f"{servers[0]}/static/..%2Fapp.py").status_code == 404
    assert httpx.get(f"{servers[0]}/static/missing.js").status_code == 404
    assert httpx.get(f"{servers[1]}/v1/models").status_code == 401  # the API still needs it


# ---------------------------------------------------------------- in Chromium


def test_page_shows_the_model_and_streams_a_reply_over_many_frames(open_page):
    page = open_page.page
    page.wait_for_selector(".model.online")
    assert page.text_content("#model-name") == NAME
    open_page.settings(temperature="0", max_tokens="1000")
    page.evaluate(
        """() => {
        window.lengths = [];
        const sample = () => {
          const bodies = document.querySelectorAll('.msg.assistant .body');
          if (bodies.length) window.lengths.push(bodies[bodies.length - 1].textContent.length);
          requestAnimationFrame(sample);
        };
        requestAnimationFrame(sample);
    }"""
    )
    open_page.send(TICK_Q)
    open_page.wait_reply_done()
    reply = open_page.reply()
    assert reply.split() == ["tick"] * 1000
    partial = {n for n in page.evaluate("window.lengths") if 0 < n < len(reply)}
    assert len(partial) >= 3, f"the reply appeared in {len(partial) + 1} paints"
    meta = page.text_content(".msg.assistant .stats")
    assert re.search(
        r"\d+ ms to first token · [\d.]+ tokens/s · 1000 tokens · finish: length", meta
    )
    assert open_page.errors == []


def test_stop_ends_the_stream_and_the_server_frees_the_request(open_page, servers):
    page, url = open_page.page, servers[0]
    page.wait_for_selector(".model.online")
    open_page.settings(temperature="0", max_tokens="3500")
    before = stats(url)["requests_aborted"]
    open_page.send(TICK_Q)
    page.wait_for_function(f"() => document.querySelector('{REPLY}')?.textContent.length > 20")
    page.click("#stop")
    open_page.wait_reply_done()
    assert "finish: stopped" in page.text_content(".msg.assistant .stats")
    assert page.is_visible("#send") and page.is_hidden("#stop")
    stopped = open_page.reply()
    deadline = time.monotonic() + 10
    while (now := stats(url))["requests_aborted"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert now["requests_aborted"] == before + 1
    assert (now["running"], now["waiting"], now["pages_used"]) == (0, 0, 0)
    assert open_page.reply() == stopped  # nothing arrived after Stop
    assert len(stopped.split()) < 3500
    assert open_page.errors == []


def test_html_in_a_reply_is_shown_as_text_and_runs_nothing(open_page):
    page = open_page.page
    open_page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.wait_for_selector(".model.online")
    open_page.settings(temperature="0")
    open_page.send(HTML_Q)
    open_page.wait_reply_done()
    shown = open_page.reply()
    assert "<img src=x onerror=alert(1)>" in shown and "<script>alert(2)</script>" in shown
    assert page.locator("#messages img, #messages script").count() == 0
    assert page.text_content(f"{REPLY} code") == "code"  # Markdown is still rendered
    assert open_page.dialogs == [] and open_page.errors == []
    page.click(".msg.assistant .meta .copy")
    assert page.evaluate("navigator.clipboard.readText()") == HTML_A


MARKDOWN = """# Title

Some *it* and **bold *both*** with `a<b>`.
line two

- one
- two <i>

3. three
4. four

> quote <img src=x>

[site](https://example.com) [bad](javascript:alert(1)) 2 * 3 * 4

```js
let x = '<script>';
```

~~~
unclosed <b>
"""

RENDER = """async (text) => {
    const { renderMarkdown } = await import('/static/markdown.js');
    const box = document.createElement('div');
    box.append(renderMarkdown(text, () => {}));
    return box.innerHTML;
}"""


def test_markdown_becomes_elements_and_html_in_it_stays_text(open_page):
    html = open_page.page.evaluate(RENDER, MARKDOWN)
    expected = [
        "<h3>Title</h3>",
        "<p>Some <em>it</em> and <strong>bold <em>both</em></strong> with <code>a&lt;b&gt;</code>."
        "<br>line two</p>",
        "<ul><li>one</li><li>two &lt;i&gt;</li></ul>",
        '<ol start="3"><li>three</li><li>four</li></ol>',
        "<blockquote>quote &lt;img src=x&gt;</blockquote>",
        '<p><a href="https://example.com" target="_blank" rel="noopener noreferrer">site</a>'
        " [bad](javascript:alert(1)) 2 * 3 * 4</p>",
        '<span class="lang">js</span>',
        "<pre><code>let x = '&lt;script&gt;';</code></pre>",
        "<pre><code>unclosed &lt;b&gt;</code></pre>",  # a fence still streaming
    ]
    for part in expected:
        assert part in html
    made = set(re.findall(r"<(\w+)", html))
    assert made == {
        *[
            "h3",
            "p",
            "em",
            "strong",
            "code",
            "br",
            "ul",
            "ol",
            "li",
            "blockquote",
            "a",
            "div",
            "span",
            "button",
            "pre",
        ]
    }
    assert open_page.errors == []


def test_chats_survive_a_reload_and_new_chat_starts_empty(open_page):
    page = open_page.page
    page.wait_for_selector(".model.online")
    open_page.settings(temperature="0")
    open_page.send(HELLO_Q)
    open_page.wait_reply_done()
    page.reload()
    page.wait_for_selector(DONE)
    assert page.text_content(".msg.user .body") == HELLO_Q
    assert page.inner_text(REPLY).strip() == HELLO_A.replace("**", "")
    assert page.text_content(f"{REPLY} strong") == "tiny"
    assert "finish: stop" in page.text_content(".msg.assistant .stats")
    assert page.input_value("#temperature") == "0"  # settings are kept too

    page.click("#new-chat")
    assert page.locator(".msg").count() == 0 and page.is_visible("#empty")
    assert page.locator("#chat-list li").count() == 1  # the empty chat is not listed
    page.click("#chat-list .open")
    assert page.text_content(".msg.user .body") == HELLO_Q
    assert open_page.errors == []


def test_with_an_api_key_the_page_asks_for_it_and_then_works(browser, servers):
    locked = Page(browser, servers[1])
    try:
        page = locked.page
        page.wait_for_selector("#notice:not([hidden])")
        assert "API key" in page.text_content("#notice")
        assert page.is_visible("#api-key")
        page.fill("#api-key", "sk-wrong")
        page.press("#api-key", "Enter")  # commits the field ("change")
        page.wait_for_function(
            "() => document.querySelector('#notice').textContent.includes('refused')"
        )
        page.fill("#api-key", API_KEY)
        page.press("#api-key", "Enter")
        page.wait_for_selector(".model.online")
        assert page.is_hidden("#notice")
        locked.settings(temperature="0")
        locked.send(HELLO_Q)
        locked.wait_reply_done()
        assert locked.reply().strip() == HELLO_A.replace("**", "")
        assert page.evaluate("localStorage.getItem('astrai.apiKey')") == f'"{API_KEY}"'
    finally:
        locked.close()


def test_settings_go_into_the_request_and_failures_get_a_clear_message(open_page):
    page = open_page.page
    page.wait_for_selector(".model.online")
    sent = []

    def unreachable(route):
        sent.append(route.request.post_data_json)
        route.abort()

    page.route("**/v1/chat/completions", unreachable)
    open_page.settings(system_prompt="Be brief.", temperature="0.3", top_p="0.9", max_tokens="7")
    open_page.send(HELLO_Q)
    page.wait_for_selector("#notice:not([hidden])")
    assert "Cannot reach the server" in page.text_content("#notice")
    assert sent == [
        {
            "model": NAME,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": HELLO_Q},
            ],
            "temperature": 0.3,
            "top_p": 0.9,
            "max_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ]
    assert page.input_value("#prompt") == HELLO_Q  # the text is given back, nothing is lost
    assert page.locator(".msg").count() == 0

    page.unroute("**/v1/chat/completions")
    body = '{"error": {"message": "Too many requests are waiting.", "code": "overloaded"}}'
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=429, body=body, content_type="application/json"),
    )
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "() => document.querySelector('#notice').textContent.includes('overloaded')"
    )
    assert page.input_value("#prompt") == HELLO_Q


def test_phone_layout_and_keyboard(browser, servers):
    phone = Page(browser, servers[0], viewport={"width": 390, "height": 800}, is_mobile=True)
    try:
        page = phone.page
        page.wait_for_selector(".model.online")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        assert not page.locator("#new-chat").is_visible() or (
            page.locator("#sidebar").bounding_box()["x"] < 0
        )
        page.click("#toggle-sidebar")
        page.wait_for_function(
            "() => document.querySelector('#sidebar').getBoundingClientRect().x >= 0"
        )
        page.click("#scrim", position={"x": 370, "y": 400})  # beside the open chat list
        page.wait_for_function(
            "() => document.querySelector('#sidebar').getBoundingClientRect().right <= 0"
        )
        page.fill("#prompt", "first line")
        page.press("#prompt", "Shift+Enter")
        page.type("#prompt", "second line")
        assert page.input_value("#prompt") == "first line\nsecond line"
        assert page.locator(".msg").count() == 0  # Shift+Enter did not send
        assert page.locator("#send").bounding_box()["x"] + 40 <= 390
        assert phone.errors == []
    finally:
        phone.close()
