"""The dashboards and the alert rules against the real thing (issue #22).

- `promtool check rules` and `promtool test rules`: each alert fires on a synthetic series and stays silent on
  a healthy one (deployments/prometheus/alerts_test.yaml).
- The committed dashboard JSON is what deployments/grafana/dashboards.py builds with grafana-foundation-sdk.
- A real Prometheus (Debian's) scrapes a fleet run by the controller in its own process: a PD group whose
  prefill is a DEP2 instance (KV transfer, expert load), a warm pool that activates a standby (activation,
  pool decisions), a canary record, and a short load through the router with the openai client. Then every
  dashboard panel's query is evaluated through Prometheus' HTTP API and must return a finite value, and every
  tideflow series the alerts read must exist.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai
import pytest

from engine.control.discovery import router_key_path
from engine.control.models import CanaryRecord, ScalePool
from engine.control.store import Store
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.scaling.policy import Bounds
from harness.prometheus import LocalPrometheus, PrometheusSetup, ScrapeJob, prometheus_binary

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deployments" / "prometheus"
GRAFANA_DIR = REPO / "deployments" / "grafana"


def dashboards_module():
    """deployments/grafana/dashboards.py (a script beside its output, not a package module)."""
    name = "tideflow_dashboards"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GRAFANA_DIR / "dashboards.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def promtool() -> str:
    found = shutil.which("promtool") or str(Path(prometheus_binary()).with_name("promtool"))
    assert Path(found).exists(), "promtool ships with Debian's prometheus package: make prometheus"
    return found


def test_alert_rules_pass_promtool_check_and_their_unit_tests():
    check = subprocess.run([promtool(), "check", "rules", "alerts.yaml"], cwd=PROMETHEUS_DIR, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    rules = int(re.search(r"SUCCESS: (\d+) rules found", check.stdout).group(1))
    tested = subprocess.run([promtool(), "test", "rules", "alerts_test.yaml"], cwd=PROMETHEUS_DIR,
                            capture_output=True, text=True, timeout=60)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    names = set(re.findall(r"^\s+- alert: (\w+)$", (PROMETHEUS_DIR / "alerts.yaml").read_text(), re.M))
    fired = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts:\n\s+- exp_labels",
                           (PROMETHEUS_DIR / "alerts_test.yaml").read_text()))
    assert len(names) == rules and fired == names  # every alert has a case where it fires


def test_committed_dashboards_are_what_the_sdk_builds(tmp_path):
    module = dashboards_module()
    for path in module.write(tmp_path):
        committed = GRAFANA_DIR / path.name
        assert committed.exists(), f"run python deployments/grafana/dashboards.py ({path.name} is missing)"
        assert json.loads(committed.read_text()) == json.loads(path.read_text()), \
            f"{path.name} differs from what dashboards.py builds: run python deployments/grafana/dashboards.py"


def _group(name: str, model_dir: str, roles: list[dict]) -> InferenceGroup:
    return InferenceGroup.model_validate({"name": name, "version": "v1", "model": {"path": model_dir}, "roles": roles})


ENGINE = {"kv_cache_bytes": 8_000_000, "max_wait_ms": 2}
# The pool's member keeps KV in host memory below a cache of 24 tiny-model blocks, so that prompts sent to it twice
# are evicted and loaded back: the KVCache row and the KV tier alerts read what it reports.
TIERED = {"kv_cache_bytes": 24 * 8192, "max_wait_ms": 2, "kv_tiers": {"host_bytes": 1 << 20}}


@pytest.fixture(scope="module")
def observed_fleet(controller, controller_model_dir, tideflow_home, tmp_path_factory):
    """The fleet under load, scraped by a real Prometheus; yields Prometheus' URL."""
    model = str(controller_model_dir)
    pd = _group("obs-pd", model, [{"role": "prefill", "parallel": "DEP2", "engine": ENGINE},
                                  {"role": "decode", "engine": ENGINE}])
    controller.apply(pd)
    template = _group("obs-pool", model, [{"role": "colocated", "engine": TIERED}])
    bounds = Bounds(min_groups=0, max_groups=1)
    controller.scale_pool(ScalePool(template=template, target=0, warm_pool=1, bounds=bounds))  # one standby
    assert controller.wait_for("obs-pd", {GroupState.READY}, 240).state == GroupState.READY
    assert controller.wait_for("obs-pool-0", {GroupState.STANDBY, GroupState.READY}, 240).state == GroupState.STANDBY

    status = controller.status()
    pool_member = next(m.endpoint for g in status.groups if g.name == "obs-pool-0" for m in g.members)
    members = sorted({urlparse(m.endpoint).netloc for g in status.groups for m in g.members if m.endpoint})
    _wait_until(lambda: len(controller.status().replica_urls()) == 2, 60, lambda: controller.status().router_replicas)
    replicas = controller.status().replica_urls()  # the default: 2 replicas, each reporting a port of its own
    assert status.router_url not in replicas
    store = Store(tideflow_home / "controller.db")
    try:
        member_key = store.secret("member")
    finally:
        store.close()
    client_key = router_key_path().read_text().strip()
    # router replicas and members as the controller names them (HTTP service discovery), as an operator's
    # Prometheus would: through the shared router port a scrape reads one replica and misses the other's requests
    jobs = [ScrapeJob(name="router", sd_url=controller.url + "/v1/targets?job=router", key=client_key),
            ScrapeJob(name="engines", sd_url=controller.url + "/v1/targets?job=engines", key=member_key,
                      sd_key=client_key),
            ScrapeJob(name="controller", targets=[urlparse(controller.url).netloc], key=client_key)]
    with LocalPrometheus(jobs, tmp_path_factory.mktemp("prometheus"), PrometheusSetup(scrape_interval_s=1)) as prom:
        every = len(replicas) + len(members) + 1
        _wait_until(lambda: [t[2] for t in _targets(prom.url)] == ["up"] * every, 60, lambda: _targets(prom.url))
        controller.scale_pool(ScalePool(template=template, target=1, warm_pool=0, bounds=bounds))  # activates it
        controller.record_canary(CanaryRecord(stable="obs-pd", canary="obs-pool-0", step=0, percent=5))
        _load(status.router_url, client_key)
        _evict_and_reload(pool_member, member_key)
        # the last requests and the activation are in Prometheus, with a scrape before and after them
        _wait_until(lambda: _value(prom.url, 'sum(tideflow_router_requests_total{status="ok"})') >= REQUESTS
                    and _value(prom.url, "sum(tideflow_controller_activation_seconds_count)") >= 1
                    and _value(prom.url, "sum(tideflow_kv_tier_onboard_blocks_total)") > 0, 60,
                    lambda: _targets(prom.url))
        time.sleep(2)  # two more scrape periods, so rate() over the window sees the end of the load
        yield prom.url


