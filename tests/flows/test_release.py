"""The release flow end to end on the default model: every pipeline flow runs as its subflow, reported to a real
Prefect server (`prefect server start`, with its UI); a headless browser then finds the release summary and a drill
plot among the runs' artifacts in that UI."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from engine.canary import CanaryPlan, CanaryStep
from engine.control.client import ControlClient
from flows.drill_flows import FaultDrillParams, LoadDrillParams
from flows.release import ReleaseParams, release
from engine.runtime.process import free_port, start_service
from harness.canary import SHARED_CORES_JUDGE
from tideflow_kernels.spec import BuildRequest

# The whole release pipeline and the Prefect UI: about 3.5 minutes on 2 cores; `make test-slow` (CI) runs it.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prefect_ui(tideflow_home, tmp_path_factory):
    """`prefect server start` on a free port (the API and the UI a user opens), for this module's runs."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-ui")), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": base + "/api"}  # where the UI's pages call the API (default: port 4200)
    server = start_service("prefect-server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                              "--port", str(port)],
                           tideflow_home / "logs" / "prefect-ui.log", base + "/api/health", timeout_s=180, env=env)
    try:
        with temporary_settings(updates={PREFECT_API_URL: base + "/api"}):
            yield base
    finally:
        server.stop(grace_s=30)


@pytest.fixture(scope="module")
def release_run(flow_home, prefect_ui):
    params = ReleaseParams(
        kernels=BuildRequest(target="all", arch="native", bench_iters=2),
        spec_file=REPO / "deployments" / "groups" / "tiny-pd.yaml",
        plan=CanaryPlan(steps=[CanaryStep(percent=p, hold_s=3, max_hold_s=90) for p in (25, 100)],
                        judge=SHARED_CORES_JUDGE, drain_s=5),
        canary_traffic_rps=6.0,
        load=LoadDrillParams(steps=[1.0, 2.0], hold_s=3.0, output_len="fixed:8"),
        fault=FaultDrillParams(repeats=1, rate=2.0, duration_s=3.0, standby=True),
    )
    return release(params, return_state=True)


def test_release_promotes_the_new_version_and_drills_it(release_run):
    state = release_run
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary.kernels_ok
    assert summary.weights["v1"].endswith("/models/default/v1/") and summary.weights["v2"].endswith("/v2/")
    assert summary.canary_decision == "promoted", summary.canary_reason
    assert summary.serving["tideflow-v2"] == 100.0 and summary.serving.get("tideflow-v1", 0.0) == 0.0
    traffic = summary.canary_traffic
    assert traffic["sent"] == traffic["ok"] + traffic["error"] and traffic["sent"] > 0
    assert summary.load_accounted and summary.load_sent == summary.load_ok + summary.load_error
    assert summary.load_ok > 0
    assert summary.fault_accounted and all(r is not None for r in summary.fault_recover_s)
    assert summary.fault_errors == 0 and summary.fault_lost_tokens == 0 and summary.fault_duplicated_tokens == 0
    assert summary.fault_clean
    with ControlClient.connect() as client:  # the drill's standby copy is gone, the winner serves under its name
        serving = {g["name"]: g["weight"] for g in client.groups()}
    assert serving.get("tideflow-v2", 0) > 0 and "tideflow-v2-warm" not in serving


BROWSER, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
PLOT = "load-drill-latency-per-step-png"  # tasks.drills attaches each drill plot under load-drill-<file>


@pytest.mark.skipif(not (BROWSER and DRIVER), reason="Debian's chromium and chromium-driver: make browser")
def test_the_prefect_ui_shows_the_release_summary_and_a_drill_plot(release_run, prefect_ui):
    """Opened as an SRE would: the release run's Artifacts tab lists the summary; the load drill's run lists its
    plots, and the plot's page renders the image (a PNG the browser decoded, not a broken link)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    assert release_run.is_completed(), release_run.message
    with httpx.Client(base_url=prefect_ui + "/api", trust_env=False, timeout=30) as api:
        found = api.post("/artifacts/filter", json={"artifacts": {"key": {"any_": [PLOT]}}}).json()
    assert found, "the load drill left no latency plot"
    drill_run = found[0]["flow_run_id"]

    options = Options()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.binary_location = BROWSER
    browser = webdriver.Chrome(options=options, service=Service(DRIVER))
    body = lambda: browser.find_element(By.TAG_NAME, "body").text  # noqa: E731
    try:
        def artifact_page(run_id: str, key: str) -> str:
            """The run's page, its Artifacts tab, and the link to the artifact `key` listed there."""
            browser.get(f"{prefect_ui}/runs/flow-run/{run_id}")
            tab = WebDriverWait(browser, 60).until(lambda b: b.find_elements(By.CSS_SELECTOR, "li.p-tab#artifacts"),
                                                   f"run {run_id} has no Artifacts tab: {body()[:800]} {browser.get_log('browser')}")
            tab[0].click()
            link = WebDriverWait(browser, 60).until(
                lambda b: next((a for a in b.find_elements(By.TAG_NAME, "a") if key in a.text), None),
                f"{key} is not among run {run_id}'s artifacts: {body()[:800]}")
            return link.get_attribute("href")

        browser.get(artifact_page(str(release_run.state_details.flow_run_id), "release-summary"))
        WebDriverWait(browser, 60).until(lambda b: "canary: promoted" in body() and "fault drill" in body(),
                                         f"the release summary did not render: {body()[:800]}")
        browser.get(artifact_page(drill_run, PLOT))
        plot = WebDriverWait(browser, 60).until(
            lambda b: next((i for i in b.find_elements(By.TAG_NAME, "img")
                            if (i.get_attribute("src") or "").startswith("data:image/png")
                            and browser.execute_script("return arguments[0].naturalWidth", i) > 0), None),
            f"no rendered plot: {body()[:800]}")
        assert browser.execute_script("return arguments[0].naturalHeight", plot) > 100
    finally:
        browser.quit()
