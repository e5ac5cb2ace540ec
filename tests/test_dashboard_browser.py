"""The dashboard in a real browser: headless Chromium (Debian's chromium and
chromium-driver; `make browser` installs them) driven by Selenium. Its numbers match
`batchery queue stats --json`, it refreshes without reloading, and its retry button works."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import redis
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By

from batchery import Client
from batchery.batching.queue import RequestQueue
from tests.conftest import run_cli, start_worker, stop_process, wait_for
from tests.dashboard_helpers import TOKEN, browser, dashboard  # noqa: F401 (browser: a fixture)

ENV_SCREENSHOT = "BATCHERY_DASHBOARD_SCREENSHOT"  # also save the page here (docs/dashboard.png)


def page_numbers(driver: webdriver.Chrome, queue: str) -> dict[str, Any] | None:
    """The queue's row as the page shows it, in `batchery queue stats --json`'s shape (read in
    one script: the page swaps its content at every poll)."""
    cells = driver.execute_script(
        "const row = document.querySelector(`tr[data-queue='${arguments[0]}']`);"
        "if (!row) return null; const out = {};"
        "row.querySelectorAll('[data-field]').forEach(c => out[c.dataset.field] = c.textContent.trim());"
        "return out;", queue)
    if cells is None:
        return None
    return {"pending": int(cells["pending"]), "inflight": int(cells["inflight"]),
            "dead": int(cells["dead"]), "workers": int(cells["workers"]),
            "pending_by_priority": {k.split(".", 1)[1]: int(v) for k, v in cells.items()
                                    if k.startswith("pending_by_priority.")}}


def text_of(driver: webdriver.Chrome, selector: str) -> str:
    return driver.execute_script("const e = document.querySelector(arguments[0]);"
                                 "return e ? e.textContent : '';", selector)


def click(driver: webdriver.Chrome, selector: str) -> bool:
    """A real click on the element; False when a refresh replaced it under us (try again)."""
    try:
        driver.find_element(By.CSS_SELECTOR, selector).click()
        return True
    except StaleElementReferenceException:
        return False


def stats_json(redis_url: str, queue: str) -> dict[str, Any]:
    done = run_cli("queue", "stats", "--json", "--queue", queue, redis_url=redis_url)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)["queues"][queue]
    return {k: stats[k] for k in ("pending", "inflight", "dead", "workers", "pending_by_priority")}


def test_the_page_matches_stats_and_its_retry_button_works(
        browser: webdriver.Chrome, redis_url: str, rconn: redis.Redis, queue_name: str,
        tmp_path: Path) -> None:
    served, idle = f"{queue_name}-a", f"{queue_name}-b"
    RequestQueue(rconn, served).update_settings(lease_seconds=2)
    worker = start_worker(redis_url, served, "--runner", "tests.runners:fails_on_bad")
    try:
        with Client(redis_url, served) as client:
            handles = client.enqueue_many([{"input": "fine"}, {"input": "bad"}])
            assert [h.result(timeout=30).status for h in handles] == ["ok", "dead"]
        with Client(redis_url, idle) as client:
            client.enqueue_many([{"input": i, "priority": p}
                                 for i, p in enumerate(["realtime", "normal", "batch", "batch"])])
        with dashboard(redis_url, tmp_path) as board:
            browser.get(f"{board.url}?token={TOKEN}")
            browser.execute_script("window.notReloaded = true")
            for queue in (served, idle):  # the worker is live and idle: nothing moves
                expected = stats_json(redis_url, queue)
                wait_for(lambda: page_numbers(browser, queue) == expected, 30, 0.2,
                         message=f"{queue} on the page equal to {expected}")
            assert page_numbers(browser, idle)["pending_by_priority"] == {
                "batch": 2, "normal": 1, "realtime": 1}
            worker_row = browser.execute_script(  # other tests' stale workers may be listed too
                "return [...document.querySelectorAll('#workers tbody tr')]"
                ".map(r => r.textContent).find(t => t.includes(arguments[0]))", served)
            assert "tests.runners:fails_on_bad" in worker_row and "live" in worker_row

            assert stop_process(worker) == 0  # so the retried request stays pending
            wait_for(lambda: page_numbers(browser, served)["workers"] == 0, 30, 0.2,
                     message="the stopped worker gone from the page")
            wait_for(lambda: click(browser, f'#dead tr[data-dead="{handles[1].id}"] button'), 30,
                     0.05, message="a click on the dead letter's retry button")
            wait_for(lambda: "1 request(s) back in queue" in text_of(browser, "#flash"), 30, 0.1,
                     message="the retry button's answer")
            expected = stats_json(redis_url, served)
            assert expected["dead"] == 0 and expected["pending"] == 1
            wait_for(lambda: page_numbers(browser, served) == expected, 30, 0.2,
                     message=f"the page after retry equal to {expected}")
            assert browser.execute_script("return window.notReloaded") is True
            if os.environ.get(ENV_SCREENSHOT):
                browser.save_screenshot(os.environ[ENV_SCREENSHOT])
    finally:
        stop_process(worker)


def test_without_the_token_the_page_reads_but_its_buttons_are_off(
        browser: webdriver.Chrome, redis_url: str, rconn: redis.Redis, queue_name: str,
        tmp_path: Path) -> None:
    queue = RequestQueue(rconn, queue_name)
    queue.register()
    with Client(redis_url, queue_name) as client:
        client.enqueue("will be dead")
    [claimed] = queue.claim("w#1", 1, 100, 0, 10).batch  # dead-letter it by hand
    queue.update_settings(max_attempts=1)
    queue.fail([(claimed.id, "w#1", json.dumps({"id": claimed.id, "status": "dead",
                                                 "error": {"type": "Boom", "message": "boom"}}))])
    assert queue.stats()["dead"] == 1
    with dashboard(redis_url, tmp_path) as board:
        browser.get(board.url)
        assert browser.execute_script(  # other tests' queues may have dead letters too
            "return [...document.querySelectorAll(`#dead button[data-post*='/${arguments[0]}/']`)]"
            ".map(b => b.disabled)", queue_name) == [True] * 4  # retry and purge: all, one
        assert "read-only" in text_of(browser, "header")
        forced = browser.execute_async_script(
            "const done = arguments[0];"
            f"fetch('api/queues/{queue_name}/dead/retry', {{method: 'POST', body: '{{\"all\": true}}'}})"
            ".then(r => done(r.status))")
        assert forced == 403 and queue.stats()["dead"] == 1
