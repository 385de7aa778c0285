"""The browser pages (pyserve.server.playground) in Debian's Chromium, driven by Selenium through
Debian's chromedriver (`make browser` installs both), on a real stories260k server with
--api-key: the page's calls get 401 until the key is typed; a streamed reply grows on the page
token by token and ends equal to the API's greedy answer; Stop aborts the request and the
server frees its KV; the status panel follows the server under load; /docs renders the API
reference from this server alone (no CDN). Small max_tokens throughout: 2 cores."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from pyserve.server.playground import FILES, MEDIA_TYPES
from tests.conftest import CHAT_TEMPLATE, ServerProcess, is_idle, start_server

KEY = "sk-playground-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
POOL_TOKENS = 2048
MODEL = "stories260k"
PROMPT = "Tell me a story about a cat."
WAIT_S = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_path) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory,
        "playground",
        [
            "--model-path",
            str(stories_path),
            "--max-total-tokens",
            str(POOL_TOKENS),
            "--chat-template",
            str(CHAT_TEMPLATE),
            "--api-key",
            KEY,
        ],
    )
    try:
        yield srv
        info = wait_idle(srv)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL_TOKENS
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        message = "no chromium / chromedriver: run `make browser` (Debian's chromium and chromium-driver)"
        if os.environ.get("PYSERVE_REQUIRE_CLIENTS"):
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    try:
        yield driver
    finally:
        driver.quit()


def server_info(server: ServerProcess) -> dict[str, Any]:
    r = httpx.get(server.base_url + "/get_server_info", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(server: ServerProcess) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while not is_idle(info := server_info(server)):
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    return info


def kv_used(info: dict[str, Any]) -> int:
    """KV slots held by requests (the evictable prefix cache apart)."""
    return info["kv_total_slots"] - info["kv_free_slots"] - info["kv_evictable_slots"]


def finished_requests(server: ServerProcess) -> dict[str, float]:
    """sglang:num_requests_total by finish reason, from /metrics (open without the key)."""
    text = httpx.get(server.base_url + "/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "sglang:num_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["finish_reason"]] = sample.value
    return out


def open_page(driver: webdriver.Chrome, server: ServerProcess, path: str = "/", key: str | None = KEY) -> None:
    """Load `path` with `key` stored as the page's API key (None: no key)."""
    driver.get(server.base_url + "/health")  # (the origin, to set its localStorage first)
    if key is None:
        driver.execute_script("localStorage.clear()")
    else:
        driver.execute_script("localStorage.setItem('pyserve.apiKey', arguments[0])", key)
    driver.get(server.base_url + path)


def wait_for(driver: webdriver.Chrome, condition, timeout_s: float = WAIT_S):
    return WebDriverWait(driver, timeout_s, poll_frequency=0.05).until(lambda d: condition())


