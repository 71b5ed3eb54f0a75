"""Regenerate the README's picture of the chat page: a document attached, two questions answered.

    python scripts/screenshot_chat_page.py                      # docs/chat-page.png, 1100x640
    python scripts/screenshot_chat_page.py --size 390x844 -o /tmp/phone.png

Serves MODEL (default: the pulled SmolLM2-135M-Instruct, else a tiny random checkpoint) with
`minirun serve`'s app on a free local port, drives headless Chromium (Debian's chromium and
chromium-driver; selenium) through the page, and saves the window. Greedy answers (temperature 0),
so a run on the same model gives the same picture.
"""
from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minirun import Engine  # noqa: E402
from minirun.checkpoint.pull import default_model_dir  # noqa: E402
from minirun.checkpoint.random_checkpoint import write_random_checkpoint  # noqa: E402
from minirun.serve.server import make_server  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=4096, model_type="llama")

DOCUMENT = """The Harbour Light at Kestrel Point

The lighthouse at Kestrel Point was built in 1871 from granite quarried on the island itself.
Its tower is 38 metres tall and has 164 steps. The first keeper, Agnes Moyle, kept the light for
31 years and wrote a log entry every night, even in the storm of 1893 that took the pier.
The light was automated in 1986. Today the keeper's cottage is a small museum that opens from
April to October, and the log books are kept in its reading room.
"""
QUESTIONS = ["Who was the first keeper of the lighthouse?", "How tall is the tower?"]


def serve(model_dir: Path, ctx: int):
    """A started server over model_dir on a free local port: (server, thread, url)."""
    eng = Engine.load(model_dir, device="cpu", ctx=ctx)
    eng.generate("Hello", max_new_tokens=4)      # kernels compiled (or read from Numba's cache) before the picture
    eng.reset()
    server = make_server(eng, model_dir.name, log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}/"


def browser(width: int, height: int):
    from selenium import webdriver
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    if shutil.which("chromium"):
        opts.binary_location = shutil.which("chromium")
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=opts, service=service)
    # the viewport itself (a headless window is at least 500 pixels wide), as a phone reports it
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                                  "deviceScaleFactor": 1, "mobile": width < 600})
    return driver


def exchange(driver, url: str, document: Path, max_tokens: int) -> None:
    """Open the page, attach the document, ask QUESTIONS one after the other."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    driver.get(url)
    wait = WebDriverWait(driver, 300, poll_frequency=0.1)
    wait.until(lambda d: d.find_element(By.ID, "facts").text)
    for field, value in (("temperature", "0"), ("max-tokens", str(max_tokens))):
        driver.execute_script("arguments[0].value = arguments[1]", driver.find_element(By.ID, field), value)
    driver.find_element(By.ID, "file").send_keys(str(document))
    for q in QUESTIONS:
        box = driver.find_element(By.ID, "input")
        box.send_keys(q + "\n")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")
                   and len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
                   == len(d.find_elements(By.CSS_SELECTOR, ".msg.user")))
    driver.execute_script("document.activeElement.blur()")     # no caret in the picture


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a model directory (default: the pulled SmolLM2)")
    ap.add_argument("-o", "--out", type=Path, default=REPO / "docs" / "chat-page.png")
    ap.add_argument("--size", default="1100x640", help="the window, WIDTHxHEIGHT in CSS pixels")
    ap.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args()
    width, height = (int(v) for v in a.size.lower().split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or default_model_dir()
        if not (model / "config.json").is_file():
            print(f"screenshot_chat_page: no model at {model}: a tiny random one answers", file=sys.stderr)
            model = write_random_checkpoint(TINY, Path(tmp) / "tiny", seed=0)
        document = Path(tmp) / "kestrel-point.txt"
        document.write_text(DOCUMENT)
        server, thread, url = serve(model, ctx=4096)
        driver = browser(width, height)
        try:
            exchange(driver, url, document, a.max_tokens)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(a.out))
        finally:
            driver.quit()
            server.worker.stop(timeout=10)
            server.should_exit = True
            thread.join(10)
    print(a.out)


if __name__ == "__main__":
    main()
