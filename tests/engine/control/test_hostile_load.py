"""Two hostile requests a second mixed into a load drill through the router of a controller-run group:
the normal requests see no error at all, and each hostile one gets its own answer."""

from __future__ import annotations

import threading

import httpx
import pytest

from engine.control import discovery
from drills.load import run_load_drill
from drills.spec import LoadDrillSpec
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

HOSTILE = [  # (raw body, the statuses it may get)
    ('{"model": "default", "prompt": "x", "max_tokens": 4, "temperature": 1e-300}', {200}),
    ('{"model": "default", "prompt": "x", "max_tokens": 4, "temperature": 1, "top_p": 5e-324}', {200}),
    ('{"model": "default", "prompt": "x", "max_tokens": 4, "seed": 18446744073709551616}', {400}),
    ('{"model": "default", "prompt": "\\ud800", "max_tokens": 4}', {400}),
    ('{"model": "default", "prompt": "x", "temperature": NaN}', {400}),
    ('{"model": "default", "prompt": "' + "x" * (9 << 20) + '"}', {413}),
]


@pytest.fixture(scope="module")
def group(controller, tiny_model_dir):
    spec = InferenceGroup.model_validate({
        "name": "hostile", "version": "v1", "model": {"path": str(tiny_model_dir)},
        "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 16_000_000, "max_wait_ms": 2}}]})
    controller.apply(spec)
    assert controller.wait_for("hostile", {GroupState.READY, GroupState.FAILED}, 120).state == GroupState.READY
    return controller


def test_hostile_requests_cause_no_error_to_anyone_else(group, monkeypatch):
    router, key = group.status().router_url, discovery.router_key()
    monkeypatch.setenv("HOSTILE_DRILL_KEY", key)
    stop = threading.Event()
    answers: list[tuple[int, set[int]]] = []

    def hostile() -> None:
        with httpx.Client(base_url=router, headers={"authorization": f"Bearer {key}",
                                                    "content-type": "application/json"}, trust_env=False,
                          timeout=60) as c:
            i = 0
            while not stop.is_set():
                body, allowed = HOSTILE[i % len(HOSTILE)]
                answers.append((c.post("/v1/completions", content=body).status_code, allowed))
                i += 1
                stop.wait(0.5)  # 2 per second

    pump = threading.Thread(target=hostile)
    pump.start()
    try:
        report = run_load_drill(LoadDrillSpec(url=router, model="default", api_key_env="HOSTILE_DRILL_KEY", rate=4,
                                              duration_s=8, prompt_len="uniform:8:24", output_len="fixed:8",
                                              expectations_suite=None, progress_bar=False))
    finally:
        stop.set()
        pump.join(timeout=60)
    assert report.sent > 0 and report.error == 0 and report.ok == report.sent, report.steps[0].error_reasons
    assert len(answers) >= len(HOSTILE)
    assert all(status in allowed for status, allowed in answers), answers
    (view,) = [g for g in group.groups() if g["name"] == "hostile"]
    assert view["routable"]  # nobody was ejected
