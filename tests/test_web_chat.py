"""The browser chat page at / (pyllm/server/webui.py, the files in pyllm/server/web/), served by `pyllm serve` on
127.0.0.1 over SmolLM2-135M and driven in a real headless Chromium (Debian's chromium and chromium-driver, through
Selenium: docs/DESIGN.md, Web chat page, says why not Playwright).

References: the library's greedy chat (the first, stopped reply must be a prefix of it), the server's own event
stream as the browser received it (the page must show and keep exactly those deltas), /metrics (a stopped reply
stops the server's generation: one cancelled request, fewer tokens than asked for), and the page's
Content-Security-Policy as the browser enforces it. A missing browser is a failure, not a skip: .ci/run installs
it. Screenshots of the conversation and of a rendered reply are written to tests/artifacts/web_chat*.png
(gitignored), or under $PYLLM_TEST_ARTIFACTS.
"""

import fnmatch
import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from server_harness import KEY, ROOT

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WEB = ROOT / "pyllm" / "server" / "web"
WAIT_S = 120  # any one wait in the browser; a cold model thread on a busy 2-core machine is slow, never this slow


@pytest.fixture(scope="module")
def browser():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: apt-get install -y chromium chromium-driver (.ci/run does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1200,850"):
        options.add_argument(arg)
    # console messages, and the network events that carry the chat request's body and id
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def artifacts() -> Path:
    path = Path(os.environ.get("PYLLM_TEST_ARTIFACTS") or ROOT / "tests" / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _get(server, path: str, headers: dict | None = None, method: str = "GET"):
    req = urllib.request.Request(server.base + path, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _wait(what: str, check, within: float = WAIT_S, every: float = 0.05):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what}: not within {within:g} s")


def test_page_files_have_their_types_and_a_strict_csp(smol):
    status, headers, body = _get(smol, "/")  # no API key: the page is open, its /v1 calls are not
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    assert b'<script type="module" src="/web/chat.js">' in body and b"<script>" not in body
    csp = headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
    assert "require-trusted-types-for 'script'" in csp and "frame-ancestors 'none'" in csp
    assert headers["x-content-type-options"] == "nosniff"
    kinds = {"chat.js": "text/javascript; charset=utf-8", "markdown.js": "text/javascript; charset=utf-8",
             "chat.css": "text/css; charset=utf-8", "icon.svg": "image/svg+xml"}
    for name, kind in kinds.items():
        status, headers, body = _get(smol, "/web/" + name)
        assert status == 200 and headers["content-type"] == kind and body == (WEB / name).read_bytes(), name
        assert headers["content-security-policy"] == csp
        again, _, body = _get(smol, "/web/" + name, {"If-None-Match": headers["etag"]})
        assert again == 304 and body == b""
    # every file of the page is served, and the wheel carries it (package-data)
    assert {p.name for p in WEB.iterdir()} == {"index.html", *kinds}
    # (read with a pattern: tomllib is Python 3.11's, and pyllm supports 3.10)
    line = re.search(r'^"pyllm\.server" = \[(.*)\]$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    globs = json.loads(f"[{line}]")
    assert all(any(fnmatch.fnmatch("web/" + p.name, g) for g in globs) for p in WEB.iterdir())
    # the page's files are open under --api-key (a browser sends no key for them); other paths need it, then 404
    for path, key in (("/web/", None), ("/web/../app.py", None), ("/web/index.html", None),
                      ("/web/chat.js.map", None), ("/index.html", KEY)):
        status, _, body = _get(smol, path, {"Authorization": f"Bearer {key}"} if key else None)
        assert status == 404 and "unknown route" in json.loads(body)["error"]["message"], path
    status, _, body = _get(smol, "/", method="POST")
    assert status == 405
    assert _get(smol, "/index.html")[0] == 401 and _get(smol, "/metrics")[0] == 401


def _reply_text(driver) -> str:
    return driver.execute_script(
        "const m = document.querySelectorAll('#messages .msg.assistant .body'); "
        "return m.length ? m[m.length - 1].textContent : '';")


def _stored(driver) -> list:
    return json.loads(driver.execute_script("return localStorage.getItem('pyllm.conversations')"))


def _set(driver, field: str, value: str) -> None:
    from selenium.webdriver.common.keys import Keys

    el = driver.find_element("id", field)
    el.clear()
    el.send_keys(value, Keys.TAB)  # the page saves a setting on its change event


def _idle(driver) -> bool:
    return driver.execute_script("return document.getElementById('stop').hidden && "
                                 "!document.querySelector('.msg.streaming')")


def _chat_requests(driver) -> list[tuple[dict, str | None]]:
    """(request body, response body or None if the fetch was aborted) of each POST /v1/chat/completions the page
    made since the last call, from Chromium's network log: what the browser really sent and received."""
    sent, order, bodies = {}, [], {}
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        params = msg.get("params", {})
        if msg["method"] == "Network.requestWillBeSent" and params["request"]["url"].endswith("/v1/chat/completions"):
            sent[params["requestId"]] = json.loads(params["request"]["postData"])
            order.append(params["requestId"])
        elif msg["method"] == "Network.loadingFinished" and params["requestId"] in sent:
            bodies[params["requestId"]] = driver.execute_cdp_cmd("Network.getResponseBody",
                                                                 {"requestId": params["requestId"]})["body"]
    return [(sent[i], bodies.get(i)) for i in order]


def _deltas(sse: str) -> tuple[str, dict, str]:
    """(the text, the usage, the finish reason) of a chat completion's event stream."""
    events = [e[6:] for e in sse.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and chunks[-1]["usage"]
    return text, chunks[-1]["usage"], finish[0]


def test_chat_streams_stops_keeps_the_conversation(smol, smol_llm, browser, artifacts):
    from selenium.webdriver.common.keys import Keys

    d = browser
    d.get(smol.base + "/")
    # the server wants a key: the page says so, and takes it in Settings
    _wait("the page asks for the API key", lambda: "API key" in d.find_element("id", "status").text)
    d.find_element("id", "toggle-settings").click()
    _set(d, "api-key", KEY)
    _wait("the model list", lambda: d.find_element("id", "model-name").text == "smollm2")
    system = "You are a storyteller."
    _set(d, "temperature", "0")
    _set(d, "max-tokens", "200")
    d.find_element("id", "system-prompt").send_keys(system, Keys.TAB)
    d.find_element("id", "toggle-settings").click()
    d.get_log("performance")

    # turn 1: tokens stream in, then Stop
    before = smol.metrics()
    first = "Tell a very long story about a dragon."
    d.find_element("id", "prompt").send_keys(first, Keys.ENTER)
    seen = []

    def grown():
        text = _reply_text(d)
        if text and (not seen or text != seen[-1]):
            seen.append(text)
        return len(seen) >= 3

    _wait("three growing renderings of the streamed reply", grown, every=0.02)
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(seen, seen[1:]))  # appended, token by token
    d.find_element("id", "stop").click()
    _wait("the page leaves streaming after Stop", lambda: _idle(d))
    # the server stops generating: the request is counted cancelled, well short of max_tokens, the worker free
    deadline = time.monotonic() + 60
    while smol.metrics()["pyllm_requests_cancelled_total"] == before["pyllm_requests_cancelled_total"]:
        assert time.monotonic() < deadline, "the server did not cancel the stopped reply within 60 s"
        time.sleep(0.1)
    after = smol.metrics()
    assert after["pyllm_requests_cancelled_total"] == before["pyllm_requests_cancelled_total"] + 1
    assert after["pyllm_requests_processing"] == 0
    generated = int(after["pyllm_generated_tokens_total"] - before["pyllm_generated_tokens_total"])
    assert 1 <= generated < 200
    conv = _stored(d)[0]
    partial = conv["messages"][1]
    assert partial["note"] == "stopped" and partial["content"] and "stopped" in d.page_source
    # greedy: what the page kept is the start of the library's reply to the same messages
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    assert smol_llm.chat(msgs, max_tokens=generated, temperature=0).startswith(partial["content"])
    (sent, sse), = _chat_requests(d)
    assert sent["messages"] == msgs and sse is None  # aborted: the stream never finished loading

    # turn 2: the history goes back with the stopped reply, the whole reply streams to the end
    d.find_element("id", "toggle-settings").click()
    _set(d, "max-tokens", "16")
    d.find_element("id", "toggle-settings").click()
    second = "Give the dragon a name."
    d.find_element("id", "prompt").send_keys(second, Keys.ENTER)
    _wait("the second reply", lambda: len(_stored(d)[0]["messages"]) == 4 and _idle(d))
    reply = _stored(d)[0]["messages"][3]
    (sent, sse), = _chat_requests(d)
    assert sent["messages"] == msgs + [{"role": "assistant", "content": partial["content"]},
                                       {"role": "user", "content": second}]
    assert sent["stream"] is True and sent["temperature"] == 0 and sent["max_tokens"] == 16
    text, usage, finish = _deltas(sse)
    assert "error" not in reply and reply["content"] == text != ""
    # the note: the stream's token count, and whether the reply met max_tokens
    limit = " · stopped at the token limit" if finish == "length" else ""
    assert re.fullmatch(rf"{usage['completion_tokens']} tokens, [\d.]+ tokens/s{limit}", reply["note"])
    # the page shows the reply as its renderer makes it
    html = d.execute_script("return [...document.querySelectorAll('.msg.assistant .body')].pop().innerHTML")
    assert html == d.execute_async_script(
        "const [text, done] = arguments, box = document.createElement('div');"
        "import('/web/markdown.js').then((m) => { m.setMarkdown(box, text); done(box.innerHTML) })",
        reply["content"])

    # a reload finds the conversation where it was
    d.refresh()
    _wait("the kept conversation", lambda: len(d.find_elements("css selector", "#messages .msg")) == 4)
    texts = [e.text for e in d.find_elements("css selector", "#messages .msg .body")]
    assert texts[0] == first and texts[2] == second
    assert d.find_elements("css selector", "#messages .msg .note")[1].text == "stopped"
    titles = [e.text for e in d.find_elements("css selector", "#conversations .open")]
    assert titles == [first]
    d.save_screenshot(str(artifacts / "web_chat.png"))

    # New chat: an empty conversation beside the kept one, which opens again from the list
    d.find_element("id", "new-chat").click()
    _wait("an empty conversation", lambda: d.find_elements("css selector", "#messages .empty"))
    assert len(d.find_elements("css selector", "#conversations .conv")) == 2
    d.find_element("css selector", f'#conversations .open[title="{first}"]').click()
    _wait("the old conversation", lambda: len(d.find_elements("css selector", "#messages .msg")) == 4)

    # nothing the page did broke its CSP or threw; the one expected console error is the first /v1/models 401
    errors = [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert all("/v1/models" in e and "401" in e for e in errors), errors


MARKDOWN = """## Steps
1. **Install** the *package*
2. Run `pyllm <serve>`

- a [link](https://example.com/a?b=1&c=2)
- [bad](javascript:alert(1)) and <img src=x onerror="window.pwned=1">

| name | size |
|:-----|-----:|
| <b>x</b> | 2 |

> quoted <script>window.pwned=2</script>

```python
print("<script>window.pwned=3</script>")
```
<svg onload="window.pwned=4"></svg> [x](https://e.com/"onmouseover="window.pwned=5)
"""


def test_markdown_renders_blocks_and_never_model_markup(smol, browser, artifacts):
    """Model text with markup in it (as a prompt injection would make the model write) is shown as text: the only
    elements are the renderer's own, links are http(s) only, and the browser enforces the CSP's Trusted Types."""
    d = browser
    d.get(smol.base + "/")
    conv = {"id": "md", "title": "markdown", "updated": 1,
            "messages": [{"role": "user", "content": "<i>not italic</i>"},
                         {"role": "assistant", "content": MARKDOWN}]}
    d.execute_script("localStorage.setItem('pyllm.conversations', arguments[0]);"
                     "localStorage.setItem('pyllm.current', '\"md\"')", json.dumps([conv]))
    d.refresh()
    _wait("the rendered reply", lambda: d.find_elements("css selector", ".msg.assistant .body h2"))
    body = d.find_element("css selector", ".msg.assistant .body")
    tags = d.execute_script("return [...arguments[0].querySelectorAll('*')].map((e) => e.tagName.toLowerCase())",
                            body)
    assert set(tags) <= {"h2", "ol", "ul", "li", "strong", "em", "code", "a", "div", "table", "thead", "tbody", "tr",
                         "th", "td", "blockquote", "p", "pre", "span", "button", "br"}, tags
    assert d.execute_script("return [...arguments[0].querySelectorAll('*')].flatMap((e) => [...e.attributes])"
                            ".map((a) => a.name).filter((n) => n.startsWith('on'))", body) == []
    links = [a.get_attribute("href") for a in body.find_elements("tag name", "a")]
    assert links == ["https://example.com/a?b=1&c=2"]  # javascript: and a URL breaking out of its quotes: text
    assert body.find_element("css selector", "pre code").text == 'print("<script>window.pwned=3</script>")'
    assert body.find_element("css selector", ".code .lang").text == "python"
    assert [e.text for e in body.find_elements("css selector", "ol li")] == ["Install the package", "Run pyllm <serve>"]
    assert body.find_element("css selector", "ol li code").text == "pyllm <serve>"
    assert [e.text for e in body.find_elements("css selector", "th")] == ["name", "size"]
    assert body.find_element("css selector", "td").text == "<b>x</b>"
    assert '<img src=x onerror="window.pwned=1">' in body.text and "<svg onload" in body.text
    assert d.find_element("css selector", ".msg.user .body").text == "<i>not italic</i>"
    assert d.execute_script("return window.pwned") is None
    d.save_screenshot(str(artifacts / "web_chat_markdown.png"))
    assert [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]] == []
    # Trusted Types in force: HTML from a plain string is refused, even from the page's own code
    assert d.execute_script("try { document.body.innerHTML = '<b>x</b>'; return 'assigned' }"
                            " catch (e) { return e.name }") == "TypeError"
    # a conversation store that is not the page's (edited by hand) starts the page empty rather than breaking it
    d.execute_script("localStorage.setItem('pyllm.conversations', '{not json')")
    d.refresh()
    _wait("the empty page", lambda: d.find_elements("css selector", "#messages .empty"))
    assert d.find_elements("css selector", "#conversations .conv")  # one new, empty conversation