def text_of(driver: webdriver.Chrome, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def set_settings(driver: webdriver.Chrome, **values: Any) -> None:
    """Set form fields by id (checkboxes take a bool)."""
    for element_id, value in values.items():
        driver.execute_script(
            "const el = document.getElementById(arguments[0]);"
            "if (el.type === 'checkbox') el.checked = arguments[1]; else el.value = arguments[1];",
            element_id.replace("_", "-"),
            value,
        )


def record_assistant_text(driver: webdriver.Chrome) -> None:
    """From now on window.__snapshots holds each distinct text the last assistant message shows,
    in order (a MutationObserver: every DOM change, not a poll)."""
    driver.execute_script(
        """
        window.__snapshots = [];
        new MutationObserver(() => {
          const items = document.querySelectorAll("#messages .msg.assistant .content");
          if (!items.length) return;
          const text = items[items.length - 1].textContent, s = window.__snapshots;
          if (text && s[s.length - 1] !== text) s.push(text);
        }).observe(document.getElementById("messages"), {childList: true, subtree: true, characterData: true});
        """
    )


def last_assistant_text(driver: webdriver.Chrome) -> str:
    return driver.execute_script(
        "const items = document.querySelectorAll('#messages .msg.assistant .content');"
        "return items.length ? items[items.length - 1].textContent : null;"
    )


def send(driver: webdriver.Chrome, prompt: str) -> None:
    set_settings(driver, prompt=prompt)
    driver.find_element(By.ID, "send").click()


def api_chat(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_file_of_the_pages_is_served_without_the_key(server):
    """Each as shipped (so no server data in any) with its media type and policy."""
    for url, (path, policy) in FILES.items():
        r = httpx.get(server.base_url + url)
        assert (r.status_code, r.content) == (200, path.read_bytes()), url
        assert r.headers["content-type"] == MEDIA_TYPES[path.suffix], url
        assert r.headers.get("content-security-policy") == policy, url
        assert r.headers["x-content-type-options"] == "nosniff", url
    # only those files: no other path under /static is open, nor any file there
    unknown = server.base_url + "/static/app.py"
    assert (httpx.get(unknown).status_code, httpx.get(unknown, headers=AUTH).status_code) == (401, 404)
    # and never in the API's own document
    paths = httpx.get(server.base_url + "/openapi.json", headers=AUTH).json()["paths"]
    assert "/v1/chat/completions" in paths and not set(FILES) & set(paths)


def test_pages_are_open_but_their_calls_need_the_key(server, browser):
    assert httpx.get(server.base_url + "/v1/models").status_code == 401

    open_page(browser, server, key=None)
    wait_for(browser, lambda: text_of(browser, "notice").startswith("401: "))
    wait_for(browser, lambda: browser.find_element(By.ID, "status-state").get_attribute("data-state") == "error")
    assert text_of(browser, "status-state").startswith("401: ")
    assert browser.find_elements(By.CSS_SELECTOR, "#model option") == []

    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.ID, "save-key").click()
    wait_for(browser, lambda: [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#model option")] == [MODEL])
    assert browser.execute_script("return localStorage.getItem('pyserve.apiKey')") == KEY
    assert not browser.find_element(By.ID, "notice").is_displayed()
    wait_for(browser, lambda: browser.find_element(By.ID, "status-state").get_attribute("data-state") == "live")


def test_streamed_reply_grows_token_by_token_and_equals_the_greedy_answer(server, browser):
    max_tokens = 64
    expected = api_chat(
        server,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "temperature": 0,
            "top_p": 1,
            "max_tokens": max_tokens,
        },
    )
    open_page(browser, server)
    wait_for(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#model option"))
    set_settings(browser, temperature="0", top_p="1", max_tokens=str(max_tokens), stream=True)
    record_assistant_text(browser)
    send(browser, PROMPT)
    stats = browser.find_element(By.ID, "stats")
    wait_for(browser, lambda: stats.get_attribute("data-state") == "done")

    snapshots = browser.execute_script("return window.__snapshots")
    answer = expected["choices"][0]["message"]["content"]
    assert snapshots[-1] == answer and last_assistant_text(browser) == answer
    assert len(snapshots) >= 3, snapshots  # shown as it arrived, not at the end
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(snapshots, snapshots[1:]))
    completion_tokens = expected["usage"]["completion_tokens"]
    assert completion_tokens == max_tokens
    # token counts from the stream's usage chunk, TTFT and speed
    parts = stats.text.split(" · ")
    assert parts[0].startswith(f"prompt {expected['usage']['prompt_tokens']} (cached ")
    assert parts[1] == f"completion {completion_tokens}"
    assert parts[2].startswith("TTFT ") and parts[2].endswith(" ms")
    assert parts[3].endswith(" tok/s") and float(parts[3].split()[0]) > 0
    assert parts[4] == "finish: length"


def test_structured_output_equals_the_api(server, browser):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "top_p": 1,
        "max_tokens": 24,
        "response_format": response_format,
    }
    answer = api_chat(server, body)["choices"][0]["message"]["content"]
    open_page(browser, server)
    wait_for(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#model option"))
    set_settings(browser, temperature="0", top_p="1", max_tokens="24", schema=json.dumps(schema))
    send(browser, PROMPT)
    wait_for(browser, lambda: browser.find_element(By.ID, "stats").get_attribute("data-state") == "done")
    assert last_assistant_text(browser) == answer
    # (the schema made the difference: JSON, where the same request without it tells a story)
    free = api_chat(server, {k: v for k, v in body.items() if k != "response_format"})["choices"][0]["message"]
    assert answer.startswith("{") and not free["content"].startswith("{")


def test_stop_aborts_the_request_and_the_server_frees_its_kv(server, browser):
    before = wait_idle(server)
    finished_before = finished_requests(server)
    open_page(browser, server)
    wait_for(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#model option"))
    # the whole context (ignore_eos: no early end), so Stop comes long before the last token
    set_settings(browser, temperature="0", max_tokens="400", extra='{"ignore_eos": true}')
    send(browser, PROMPT)
    wait_for(browser, lambda: last_assistant_text(browser))
    assert server_info(server)["num_running_reqs"] == 1
    browser.find_element(By.ID, "stop").click()
    stats = browser.find_element(By.ID, "stats")
    wait_for(browser, lambda: stats.get_attribute("data-state") == "stopped")
    assert stats.text.endswith("stopped")
    assert "stopped" in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].get_attribute("class")
    after = wait_idle(server)
    assert (after["num_running_reqs"], kv_used(after)) == (0, kv_used(before)) == (0, 0)
    finished = finished_requests(server)
    assert finished.get("abort", 0) == finished_before.get("abort", 0) + 1
    assert finished.get("length", 0) == finished_before.get("length", 0)
    assert len(last_assistant_text(browser)) > 0


def test_status_panel_follows_the_server_under_load(server, browser):
    open_page(browser, server)
    state = browser.find_element(By.ID, "status-state")
    wait_for(browser, lambda: state.get_attribute("data-state") == "live")
    stop = threading.Event()
    num_sent = [0]

    def load() -> None:  # requests back to back until the panel saw them (at most 500 or 30 s)
        deadline = time.monotonic() + 30
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}
        while not stop.is_set() and num_sent[0] < 500 and time.monotonic() < deadline:
            num_sent[0] += 1
            assert httpx.post(server.base_url + "/generate", json=body, headers=AUTH, timeout=60).status_code == 200

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(browser, lambda: int(text_of(browser, "status-running")) > 0)
        wait_for(browser, lambda: text_of(browser, "status-gen").endswith(" tok/s"))
        wait_for(browser, lambda: float(text_of(browser, "status-gen").split()[0]) > 0)
        wait_for(browser, lambda: int(browser.find_element(By.ID, "status-kv").get_attribute("data-used")) > 0)
    finally:
        stop.set()
        for t in threads:
            t.join()
    info = wait_idle(server)
    total = info["kv_total_slots"]
    wait_for(browser, lambda: text_of(browser, "status-running") == "0")
    wait_for(browser, lambda: text_of(browser, "status-kv") == f"0 / {total} (0.0%)")
    wait_for(browser, lambda: text_of(browser, "status-gen") == "0.0 tok/s")
    info = server_info(server)  # (idle: the figures hold still)
    assert text_of(browser, "status-queued") == "0"
    assert text_of(browser, "status-cached") == str(info["kv_evictable_slots"])
    assert text_of(browser, "status-hit") == f"{100 * info['cache_hit_rate']:.1f}%"


def test_docs_render_the_api_reference_offline(server, browser):
    open_page(browser, server, "/docs")
    chat = '.operation[data-method="post"][data-path="/v1/chat/completions"]'
    wait_for(browser, lambda: browser.find_elements(By.CSS_SELECTOR, chat))
    operations = browser.find_elements(By.CSS_SELECTOR, ".operation")
    document = httpx.get(server.base_url + "/openapi.json", headers=AUTH).json()
    assert len(operations) == sum(len(item) for item in document["paths"].values())
    browser.find_element(By.CSS_SELECTOR, chat + " summary").click()
    assert "request body (JSON): ChatCompletionRequest" in browser.find_element(By.CSS_SELECTOR, chat).text
    schema = browser.find_element(By.ID, "schema-ChatCompletionRequest")
    assert "messages required" in schema.text
    # every file the page loaded came from this server (no CDN)
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert server.base_url + "/openapi.json" in loaded
    assert all(url.startswith(server.base_url + "/") for url in loaded), loaded
    # without the key the document is refused, and the page says so
    open_page(browser, server, "/docs", key=None)
    wait_for(browser, lambda: text_of(browser, "notice").startswith("401: "))
    assert browser.find_elements(By.CSS_SELECTOR, ".operation") == []
