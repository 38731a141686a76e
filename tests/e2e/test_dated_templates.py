"""End to end: chat templates that print today's date, served with ``--chat-template-file``.

llama-server gives every template today's date (``date_string``, ``datetime``), and its Jinja
engine concatenates a missing variable next to a string as "": without them a Llama 3.1 template
prints its fixed fallback date and Firefunction v2 cannot render (400). The templates are the test-written ones of tests/chat/test_template_dates.py.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.chat.test_template_dates import FIREFUNCTION_STYLE, LLAMA31_STYLE, TOOLS

pytestmark = pytest.mark.e2e


def _serve(server_factory, llama_dir: Path, tmp_path: Path, name: str, source: str):
    path = tmp_path / f"{name}.jinja"
    path.write_text(source, encoding="utf-8")
    return server_factory(["-m", str(llama_dir), "-np", "1", "-c", "1024", "--chat-template-file", str(path)])


def test_llama3_template_prints_today_and_firefunction_v2_serves(server_factory, llama_dir: Path, tmp_path: Path) -> None:
    llama = _serve(server_factory, llama_dir, tmp_path, "llama31", LLAMA31_STYLE)
    fire = _serve(server_factory, llama_dir, tmp_path, "firefunction", FIREFUNCTION_STYLE)
    messages = [{"role": "user", "content": "What day is it?"}]
    with httpx.Client(base_url=llama.base_url, timeout=60) as client:
        before = datetime.now()
        prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
        after = datetime.now()
        assert "Cutting Knowledge Date: December 2023\nToday Date: " in prompt
        today = prompt.split("Today Date: ", 1)[1].split("\n", 1)[0]
        assert today in {before.strftime("%d %b %Y"), after.strftime("%d %b %Y")}
    with httpx.Client(base_url=fire.base_url, timeout=60) as client:
        before = datetime.now()
        prompt = client.post("/apply-template", json={"messages": messages, "tools": TOOLS}).json()["prompt"]
        after = datetime.now()
        stamp = prompt.split("Available functions as JSON spec:\n\nToday is ", 1)[1].split(".", 1)[0]
        assert stamp in {before.strftime("%b %d %Y"), after.strftime("%b %d %Y")}
        response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["role"] == "assistant"
