"""The chat page at `/` in a real browser: headless Chromium driven by Selenium, against one
`minirun serve` (uvicorn in a thread) over a tiny random model, and a second app with an API key
over the same worker.

Needs Debian's `chromium` and `chromium-driver` (`.ci/run` installs them) and `selenium` (the test
extra). The random model's greedy answers (the page set to temperature 0) never reach its end
token: they run to the token limit each test sets; where a test must act while an answer streams,
the engine's step is slowed.
"""
import contextlib
import json
import shutil
import time
import urllib.request

import pytest
import uvicorn

from minirun import Engine
from minirun.config import EngineConfig
from minirun.serve import create_app
from minirun.serve.page import cache_kind
from minirun.serve.server import make_server
from test_serve import ThreadServer

try:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    webdriver = None

CTX = 2048
KEY = "page-test-key"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.load(tiny_model_dir("gqa-untied"), device="cpu", ctx=CTX)


@pytest.fixture(scope="module")
def served(engine):
    srv = ThreadServer(make_server(engine, "tiny", max_queue=8, log_level="warning"))
    yield srv
    srv.server.worker.stop(timeout=10)
    srv.close()


@pytest.fixture(scope="module")
def keyed(served):
    """An app that asks for an API key, over the same worker (so no second model)."""
    app = create_app(served.server.worker, "tiny", api_key=KEY)
    srv = ThreadServer(uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def browser():
    if webdriver is None:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    chromedriver = shutil.which("chromedriver")
    if chromedriver is None:
        pytest.skip("chromedriver is not installed (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900"):
        opts.add_argument(arg)
    if shutil.which("chromium"):
        opts.binary_location = shutil.which("chromium")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=chromedriver))
    yield driver
    driver.quit()


def severe(driver, allow=()) -> list[str]:
    """The console's errors since the last call, less those naming an expected HTTP status."""
    logs = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    return [m for m in logs if not any(f"status of {s}" in m for s in allow)]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def slow_steps(engine, seconds: float):
    """Each decode step of `engine` takes `seconds` longer, so that a test can act mid-answer."""
    step = engine.step

    def slow(token):
        time.sleep(seconds)
        return step(token)
    engine.step = slow
    try:
        yield
    finally:
        del engine.step


def wait(driver, cond, timeout=30):
    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(lambda d: cond())


def open_page(driver, srv, temperature="0", max_tokens="24"):
    driver.get(srv.url + "/")
    wait(driver, lambda: driver.find_element(By.ID, "model").get_attribute("textContent") == "tiny")
    driver.execute_script("localStorage.clear()")
    settings(driver, temperature, max_tokens)


def settings(driver, temperature=None, max_tokens=None):
    for field, value in (("temperature", temperature), ("max-tokens", max_tokens)):
        if value is not None:
            el = driver.find_element(By.ID, field)
            driver.execute_script("arguments[0].value = arguments[1]", el, value)


