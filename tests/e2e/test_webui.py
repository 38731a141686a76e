"""The chat page at ``/`` in a real browser: Debian's headless Chromium driven by Selenium.

One browser for the module and three real servers on the tiny generated model: the page as a
user gets it (``--ui-config-file`` and ``--ui-config`` give it short greedy answers), one with
``--api-key`` and one with ``--no-ui``. Everything the page shows comes from the real server through its real stream.

What is tested where:
- markdown and the ``<script>`` / ``<img onerror>`` case use real model output: a GBNF grammar
  (an extra request field set in the page's settings) makes the model write exactly that text,
  which then streams through ``/v1/chat/completions`` into the page's renderer;
- the stop button is checked on the server: its only slot must be idle within 2 s (``/slots``);
- first paint and the page's weight are read from the Performance API on a navigation with the
  HTTP cache off (every file fetched), in a browser that has already opened one page (the very
  first navigation also pays for starting the browser's renderer, which is not the page's cost).

The tests skip, saying why, where ``/usr/bin/chromium``, ``/usr/bin/chromedriver`` or the
``selenium`` package are missing (``scripts/setup.sh`` installs them when it runs as root).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from tests.e2e.helpers import wait_idle

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
KEY = "ui-secret-key"
UI_CONFIG = {"max_tokens": 16, "temperature": 0}
UI_CONFIG_FILE = {"max_tokens": 99, "top_k": 40}  # --ui-config wins where both set a key
CACHE_FIGURE = re.compile(r"(\d+) of (\d+) prompt tokens from cache")
WAIT = 60.0


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"no headless browser: {', '.join(missing)} missing (scripts/setup.sh installs Debian's chromium "
                    "and chromium-driver when it runs as root with apt)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--no-first-run", "--disable-extensions", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-default-apps"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def ui_server(server_factory, llama_dir: Path, tmp_path_factory):
    config_file = tmp_path_factory.mktemp("ui-config") / "ui.json"
    config_file.write_text(json.dumps(UI_CONFIG_FILE), encoding="utf-8")
    return server_factory(["-m", str(llama_dir), "-c", "4096", "-np", "1", "--alias", "tiny-chat",
                           "--ui-config-file", str(config_file), "--ui-config", json.dumps(UI_CONFIG)])


@pytest.fixture(scope="module")
def key_server(server_factory, llama_dir: Path):
    """Behind --api-key, with the MCP proxy on too: the proxy's test (below) shares this server."""
    return server_factory(["-m", str(llama_dir), "-c", "4096", "-np", "1", "--ui-mcp-proxy", "--api-key", KEY])


@pytest.fixture(scope="module")
def noui_server(server_factory, llama_dir: Path):
    return server_factory(["-m", str(llama_dir), "-c", "512", "-np", "1", "--no-ui"])


# ---------------------------------------------------------------------- helpers


def until(driver: Any, condition: Callable[[Any], Any], timeout: float = WAIT, message: str = "") -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, message)


def by_css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def console_errors(driver: Any) -> list[dict]:
    """Severe console entries, less the browser's note of the 403 that tells the page the server has no
    built-in tools (it asks GET /tools, as llama-server's UI does, and that 403 is the answer)."""
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"
            and not ("/tools - Failed to load resource" in entry["message"] and "status of 403" in entry["message"])]


