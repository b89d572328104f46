"""Seeing a run: the dashboard in a real Chromium, `asyncrl plot`, and the metric registry, on the files of a
real tiny `asyncrl rl` run (the `runs` fixture, conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from servers import free_port

from asyncrl.metric_names import describe
from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.integration


def test_every_metric_a_run_logs_is_documented(runs):
    names = {k for r in read_jsonl(runs / "first" / "metrics.jsonl") for k in r if k not in ("step", "source", "time")}
    assert "reward/reverse_text/mean" in names and "eval/reverse_text/pass@1" in names
    assert sorted(n for n in names if describe(n) is None) == []


def test_plot_writes_a_png_of_each_standard_curve(runs, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "asyncrl", "plot", str(runs / "first"), str(runs / "second"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in ("overview.png", "reward.png", "loss.png", "mismatch_kl.png", "off_policy_lag.png", "throughput.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert (tmp_path / name).stat().st_size > 10_000


def test_plot_names_a_folder_without_metrics(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "asyncrl", "plot", str(tmp_path), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == f"asyncrl plot: error: '{tmp_path / 'metrics.jsonl'}' not found " + (
        "(give run folders: the output_dir of asyncrl rl or sft)"
    )


@pytest.fixture
def dashboard(runs, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "asyncrl", "dashboard", str(runs), "--port", str(port)]
    with open(tmp_path / "dashboard.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, (tmp_path / "dashboard.log").read_text()
                try:
                    if httpx.get(f"{url}/api/runs", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "dashboard did not answer in 60 s"
                time.sleep(0.1)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=10)


def test_dashboard_serves_each_runs_metrics_configs_logs_and_samples(dashboard):
    assert [r["name"] for r in httpx.get(f"{dashboard}/api/runs").json()] == ["first", "second"]
    metrics = httpx.get(f"{dashboard}/api/runs/first/metrics").json()
    assert {r["source"] for r in metrics["records"]} == {"orchestrator", "trainer"}
    assert metrics["charts"]["reward/reverse_text/mean"]["chart"] == "reward"
    again = httpx.get(f"{dashboard}/api/runs/first/metrics", params={"offset": metrics["offset"]}).json()
    assert again["records"] == [] and again["offset"] == metrics["offset"]
    configs = httpx.get(f"{dashboard}/api/runs/first/configs").json()
    assert set(configs) == {"rl", "inference", "orchestrator", "trainer"}
    logs = httpx.get(f"{dashboard}/api/runs/first/logs").json()["logs"]
    assert {"inference.log", "orchestrator.log", "trainer.log", "trainer/rank_0.log"} <= set(logs)
    tail = httpx.get(f"{dashboard}/api/runs/first/logs", params={"name": "orchestrator.log", "lines": 3}).json()
    assert len(tail["text"].splitlines()) == 3
    assert httpx.get(f"{dashboard}/api/runs/first/logs", params={"name": "../metrics.jsonl"}).status_code == 404
    samples = httpx.get(f"{dashboard}/api/runs/first/samples").json()
    assert samples["steps"] == [1, 2, 3] and samples["step"] == 3
    envs = [r["env"] for r in samples["records"]]
    assert all("samples" in r for r in samples["records"])  # the orchestrator's own lines are token-level too
    assert envs[-2:] == ["reverse_text", "wordle"] and set(envs[:-2]) == {"reverse_text"}


def chromium_driver():
    """Chromium from the distribution's packages, driven by its chromedriver (never a downloaded browser)."""
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--window-size=1400,1100",
    ):  # fmt: skip
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={Path(os.environ.get('TMPDIR', '/tmp')) / f'chromium-{os.getpid()}'}")
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def wait_for(condition, timeout: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.2)


@pytest.mark.browser
def test_dashboard_in_chromium_charts_live_metrics_compares_runs_and_colours_tokens(dashboard, runs, tmp_path):
    browser = chromium_driver()  # skips where selenium, chromium or its driver is missing
    from selenium.webdriver.common.by import By

    try:
        browser.get(dashboard)

        def reward_points() -> str | None:  # the chart is redrawn as series arrive: find it afresh each time
            script = "return document.querySelector(\"div.chart[data-chart='reward']\")?.dataset.points"
            return browser.execute_script(script)

        wait_for(lambda: reward_points() == "3", what="3 reward points")
        chart = browser.find_elements(By.CSS_SELECTOR, "div.chart[data-chart='reward']")
        assert chart[0].find_elements(By.TAG_NAME, "canvas")
        charts = [c.get_attribute("data-chart") for c in browser.find_elements(By.CSS_SELECTOR, "div.chart")]
        for title in ("reward", "eval avg@n and pass@k", "loss", "mismatch_kl", "off-policy lag", "throughput"):
            assert title in charts
        legend = chart[0].find_element(By.CLASS_NAME, "u-legend").text
        assert "first: reward/mean" in legend and "second: reward/mean" in legend  # both runs, side by side

        # The run goes on: a new line in metrics.jsonl reaches the open page.
        line = {"step": 4, "source": "orchestrator", "time": time.time(), "reward/mean": 0.5}
        with open(runs / "second" / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        wait_for(lambda: reward_points() == "4", what="the appended step")

        browser.find_element(By.CSS_SELECTOR, "button[data-tab='rollouts']").click()
        tokens = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#samples .tok"), what="tokens")
        coloured = [t for t in tokens if t.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "")]
        assert coloured, "no token is coloured by advantage"
        roles = browser.find_element(By.ID, "samples").text
        assert "assistant, turn 2" in roles and "environment" in roles  # the wordle episode, turn by turn
        browser.find_element(By.CSS_SELECTOR, "input[name=colour][value=logprob]").click()
        wait_for(lambda: "exp(logprob)" in browser.find_element(By.ID, "legend").text, what="the logprob legend")
        browser.save_screenshot(str(tmp_path / "rollouts.png"))
        browser.find_element(By.CSS_SELECTOR, "button[data-tab='charts']").click()
        time.sleep(0.5)
        browser.save_screenshot(str(tmp_path / "charts.png"))
        assert (tmp_path / "charts.png").stat().st_size > 20_000
    finally:
        browser.quit()