def answers(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#log .msg.assistant")


def ask(driver, question: str):
    """Type a question and press Enter; the new answer's element."""
    n = len(answers(driver))
    box = driver.find_element(By.ID, "input")
    box.send_keys(question)
    box.send_keys("\n")
    wait(driver, lambda: len(answers(driver)) == n + 1)
    return answers(driver)[-1]


def finished(driver, el, states=("done",), timeout=60):
    wait(driver, lambda: el.get_attribute("data-state") not in ("waiting", "streaming"), timeout)
    assert el.get_attribute("data-state") in states, el.text
    return el


def stats_of(el) -> dict:
    s = el.find_element(By.CLASS_NAME, "stats")
    return {k: s.get_attribute(f"data-{k}") for k in ("prompt-tokens", "cached-tokens", "tps")} | {"text": s.text}


def test_props_names_the_cache():
    assert cache_kind(EngineConfig()) == {"kind": "dense"}
    assert cache_kind(EngineConfig(kv="hca", kv_budget=0.125)) == {"kind": "hca", "budget": "0.125"}
    assert cache_kind(EngineConfig(kv="hca", groups=64, centroids=16)) == {"kind": "hca", "budget": "g64c16"}


def test_page_and_props_load_without_console_errors(served, browser):
    with urllib.request.urlopen(served.url + "/", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    props = get_json(served.url + "/props")
    assert props == {"model": "tiny", "n_ctx": CTX, "cache": {"kind": "dense"}, "api_key_required": False}
    open_page(browser, served)
    assert "context 2,048 tokens" in browser.find_element(By.ID, "facts").text
    assert "dense" in browser.find_element(By.ID, "facts").text
    assert browser.execute_script("return document.styleSheets[0].cssRules.length") > 10   # the CSS loaded
    assert severe(browser) == []


def test_markdown_escapes_html_and_renders_the_rules(served, browser):
    browser.get(served.url + "/")
    render = lambda text: browser.execute_script("return minirunMarkdown.render(arguments[0])", text)  # noqa: E731
    html = render('<img src=x onerror="alert(1)"> <script>alert(2)</script> <unused276>')
    assert "<img" not in html and "<script" not in html and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html
    assert "&lt;unused276&gt;" in html
    assert render("[a](javascript:alert(1))") == "<p>[a](javascript:alert(1))</p>"
    assert render('[a](http://x.org/?q="><b>)').startswith('<p><a href="http://x.org/?q=&quot;&gt;&lt;b&gt;" ')
    assert render("[site](https://example.org/a?b=1&c=2)") == \
        '<p><a href="https://example.org/a?b=1&amp;c=2" target="_blank" rel="noopener noreferrer">site</a></p>'
    assert render("[`x<y`](https://example.org)") == \
        '<p><a href="https://example.org" target="_blank" rel="noopener noreferrer"><code>x&lt;y</code></a></p>'
    assert render("**bold** and *it* and `x<y`") == \
        "<p><strong>bold</strong> and <em>it</em> and <code>x&lt;y</code></p>"
    assert render("```py\nif a < b:\n    **no**\n```\nafter") == \
        '<pre><code data-lang="py">if a &lt; b:\n    **no**</code></pre><p>after</p>'
    assert render("- one\n- two\n\n3. three") == '<ul><li>one</li><li>two</li></ul><ol start="3"><li>three</li></ol>'
    assert render("```\nstill streaming <b>") == "<pre><code>still streaming &lt;b&gt;</code></pre>"
    # the rendered page holds no element the model wrote
    browser.execute_script("document.getElementById('log').innerHTML = minirunMarkdown.render(arguments[0])",
                           "<b id=evil>x</b>")
    assert browser.find_elements(By.ID, "evil") == []


def test_a_question_streams_into_the_page(served, browser, engine):
    open_page(browser, served, max_tokens="40")
    with slow_steps(engine, 0.03):
        el = ask(browser, "Hello there")
        wait(browser, lambda: el.get_attribute("data-state") == "streaming"
             and el.find_element(By.CLASS_NAME, "content").text != "")
        partial = el.find_element(By.CLASS_NAME, "content").text
        finished(browser, el)
    full = el.find_element(By.CLASS_NAME, "content").text
    assert len(full) > len(partial) and full.startswith(partial[:5])
    assert engine.last_result.finish_reason == "length" and len(engine.last_result.tokens) == 40
    stats = stats_of(el)
    assert int(stats["prompt-tokens"]) == engine.last_result.prompt_tokens
    assert float(stats["tps"]) > 0 and "40 answer tokens" in stats["text"]
    tags = {e.tag_name for e in el.find_elements(By.CSS_SELECTOR, ".content *")}
    assert tags <= {"p", "br", "strong", "em", "code", "pre", "ul", "ol", "li", "a", "h3", "h4", "h5", "h6"}, tags
    assert severe(browser) == []


def test_stop_ends_the_answer_and_frees_the_server(served, browser, engine):
    open_page(browser, served, max_tokens="")      # no limit: until the context ends
    worker = served.server.worker
    with slow_steps(engine, 0.05):
        el = ask(browser, "Tell me everything")
        wait(browser, lambda: el.find_element(By.CLASS_NAME, "content").text != "")
        browser.find_element(By.ID, "stop").click()
        finished(browser, el, ("stopped",))
        t0 = time.perf_counter()
        wait(browser, lambda: not worker.busy, timeout=5)
        freed_s = time.perf_counter() - t0
    assert freed_s < 2, f"the server went on for {freed_s:.1f} s after the page stopped"
    assert engine.last_result.finish_reason == "cancelled"
    assert len(engine.last_result.tokens) < 200
    assert "stopped" in stats_of(el)["text"]
    assert browser.find_element(By.ID, "send").is_displayed()
    settings(browser, max_tokens="8")
    finished(browser, ask(browser, "And now?"), timeout=15)   # the next question is answered at once
    assert severe(browser) == []


def test_an_attached_file_is_sent_and_cached(served, browser, engine, tmp_path):
    doc = tmp_path / "notes.txt"
    doc.write_text("The lighthouse keeper's log. " * 30)
    doc_tokens = len(engine.tokenize(doc.read_text()))
    open_page(browser, served, max_tokens="8")
    browser.find_element(By.ID, "file").send_keys(str(doc))
    wait(browser, lambda: "notes.txt" in browser.find_element(By.ID, "attachment").text)
    first = finished(browser, ask(browser, "What does the log say?"))
    assert "notes.txt" in browser.find_elements(By.CSS_SELECTOR, "#log .msg.user")[-1].text
    assert not browser.find_element(By.ID, "attachment").is_displayed()
    assert int(stats_of(first)["prompt-tokens"]) > doc_tokens
    assert "lighthouse keeper's log" in engine.detokenize(engine._cached_ids)
    second = finished(browser, ask(browser, "Who wrote it?"))
    assert int(stats_of(second)["cached-tokens"]) > doc_tokens     # the document came from the cache
    assert "cached" in stats_of(second)["text"]
    browser.find_element(By.ID, "new-chat").click()
    assert answers(browser) == []
    assert severe(browser) == []


def test_an_over_long_file_shows_the_servers_error(served, browser, tmp_path):
    doc = tmp_path / "book.txt"
    doc.write_text("word " * CTX)
    open_page(browser, served, max_tokens="8")
    browser.find_element(By.ID, "file").send_keys(str(doc))
    el = ask(browser, "Summarise it")
    finished(browser, el, ("error",))
    assert "longer than the context of 2048 tokens" in el.text
    assert browser.find_element(By.ID, "input").get_attribute("value") == "Summarise it"   # to ask again
    assert severe(browser, allow=(400,)) == []
    finished(browser, ask(browser, "Short one"))         # the conversation goes on without the file
    assert severe(browser) == []


def test_the_page_asks_for_the_api_key(keyed, browser):
    assert get_json(keyed.url + "/props")["api_key_required"] is True      # reachable without the key
    open_page(browser, keyed, max_tokens="4")
    el = ask(browser, "Hi")
    wait(browser, lambda: browser.find_element(By.ID, "key-dialog").is_displayed())
    browser.find_element(By.ID, "key-input").send_keys(KEY + "\n")
    finished(browser, el)
    assert browser.execute_script("return localStorage.getItem('minirun.apiKey')") == KEY
    finished(browser, ask(browser, "Again"))              # the kept key: no second prompt
    assert severe(browser, allow=(401,)) == []


def test_the_page_fits_a_phone(served, browser):
    # a headless window is at least 500 pixels wide: the viewport is set as a phone reports it
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": 390, "height": 844, "deviceScaleFactor": 3, "mobile": True})
    try:
        open_page(browser, served, max_tokens="8")
        finished(browser, ask(browser, "Hello from a phone"))
        width = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
        assert width[1] == 390
        assert width[0] <= width[1], f"the page is {width[0]} px wide in a {width[1]} px window"
        assert browser.find_element(By.ID, "facts").text.startswith("tiny · context")   # the name moved there
        for name in ("send", "new-chat", "input"):
            el = browser.find_element(By.ID, name)
            assert el.is_displayed() and el.rect["x"] + el.rect["width"] <= width[1]
        assert severe(browser) == []
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