def open_page(driver: Any, base_url: str, settings: dict | None = None) -> None:
    """The page with no conversations and the given saved settings, ready to chat."""
    driver.get(base_url + "/")
    driver.execute_script("localStorage.clear(); if (arguments[0]) localStorage.setItem('mlxcel.settings.v1', arguments[0]);",
                          json.dumps(settings) if settings else None)
    driver.refresh()
    until(driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"), message="page never got ready")
    console_errors(driver)  # drop what earlier pages logged


def send(driver: Any, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = by_css(driver, "#input")[0]
    box.clear()
    box.send_keys(text + Keys.ENTER)


def answers(driver: Any) -> list[Any]:
    return by_css(driver, "#messages .msg.assistant")


def wait_answer(driver: Any, n: int) -> Any:
    """The n-th answer (1-based) once its stream has finished: its figures line is filled in."""
    until(driver, lambda d: len(answers(d)) >= n and "prompt tokens from cache" in answers(d)[n - 1].find_element("css selector", ".stats").text,
          message=f"answer {n} never finished")
    return answers(driver)[n - 1]


def cache_figure(answer: Any) -> tuple[int, int]:
    match = CACHE_FIGURE.search(answer.find_element("css selector", ".stats").text)
    assert match, answer.text
    return int(match.group(1)), int(match.group(2))


# ---------------------------------------------------------------------- the page itself


def test_loads_without_console_errors_fast_and_small(browser, ui_server) -> None:
    open_page(browser, ui_server.base_url)
    assert console_errors(browser) == []
    assert browser.title == "tiny-chat"  # llama-server's UI convention: the model's name
    facts = by_css(browser, "#model-facts")[0].text
    assert "context 4096 tokens" in facts and "text only" in facts  # from /props
    # What the old status page showed is in the Server dialog.
    by_css(browser, "#open-server")[0].click()
    info = until(browser, lambda d: "Slots busy" in by_css(d, "#server-info")[0].text and by_css(d, "#server-info")[0]).text
    assert "Model tiny-chat" in info and "Context per slot 4096" in info and "Slots busy 0 of 1" in info and "/metrics" in info
    by_css(browser, "#server-dialog button")[0].click()
    # Again with the HTTP cache off: every file is fetched and counted, first paint included.
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": True})
    try:
        browser.refresh()
        until(browser, lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
    finally:
        browser.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": False})
    paint = browser.execute_script(
        "const p = performance.getEntriesByName('first-contentful-paint')[0] || performance.getEntriesByName('first-paint')[0];"
        "return p ? p.startTime : null;")
    assert paint is not None and paint < 200, f"first paint after {paint} ms"
    sizes = browser.execute_script(
        "return [performance.getEntriesByType('navigation')[0], ...performance.getEntriesByType('resource')]"
        ".filter(e => !e.name.includes('/props')).map(e => [e.name, e.decodedBodySize]);")
    names = [name for name, _ in sizes]
    assert any(n.endswith("/ui/vendor/marked.esm.js") for n in names) and any(n.endswith("/ui/vendor/purify.es.mjs") for n in names)
    total = sum(size for _, size in sizes)
    assert 50_000 < total < 300_000, sizes
    assert console_errors(browser) == []


def test_headers_cache_and_csp(ui_server) -> None:
    with httpx.Client(base_url=ui_server.base_url) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert page.headers["cache-control"] == "no-cache" and page.headers["x-content-type-options"] == "nosniff"
        assert http.get("/", headers={"If-None-Match": page.headers["etag"]}).status_code == 304
        assert http.get("/index.html").content == page.content
        script = http.get("/ui/main.js")
        assert script.headers["content-type"].startswith("text/javascript") and script.headers["content-security-policy"] == csp
        assert http.get("/ui/vendor/marked.LICENSE").text.startswith("# License information")
        for missing in ("/ui/nope.js", "/ui/vendor/nope.js", "/ui/..%2Findex.html", "/ui/vendor"):
            assert http.get(missing).status_code == 404, missing
        props = http.get("/props").json()
        assert props["ui"] is True and props["ui_settings"] == {"max_tokens": 16, "top_k": 40, "temperature": 0}
        assert props["model_alias"] == "tiny-chat" and props["default_generation_settings"]["n_ctx"] == 4096


# ---------------------------------------------------------------------- chatting


def test_answer_streams_and_the_second_turn_comes_from_the_cache(browser, ui_server) -> None:
    # 400 tokens: the page paints once an animation frame (~16 ms), and the tiny model writes 48
    # tokens within one or two frames, so a short answer can land on screen in one piece (as it did
    # in a CI run); 400 take about ten frames here.
    open_page(browser, ui_server.base_url, {"max_tokens": "400", "custom": '{"ignore_eos": true}'})
    # Record every length the answer's text has on screen while it streams.
    browser.execute_script("""
        window.__lengths = [];
        new MutationObserver(() => {
          const a = document.querySelector('#messages .msg.assistant .content');
          if (a) window.__lengths.push(a.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")
    send(browser, "Hello there, how are you?")
    first = wait_answer(browser, 1)
    lengths = sorted(set(browser.execute_script("return window.__lengths")) - {0})
    assert len(lengths) >= 2, f"the answer appeared in one piece: {lengths}"
    assert "400 tokens" in first.text and "tokens/s" in first.text
    _, prompt1 = cache_figure(first)
    send(browser, "Tell me more.")
    second = wait_answer(browser, 2)
    cached, prompt2 = cache_figure(second)
    assert prompt2 > prompt1 and prompt1 <= cached < prompt2, (cached, prompt1, prompt2)
    assert "prompt tokens from cache (hit)" in second.text  # the reason beside the figure (cache_explain)
    assert console_errors(browser) == []


def test_stop_cancels_the_request(browser, ui_server) -> None:
    open_page(browser, ui_server.base_url)
    # The settings panel: a long answer that does not end at EOS.
    by_css(browser, "#open-settings")[0].click()
    by_css(browser, "#setting-max_tokens")[0].send_keys("3500")
    by_css(browser, "#setting-custom")[0].send_keys('{"ignore_eos": true}')
    by_css(browser, "#settings-save")[0].click()
    assert json.loads(browser.execute_script("return localStorage.getItem('mlxcel.settings.v1')")) == {
        "max_tokens": "3500", "custom": '{"ignore_eos": true}'}
    send(browser, "Count to a million.")
    with httpx.Client(base_url=ui_server.base_url) as http:
        until(browser, lambda d: answers(d) and len(answers(d)[0].find_element("css selector", ".content").text) > 20)
        assert http.get("/slots").json()[0]["is_processing"] is True
        stop = by_css(browser, "#stop")[0]
        assert stop.is_displayed() and not by_css(browser, "#send")[0].is_displayed()
        stop.click()
        wait_idle(http, timeout=2.0)
    until(browser, lambda d: "stopped" in answers(d)[0].find_element("css selector", ".stats").text)
    assert by_css(browser, "#send")[0].is_displayed()
    stored = json.loads(browser.execute_script("return localStorage.getItem('mlxcel.conversations.v1')"))
    assert stored[0]["messages"][1]["content"] and stored[0]["messages"][1]["stats"]["stopped"] is True


def test_a_reload_mid_answer_resumes_it_from_the_server(browser, ui_server) -> None:
    """The page sends its conversation id (X-Conversation-Id): the server goes on generating when
    the page reloads, and the reloaded page reads the whole answer again and follows it to its end."""
    # Log-probabilities take the answer off the plain greedy fast path: about a second, long enough to reload in.
    open_page(browser, ui_server.base_url, {"max_tokens": "2000", "custom": '{"ignore_eos": true, "n_probs": 10}'})
    send(browser, "Tell me a long story.")
    with httpx.Client(base_url=ui_server.base_url) as http:
        until(browser, lambda d: answers(d) and len(answers(d)[0].find_element("css selector", ".content").text) > 20)
        browser.refresh()
        assert http.get("/slots").json()[0]["is_processing"] is True  # the answer goes on without the page
        answer = wait_answer(browser, 1)
        assert "2000 tokens" in answer.text
        (conversation,) = json.loads(browser.execute_script("return localStorage.getItem('mlxcel.conversations.v1')"))
        stored = conversation["messages"][1]
        assert "streaming" not in stored and "error" not in stored
        replay = http.get("/v1/stream", params={"conv_id": conversation["id"]}).text
    deltas = [json.loads(line[6:]) for line in replay.split("\n") if line.startswith("data: {")]
    whole = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"])
    assert stored["content"] == whole and len(whole) > 100
    assert console_errors(browser) == []


def test_reload_keeps_the_conversation_and_the_list_manages_it(browser, ui_server) -> None:
    open_page(browser, ui_server.base_url)
    send(browser, "Remember this")
    answer = wait_answer(browser, 1).find_element("css selector", ".content").text
    browser.refresh()
    until(browser, lambda d: len(answers(d)) == 1)
    assert by_css(browser, "#messages .msg.user .content")[0].text == "Remember this"
    assert answers(browser)[0].find_element("css selector", ".content").text == answer
    assert [li.text.splitlines()[0] for li in by_css(browser, "#conversations li")] == ["Remember this"]

    by_css(browser, "#conversations li [data-action=rename]")[0].click()
    alert = until(browser, lambda d: d.switch_to.alert)
    alert.send_keys("Renamed")
    alert.accept()
    until(browser, lambda d: by_css(d, "#conversations li .title")[0].text == "Renamed")

    # Edit the question and regenerate from it: the old answer is replaced.
    by_css(browser, "#messages .msg.user [data-action=edit]")[0].click()
    box = by_css(browser, "#messages .msg.user textarea")[0]
    box.clear()
    box.send_keys("An edited question")
    by_css(browser, "#messages .msg.user [data-action=save-edit]")[0].click()
    until(browser, lambda d: by_css(d, "#messages .msg.user .content")[0].text == "An edited question")
    wait_answer(browser, 1)
    # Regenerate the answer: a new request for the same question, the old answer dropped.
    with httpx.Client(base_url=ui_server.base_url) as http:
        before = http.get("/slots").json()[0]["id_task"]
        by_css(browser, "#messages .msg.assistant [data-action=regenerate]")[0].click()
        until(browser, lambda d: http.get("/slots").json()[0]["id_task"] != before)
    wait_answer(browser, 1)
    assert len(answers(browser)) == 1
    exported = json.loads(browser.execute_async_script(
        "import(new URL('ui/store.js', location.href)).then(m => arguments[0](m.exportJson()));"))
    (conversation,) = exported["conversations"]
    assert conversation["title"] == "Renamed"
    assert [(m["role"], m["content"][:19]) for m in conversation["messages"]] == [
        ("user", "An edited question"), ("assistant", conversation["messages"][1]["content"][:19])]
    assert conversation["messages"][1]["stats"]["prompt"] > 0

    by_css(browser, "#conversations li [data-action=delete]")[0].click()
    until(browser, lambda d: d.switch_to.alert).accept()
    until(browser, lambda d: not by_css(d, "#conversations li .title") or by_css(d, "#conversations li .title")[0].text != "Renamed")
    assert json.loads(browser.execute_script("return localStorage.getItem('mlxcel.conversations.v1')")) == []


# The text the model is made to write (GBNF), markdown and HTML that must not run.
FORCED = ("<think>pondering</think>**bold** and `inline` <img src=x onerror=\"window.__xss=1\"> "
          "<script>window.__xss=2</script>\n\n```python\nprint(1)\n```\n")


def test_markdown_renders_and_html_in_model_output_is_text(browser, ui_server) -> None:
    grammar = "root ::= " + json.dumps(FORCED)
    open_page(browser, ui_server.base_url, {"custom": json.dumps({"grammar": grammar, "max_tokens": 400})})
    send(browser, "Show me some markdown")
    answer = wait_answer(browser, 1)
    content = answer.find_element("css selector", ".content")
    assert content.find_element("css selector", "strong").text == "bold"
    assert content.find_element("css selector", "p code").text == "inline"
    assert content.find_element("css selector", "pre code.language-python").text == "print(1)"
    assert content.find_elements("css selector", "img, script") == []
    text = browser.execute_script("return arguments[0].textContent", content)
    assert '<img src=x onerror="window.__xss=1">' in text and "<script>window.__xss=2</script>" in text
    assert browser.execute_script("return window.__xss") is None
    # The reasoning is folded: present, closed until clicked.
    details = answer.find_element("css selector", "details.reasoning")
    assert details.get_attribute("open") is None and not details.find_element("css selector", ".reasoning-body").is_displayed()
    details.find_element("css selector", "summary").click()
    assert details.find_element("css selector", ".reasoning-body").text == "pondering"
    assert console_errors(browser) == []


# ---------------------------------------------------------------------- --api-key and --no-ui


def test_api_key_is_asked_for_and_sent(browser, key_server) -> None:
    assert httpx.get(key_server.base_url + "/props").status_code == 401
    browser.get(key_server.base_url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    dialog = until(browser, lambda d: [e for e in by_css(d, "#key-dialog") if e.get_attribute("open") is not None])[0]
    dialog.find_element("css selector", "#key-input").send_keys("wrong-key")
    dialog.find_element("css selector", "#key-submit").click()
    until(browser, lambda d: "That key was refused: Invalid API Key" in by_css(d, "#key-error")[0].text)
    by_css(browser, "#key-input")[0].send_keys(KEY)
    by_css(browser, "#key-submit")[0].click()
    until(browser, lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
    send(browser, "Hi")
    assert cache_figure(wait_answer(browser, 1))[1] > 0
    assert browser.execute_script("return localStorage.getItem('mlxcel.apiKey')") == KEY


def test_no_ui_answers_404(browser, noui_server) -> None:
    browser.get(noui_server.base_url + "/")
    assert "File Not Found" in by_css(browser, "body")[0].text
    for path in ("/", "/index.html", "/ui/main.js", "/ui/vendor/marked.esm.js"):
        response = httpx.get(noui_server.base_url + path)
        assert response.status_code == 404 and response.json()["error"]["message"] == "File Not Found", path
    assert httpx.get(noui_server.base_url + "/props").json()["ui"] is False


# ---------------------------------------------------------------------- --tools


@pytest.fixture(scope="module")
def tools_ui_server(server_factory, llama_dir: Path):
    return server_factory(["-m", str(llama_dir), "-c", "4096", "-np", "1", "--tools", "get_info"])


def test_tool_call_runs_through_post_tools_and_goes_back_to_the_model(browser, tools_ui_server) -> None:
    # tool_choice "required" (an extra request field) forces a call to the only tool offered; the page runs
    # it through POST /tools and sends its result back as a tool message, and the model answers again.
    custom = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}
    open_page(browser, tools_ui_server.base_url, {"custom": json.dumps(custom)})
    toggle = by_css(browser, "#tools-toggle")[0]
    assert toggle.is_displayed() and "Tools (1)" in " ".join(toggle.text.split()) and by_css(browser, "#tools-on")[0].is_selected()
    send(browser, "Where are you running?")
    until(browser, lambda d: len(answers(d)) >= 2 and d.find_element("css selector", "#send").is_displayed(),
          message="the answer after the tool result never came")
    info = httpx.post(tools_ui_server.base_url + "/tools", json={"tool": "get_info"}).json()
    results = by_css(browser, "#messages .msg.tool")
    assert 1 <= len(results) <= 5  # at most MAX_ROUNDS rounds of calls per answer
    assert results[0].find_element("css selector", ".role").get_attribute("textContent") == "Tool result: Get Runtime Info"
    assert json.loads(results[0].find_element("css selector", ".content").text) == info
    assert "Calls Get Runtime Info (get_info)" in answers(browser)[0].text
    exported = json.loads(browser.execute_async_script(
        "import(new URL('ui/store.js', location.href)).then(m => arguments[0](m.exportJson()));"))
    messages = exported["conversations"][0]["messages"]
    assert [m["role"] for m in messages[:4]] == ["user", "assistant", "tool", "assistant"]
    call = messages[1]["tool_calls"][0]
    assert call["function"]["name"] == "get_info" and messages[2]["tool_call_id"] == call["id"]
    # the second answer's prompt held the first call and its result
    assert messages[3]["stats"]["prompt"] > messages[1]["stats"]["prompt"] + len(json.dumps(info)) // 8
    assert console_errors(browser) == []
    # unticked, the tools are not offered: a plain answer, no tool messages
    by_css(browser, "#new-chat")[0].click()
    by_css(browser, "#tools-on")[0].click()
    by_css(browser, "#open-settings")[0].click()
    by_css(browser, "#setting-custom")[0].clear()
    by_css(browser, "#settings-save")[0].click()
    send(browser, "Hi again")
    wait_answer(browser, 1)
    assert by_css(browser, "#messages .msg.tool") == []


def test_no_tools_hides_the_toggle(browser, ui_server) -> None:
    open_page(browser, ui_server.base_url)
    assert not by_css(browser, "#tools-toggle")[0].is_displayed()
    assert console_errors(browser) == []


# ---------------------------------------------------------------------- MCP servers through --ui-mcp-proxy


class McpHttp:
    """A small MCP server on MCP's streamable HTTP transport: JSON answers, an SSE one for tools/call,
    a session id it hands out at initialize and then requires. It records what reached it."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        import threading

        from tests.conftest import free_port

        self.seen: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                message = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.seen.append({"message": message, "headers": dict(self.headers.items())})
                method = message.get("method")
                if method != "initialize" and self.headers.get("mcp-session-id") != "s-42":
                    return self.answer(400, {"jsonrpc": "2.0", "id": message.get("id"), "error": {"code": -32000, "message": "no session"}})
                if "id" not in message:
                    return self.answer(202, None)
                if method == "initialize":
                    result = {"protocolVersion": "2024-11-05", "capabilities": {"tools": {}}, "serverInfo": {"name": "web", "version": "1"}}
                elif method == "tools/list":
                    result = {"tools": [{"name": "where_am_i", "description": "Where the MCP server runs",
                                         "inputSchema": {"type": "object", "properties": {}}}]}
                else:
                    return self.answer(200, {"jsonrpc": "2.0", "id": message["id"],
                                             "result": {"content": [{"type": "text", "text": "on the MCP test server"}]}}, sse=True)
                self.answer(200, {"jsonrpc": "2.0", "id": message["id"], "result": result})

            def answer(self, status: int, body: dict | None, sse: bool = False) -> None:
                data = b"" if body is None else (b"event: message\ndata: " + json.dumps(body).encode() + b"\n\n" if sse else json.dumps(body).encode())
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if sse else "application/json")
                self.send_header("Mcp-Session-Id", "s-42")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/mcp"


@pytest.fixture(scope="module")
def mcp_http() -> Iterator[McpHttp]:
    server = McpHttp()
    yield server
    server.httpd.shutdown()


@pytest.fixture(scope="module")
def proxy_ui_server(key_server):
    """--ui-mcp-proxy behind --api-key: the API-key test's server."""
    return key_server


def test_mcp_server_tools_run_through_the_cors_proxy(browser, proxy_ui_server, mcp_http) -> None:
    custom = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}
    # The settings are written from /health (same origin, no page script): written on a loaded chat
    # page, its start-up could read them after an await and open an MCP session before the reload.
    browser.get(proxy_ui_server.base_url + "/health")
    browser.execute_script("localStorage.clear(); localStorage.setItem('mlxcel.apiKey', arguments[0]);"
                           "localStorage.setItem('mlxcel.settings.v1', arguments[1]);",
                           KEY, json.dumps({"mcpServers": mcp_http.url, "custom": json.dumps(custom)}))
    browser.get(proxy_ui_server.base_url + "/")
    until(browser, lambda d: d.execute_script("return document.body.dataset.ready === '1'"), message="page never got ready")
    console_errors(browser)  # drop what the earlier pages logged
    assert "Tools (1)" in " ".join(by_css(browser, "#tools-toggle")[0].text.split())
    send(browser, "Where is the MCP server?")
    until(browser, lambda d: len(answers(d)) >= 2 and d.find_element("css selector", "#send").is_displayed(),
          message="the answer after the MCP tool result never came")
    result = by_css(browser, "#messages .msg.tool")[0]
    assert result.find_element("css selector", ".content").text == "on the MCP test server"
    methods = [s["message"].get("method") for s in mcp_http.seen]
    assert methods[:4] == ["initialize", "notifications/initialized", "tools/list", "tools/call"]
    call = mcp_http.seen[3]
    assert call["message"]["params"]["name"] == "where_am_i" and call["headers"]["Mcp-Session-Id"] == "s-42"
    assert "Authorization" not in call["headers"] and "Cookie" not in call["headers"]  # the API key stays here
    assert console_errors(browser) == []
