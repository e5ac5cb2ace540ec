"""The docs' dashboard screenshot (docs/dashboard.png), from a real scene.

A private embedded Redis (in a temporary BATCHERY_HOME); queue `embed`: the packaged
MiniLM worker, an offline job of paragraphs (batch class) and a trickle of interactive
requests; queue `rerank`: a worker that fails on poisoned inputs (dead letters) and is
then killed (stale, and its queue left without a live worker). After SECONDS of this
(the depth chart fills), headless Chromium takes the picture.

    python -m bench.dashboard_shot [--seconds 75] [--out docs/dashboard.png]

(docs/dashboard.png was then cut to 128 colours with Pillow, 150 KB to 50 KB.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOME = tempfile.mkdtemp(prefix="batchery-shot-")
os.environ["BATCHERY_HOME"] = HOME  # a Redis of its own, gone with the directory

from batchery import Client, embedded  # noqa: E402  (after BATCHERY_HOME is set)
from bench.corpus import paragraphs  # noqa: E402

TOKEN = "screenshot-token-0123456789"
PORT = 18480
ENV = dict(os.environ, HF_HUB_OFFLINE="1", BATCHERY_LOG_LEVEL="WARNING")


def batchery(*args: str, **kw: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchery", *args], env=ENV, cwd=ROOT, **kw)


def trickle(stop: threading.Event) -> None:
    """Interactive requests on `embed`: a realtime and two normal ones every second."""
    with Client(None, "embed") as client:
        i = 0
        while not stop.wait(1.0):
            client.enqueue_many([{"input": f"query {i}", "priority": "realtime"},
                                 {"input": f"note {i}", "priority": "normal"},
                                 {"input": f"note {i}b", "priority": "normal"}])
            i += 1


def scene(out: Path, seconds: float) -> None:
    source = Path(HOME) / "paragraphs.jsonl"
    with open(source, "w", encoding="utf-8") as f:
        for i, text in enumerate(paragraphs(20_000)):
            f.write(json.dumps({"custom_id": f"p{i}", "input": text}) + "\n")
    procs = [batchery("worker", "--queue", "embed", "--task", "embed", "--model", "minilm",
                      "--max-batch-size", "32", "--parallel-batches", "1"),
             batchery("job", "worker")]
    reranker = batchery("worker", "--queue", "rerank", "--runner", "bench.runners:poisoned")
    subprocess.run([sys.executable, "-m", "batchery", "queue", "config", "rerank",
                    "--lease-seconds", "6"], env=ENV, check=True, capture_output=True)
    stop = threading.Event()
    try:
        with Client(None, "rerank") as client:
            handles = client.enqueue_many([{"input": "poison pill"}, {"input": "fine"},
                                           {"input": {"query": "poison", "docs": 3}}])
            [h.result(timeout=120) for h in handles]
        subprocess.run([sys.executable, "-m", "batchery", "job", "submit", str(source), "-o",
                        str(Path(HOME) / "embeddings.jsonl"), "--queue", "embed",
                        "--max-in-flight", "400"], env=ENV, check=True, capture_output=True)
        threading.Thread(target=trickle, args=(stop,), daemon=True).start()
        board = batchery("dashboard", "--port", str(PORT), "--token", TOKEN, "--interval", "1",
                         stderr=subprocess.DEVNULL)
        procs.append(board)
        time.sleep(seconds / 2)
        reranker.send_signal(signal.SIGKILL)  # shows as stale from here on
        with Client(None, "rerank") as client:
            client.enqueue_many([{"input": f"doc {i}", "priority": "normal"} for i in range(40)])
        time.sleep(seconds / 2)
        shoot(f"http://127.0.0.1:{PORT}/?token={TOKEN}", out)
    finally:
        stop.set()
        for p in [*procs, reranker]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*procs, reranker]:
            p.wait(60)
        embedded.stop()


def shoot(url: str, out: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000",
                 "--hide-scrollbars"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        driver.get(url)
        time.sleep(2.5)  # two polls: the page as it refreshes itself
        height = driver.execute_script("return document.body.scrollHeight")
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {  # the whole page
            "width": 1400, "height": min(2400, height + 16), "deviceScaleFactor": 1,
            "mobile": False})
        time.sleep(1.5)
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
    finally:
        driver.quit()
    print(f"wrote {out}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=75)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = parser.parse_args()
    scene(args.out, args.seconds)


if __name__ == "__main__":
    main()