def _wait_until(ready, timeout_s: float, explain) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {explain()}"
        time.sleep(0.5)


def _value(url: str, expr: str) -> float:
    result = _query(url, expr, time.time())
    return float(result[0]["value"][1]) if result else 0.0


REQUESTS = 24


def _load(router_url: str, key: str) -> None:
    """REQUESTS streamed requests, 4 at a time, with prompts long enough to fill KV blocks (and share a prefix)."""
    client = openai.OpenAI(base_url=router_url + "/v1", api_key=key, max_retries=0,
                           http_client=httpx.Client(trust_env=False, timeout=120))
    prefix = "the release pipeline compiles the kernels, publishes the weights and " * 3

    def one(i: int) -> str:
        chunks = client.completions.create(model="default", prompt=f"{prefix} request {i}", max_tokens=12,
                                           temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(REQUESTS)))
    assert all(answers)


def _evict_and_reload(member_url: str, key: str) -> None:
    """Six prompts of 15 blocks (10 shared) twice each, in turn, straight to the tiered member: the second pass finds
    the blocks the first evicted in host memory."""
    client = openai.OpenAI(base_url=member_url + "/v1", api_key=key, max_retries=0,
                           http_client=httpx.Client(trust_env=False, timeout=120))
    rng = random.Random(5)
    system = [rng.randrange(3, 500) for _ in range(160)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(80)] for _ in range(6)]
    for prompt in prompts * 2:
        assert client.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0).choices


def _query(url: str, expr: str, at: float) -> list[dict]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr.replace("$__rate_interval", "1m"), "time": at},
                  trust_env=False, timeout=30)
    assert r.status_code == 200, f"{expr}: {r.text}"
    return r.json()["data"]["result"]


def _targets(url: str) -> list[tuple]:
    """Each scrape target's job, health and last error: what to read when a query comes back empty."""
    active = httpx.get(url + "/api/v1/targets", trust_env=False, timeout=30).json()["data"]["activeTargets"]
    return [(t["labels"]["job"], t["scrapeUrl"], t["health"], t["lastError"]) for t in active]


def test_every_dashboard_panel_query_returns_data(observed_fleet):
    url, module, at = observed_fleet, dashboards_module(), time.time()
    empty = []
    for name, board in module.BOARDS.items():
        for title, expr in module.queries(module.build(board)):
            values = [float(s["value"][1]) for s in _query(url, expr, at)]
            if not any(math.isfinite(v) for v in values):
                empty.append(f"{name} / {title}: {expr} -> {values or 'no series'}")
    assert not empty, "panels without data:\n" + "\n".join(empty) + f"\ntargets: {_targets(url)}"


def test_every_series_an_alert_reads_is_exported(observed_fleet):
    url, at = observed_fleet, time.time()
    names = sorted(set(re.findall(r"\b(tideflow_[a-z_]+?)(?:_bucket)?\b", (PROMETHEUS_DIR / "alerts.yaml").read_text())))
    missing = [n for n in names if not _query(url, f'count({{__name__=~"{n}(_bucket)?"}})', at)]
    assert not missing, f"alerts read series nobody exports: {missing}; targets: {_targets(url)}"
    up = [(s["metric"]["job"], float(s["value"][1])) for s in _query(url, "up", at)]
    assert {job for job, _ in up} == {"router", "engines", "controller"} and all(v == 1.0 for _, v in up), up
