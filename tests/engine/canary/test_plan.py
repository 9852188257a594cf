"""CanaryPlan validation: bad plans fail at the boundary with a message naming the field."""

import pytest
from pydantic import ValidationError

from engine.canary.plan import DEFAULT_SUITE, CanaryPlan, CanaryStep


def test_default_plan_is_the_issue_s_steps():
    plan = CanaryPlan()
    assert [s.percent for s in plan.steps] == [5, 25, 50, 100]
    assert plan.suite is None and plan.suite_path() == DEFAULT_SUITE and DEFAULT_SUITE.is_file() and plan.on_rollback == "keep" and plan.on_promote == "park"


def test_bare_numbers_become_steps_with_the_default_hold():
    plan = CanaryPlan(steps=[10, {"percent": 100, "hold_s": 5, "max_hold_s": 9}])
    assert plan.steps[0] == CanaryStep(percent=10)
    assert plan.steps[1].hold_s == 5 and plan.steps[1].max_hold_s == 9


@pytest.mark.parametrize("steps, words", [
    ([], "at least one step"),
    ([50, 25, 100], "increase strictly"),
    ([5, 25], "last step must be 100"),
    ([0, 100], "percent"),
    ([5, 150], "percent"),
])
def test_bad_steps_are_refused(steps, words):
    with pytest.raises(ValidationError, match=words):
        CanaryPlan(steps=steps)


def test_max_hold_must_cover_the_hold():
    with pytest.raises(ValidationError, match="max_hold_s"):
        CanaryStep(percent=5, hold_s=10, max_hold_s=5)


def test_missing_suite_is_refused(tmp_path):
    with pytest.raises(ValidationError, match="does not exist"):
        CanaryPlan(suite=tmp_path / "nope.json")
