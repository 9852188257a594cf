"""The reference pages generated from the code: docs/reference/cli.md (every command's --help) and
docs/reference/config.md (every spec and config model's fields, defaults and descriptions).

    python scripts/reference.py          # write both (`make docs`)
    python scripts/reference.py --check  # exit 1 naming the pages that differ from the code

Why generated: the README's hand-kept CLI dump and tables drifted from the code (fields missing, descriptions
that no longer matched the field's). tests/test_reference.py runs the check, so a change to a flag or a field
that leaves its page behind fails the tests.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "reference"
WIDTH = "100"  # argparse wraps help to $COLUMNS: fixed, so the page does not depend on the terminal

# (heading, "module:Model", a note under the heading, the fields a more general table already lists)
SECTIONS: list[tuple[str, str, str, str | None]] = [
    ("Group spec (deployments/groups/*.yaml)", "engine.group.spec:InferenceGroup", "", None),
    ("model", "engine.group.spec:ModelRef", "", None),
    ("roles[]", "engine.group.spec:RoleSpec", "", None),
    ("roles[].engine", "engine.group.spec:EngineArgs",
     "The engine's own knobs, the same fields and defaults as the `tideflow serve` table below "
     "(`engine.core.engine_config.EngineKnobs`), plus:", "engine.core.engine_config:EngineKnobs"),
    ("roles[].resources", "engine.group.spec:Resources", "", None),
    ("router", "engine.group.spec:RouterSpec", "", None),
    ("Engine (`tideflow serve` flags)", "engine.core.engine_config:EngineConfig", "", None),
    ("KV tiers (`roles[].engine.kv_tiers`, `serve --kv-tiers`)", "engine.kvtier.config:KVTierConfig",
     "Checked at the boundary: a `disk_path` that is not a writable directory and a store that does not take, "
     "give back and delete a probe block refuse the member's start with the field named.", None),
    ("Router (`tideflow router` flags)", "engine.router.config:RouterConfig", "", None),
    ("KV-aware routing (the router's `kv_routing`)", "engine.router.kv_index:KVRoutingConfig",
     "`--kv-routing` sets the mode; the costs are the model's defaults.", None),
    ("Bounded reads (`tideflow serve`, `router` and `controller` flags)",
     "engine.api.connection_limits:ConnectionLimits", "", None),
    ("Group supervision", "engine.group.manager:SupervisionPolicy", "", None),
    ("Controller (`tideflow controller` flags of the same names)", "engine.control.runtime:ControllerConfig", "",
     None),
    ("Local capacity check (the controller's `capacity_check`)", "engine.group.capacity:CapacityCheck", "", None),
    ("S3 store", "engine.weights.config:S3StoreConfig", "", None),
    ("Kernel build", "tideflow_kernels.spec:BuildRequest", "", None),
    ("Canary plan", "engine.canary.plan:CanaryPlan", "", None),
    ("Canary step", "engine.canary.plan:CanaryStep", "", None),
    ("Canary judge", "engine.canary.judge:JudgeConfig", "", None),
    ("Scaling policy", "engine.scaling.policy:ScalingPolicy", "", None),
    ("Scaling bounds", "engine.scaling.policy:Bounds", "", None),
    ("Metric policy", "engine.scaling.policy:MetricPolicy", "", None),
    ("Schedule", "engine.scaling.policy:Schedule", "", None),
    ("Schedule entry", "engine.scaling.policy:ScheduleEntry", "", None),
    ("Capacity profile sweep (`tideflow profile`)", "engine.capacity.profile:ProfileSpec", "", None),
    ("Capacity plan (`tideflow plan`)", "engine.capacity.plan:PlanSpec", "", None),
    ("Service level (the plan's targets)", "engine.capacity.plan:SLO", "", None),
    ("Load drill", "drills.spec:LoadDrillSpec", "", None),
    ("Fault drill", "drills.fault:FaultDrillSpec", "", None),
    ("Fault drill flow (fault-drill-nightly)", "flows.drill_flows:FaultDrillParams", "", None),
    ("Tidal scale flow (tidal-scale-up, tidal-scale-down)", "flows.tidal_scale:TidalParams", "", None),
    ("Canary flow (canary-release)", "flows.canary_release:CanaryParams", "", None),
    ("Deploy flow (deploy-group; the canary's group)", "flows.params:DeployParams", "", None),
    ("Weights flow (publish-weights)", "flows.params:WeightsParams", "", None),
    ("Fleet lease (`PUT /v1/lease`)", "engine.control.models:LeaseRequest", "", None),
]


def _load(dotted: str) -> type[BaseModel]:
    module, name = dotted.split(":")
    return getattr(importlib.import_module(module), name)


def _default(field) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(default factory)"
        if isinstance(value, (list, dict)) and not value:
            return "`[]`" if isinstance(value, list) else "`{}`"
        return "(default factory)"
    value = field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, Path):
        return f"`{value.relative_to(REPO) if value.is_absolute() and value.is_relative_to(REPO) else value}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return "None" if value is None else str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_page() -> str:
    lines = ["# Configuration reference", "",
             "Every spec and config is a pydantic model; these are their fields, generated from the models by",
             "`make docs` (`scripts/reference.py`). Edit the field's description in the code, not this page.", ""]
    for heading, dotted, note, general in SECTIONS:
        model = _load(dotted)
        skip = set(_load(general).model_fields) if general else set()
        module, name = dotted.split(":")
        lines += [f"## {heading}", "", f"`{module}.{name}`" + (f": {note}" if note else ""), "",
                  "| field | default | meaning |", "|---|---|---|"]
        for field_name, field in model.model_fields.items():
            if field_name in skip:
                continue
            meaning = field.description or ""
            annotation = field.annotation
            if not meaning and isinstance(annotation, type) and issubclass(annotation, BaseModel):
                meaning = (annotation.__doc__ or "").strip().splitlines()[0] if annotation.__doc__ else ""
            lines.append(f"| `{field_name}` | {_default(field)} | {_cell(meaning)} |")
        lines.append("")
    return "\n".join(lines)


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                path = f"{prefix} {name}"
                nested = _commands(sub, path)
                out += nested or [(path, sub)]
    return out


def cli_page() -> str:
    os.environ["COLUMNS"] = WIDTH
    from flows.cli import build_parser  # the engine's commands and, above them, the pipeline's (release, ui)

    lines = ["# CLI reference", "",
             "Every `tideflow` command's `--help`, generated by `make docs` (`scripts/reference.py`). Edit the",
             "flag's help in the code, not this page.", ""]
    for path, parser in _commands(build_parser(), "tideflow"):
        parser.prog = path
        lines += [f"## {path}", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


PAGES = {"cli.md": cli_page, "config.md": config_page}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 naming each page that differs from the code")
    args = ap.parse_args()
    stale = []
    for name, render in PAGES.items():
        text, path = render(), OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(REPO) if path.is_relative_to(REPO) else path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date with the code: {', '.join(stale)}; run `make docs`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
