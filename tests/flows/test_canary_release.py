"""canary_release as users run it: a controller in its own process, a stable group serving real traffic,
and canaries whose specs inject faults. The flow is the one loop over the steps: an erroring canary is
rolled back (and kept at 0 % for inspection), a slow one rolled back and removed, and no client request
fails meanwhile (the router retries a canary's 500s on the stable group)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import openai
import pytest
import yaml

from engine.canary import CanaryPlan
from engine.canary.judge import JudgeConfig
from engine.control import discovery
from engine.runtime.paths import home
from engine.telemetry import tracing
from engine.telemetry.trace_cli import read_spans
from flows.canary_release import ROLLED_BACK, CanaryParams, CanaryRolledBack, canary_release
from flows.deploy_group import deploy_group
from flows.params import DeployParams

# Two canaries rolled back through the flow: about 2 minutes on 2 cores; `make test-slow` (CI) runs it.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def controller_model_dir(tiny_model_dir):
    return tiny_model_dir


def spec_file(directory, name: str, model_dir, faults: dict | None = None):
    engine = {"max_num_seqs": 16, "kv_cache_bytes": 8_000_000, **({"faults": faults} if faults else {})}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "version": "v1", "model": {"path": str(model_dir)},
                                    "roles": [{"role": "colocated", "engine": engine}]}))
    return path


@pytest.fixture(scope="module")
def specs(tmp_path_factory, tiny_model_dir):
    d = tmp_path_factory.mktemp("specs")
    return {"stable": spec_file(d, "stable", tiny_model_dir),
            "erroring": spec_file(d, "erroring", tiny_model_dir, {"error_rate": 0.5, "seed": 3}),
            "slow": spec_file(d, "slow", tiny_model_dir, {"token_delay_s": 0.3})}


@pytest.fixture(scope="module")
def stable(flow_home, controller, specs):
    deploy_group(DeployParams(spec_file=specs["stable"], weight=100.0))
    return "stable"


@contextmanager
def traffic(controller, workers: int = 3):
    """Closed-loop completions through the router until the block ends; yields the outcomes."""
    router = openai.OpenAI(base_url=controller.status().router_url + "/v1", api_key=discovery.router_key(),
                           max_retries=0, timeout=60)
    stop, outcomes = threading.Event(), []

    def run(n: int) -> None:
        while not stop.is_set():
            try:
                router.completions.create(model="default", prompt=f"traffic {n}", max_tokens=6, temperature=0)
                outcomes.append("ok")
            except openai.APIError as exc:
                outcomes.append(str(exc))

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(workers)]
    for t in threads:
        t.start()
    try:
        yield outcomes
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def plan(**extra) -> CanaryPlan:
    return CanaryPlan(steps=[{"percent": p, "hold_s": 3, "max_hold_s": 120} for p in (25, 100)],
                      judge=JudgeConfig(horizon=30), drain_s=5, **extra)


def rolled_back(state):
    """The run of a rolled-back canary is Failed, named RolledBack, and still carries its report."""
    assert state.is_failed() and state.name == ROLLED_BACK, (state.type, state.name, state.message)
    outcome = state.result(raise_on_failure=False)
    assert isinstance(outcome, CanaryRolledBack) and outcome.report.reason in state.message
    return outcome.report


def test_an_erroring_canary_is_rolled_back_by_the_flow(controller, stable, specs):
    with traffic(controller) as outcomes:
        state = canary_release(CanaryParams(
            stable=stable, canary=DeployParams(spec_file=specs["erroring"], version="v2-errors"), plan=plan()),
            return_state=True)
        report = rolled_back(state)
    assert report.decision == "rolled_back" and len(report.steps) == 1, report.reason
    (errors,) = [v for v in report.steps[0].verdicts if v.metric == "errors"]
    assert errors.verdict == "fail" and errors.estimate > 0.1, errors
    tracing.flush()  # the step's span, with the judge's verdict and the run that held it
    steps = [s for s in read_spans(home() / "traces") if s["name"] == "canary.step"
             and s["attributes"]["canary.group"] == "erroring"]
    assert [(s["attributes"]["canary.verdict"], s["attributes"]["canary.verdict.errors"]) for s in steps] == [
        ("fail", "fail")], steps
    assert steps[0]["attributes"][tracing.FLOW_RUN] == str(state.state_details.flow_run_id)
    assert controller.group("stable").weight == 100 and controller.group("erroring").weight == 0  # kept to inspect
    assert controller.status().canary.decision == "rolled_back"
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:3]


def test_a_slow_canary_is_rolled_back_and_removed_by_the_flow(controller, stable, specs):
    with traffic(controller) as outcomes:
        report = rolled_back(canary_release(CanaryParams(
            stable=stable, canary=DeployParams(spec_file=specs["slow"], version="v2-slow"),
            plan=plan(on_rollback="remove")), return_state=True))
    assert report.decision == "rolled_back" and len(report.steps) == 1, report.reason
    failed = {v.metric for v in report.steps[0].verdicts if v.verdict == "fail"}
    assert failed & {"ttft", "tpot", "e2e"} and "errors" not in failed, report.steps[0].verdicts
    assert "slow" not in {g["name"] for g in controller.groups()}
    assert controller.group("stable").weight == 100
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:3]
