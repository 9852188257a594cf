"""tideflow's Grafana dashboards, built with Grafana's own SDK (grafana-foundation-sdk) and written as JSON.

Three boards: `fleet` (traffic, latency per group and version, errors, engine load, KV and prefix cache, the
shuttle, router retries and migrations, the KV tiers below the cache), `pd-ep` (prefill vs decode, KV transfer,
expert load per rank, EPLB) and `lifecycle` (group states over time, the warm pool, activations, rebuilds, the
canary, the autoscaler). Every query reads series that tideflow exports (members, router, controller; jobs named
as in deployments/prometheus/prometheus.yml.j2); tests/deployments/test_observability.py runs each one against a
real Prometheus scraping a fleet under load and fails on any query that returns nothing.

Run `python deployments/grafana/dashboards.py` after changing a panel: it rewrites the JSON files next to it
(a test fails while a committed file differs from what this builds).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.statetimeline import Panel as StateTimeline
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

HERE = Path(__file__).resolve().parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | state


def quantile(q: float, metric: str, by: str = "group, version") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{RATE})))"


def latency(title: str, metric: str, by: str = "group, version") -> PanelSpec:
    """The legend names the labels the quantiles are taken by (a label summed away would show empty)."""
    names = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return PanelSpec(title, f"p50 and p99 of {metric}, per {by}", (
        Query(quantile(0.5, metric, by), f"p50 {names}"),
        Query(quantile(0.99, metric, by), f"p99 {names}"),
    ), unit="s")


FLEET = (
    "tideflow fleet", "tideflow-fleet", (
        ("Traffic", (
            PanelSpec("Request rate", "client requests per second through the router, per group and version",
                      (Query(f"sum by (group, version) (rate(tideflow_router_requests_total{RATE}))",
                             "{{group}} {{version}}"),), unit="reqps"),
            PanelSpec("Errors by status", "requests that did not end ok, per group and outcome",
                      (Query(f'sum by (group, status) (rate(tideflow_router_requests_total{{status!="ok"}}{RATE}))',
                             "{{group}} {{status}}"),), unit="reqps"),
            PanelSpec("Output tokens", "tokens relayed to clients per second",
                      (Query(f"sum by (group, version) (rate(tideflow_router_output_tokens_total{RATE}))",
                             "{{group}} {{version}}"),), unit="short"),
        )),
        ("Latency (client-seen, at the router)", (
            latency("Time to first token", "tideflow_router_time_to_first_token_seconds"),
            latency("Time per output token", "tideflow_router_time_per_output_token_seconds"),
            latency("End-to-end latency", "tideflow_router_e2e_request_latency_seconds"),
        )),
        ("Engines", (
            PanelSpec("Queue depth", "requests waiting in each member (shuttle window + queue)",
                      (Query("sum by (group, role) (tideflow_queue_depth)", "{{group}} {{role}}"),)),
            PanelSpec("Running sequences", "sequences in the running batch of each role",
                      (Query("sum by (group, role) (tideflow_running_sequences)", "{{group}} {{role}}"),)),
            PanelSpec("KV blocks used", "share of each member's KV cache referenced by sequences",
                      (Query("sum by (group, role) (tideflow_kv_blocks_used) / sum by (group, role) "
                             "(tideflow_kv_blocks_used + tideflow_kv_blocks_free)", "{{group}} {{role}}"),),
                      unit="percentunit"),
            PanelSpec("Prefix-cache hit rate", "looked-up prompt blocks found in the prefix cache",
                      (Query(f"sum by (group) (rate(tideflow_prefix_cache_hit_blocks_total{RATE})) / sum by (group) "
                             f"(rate(tideflow_prefix_cache_queried_blocks_total{RATE}))", "{{group}}"),),
                      unit="percentunit"),
            PanelSpec("Shuttle departure size", "arrivals that left together per shuttle departure (mean)",
                      (Query(f"sum by (group) (rate(tideflow_departure_size_sum{RATE})) / sum by (group) "
                             f"(rate(tideflow_departure_size_count{RATE}))", "{{group}}"),)),
            PanelSpec("Router retries and migrations", "stage retries before a token, and streams resumed elsewhere",
                      (Query(f"sum by (group) (rate(tideflow_router_retries_total{RATE}))", "retries {{group}}"),
                       Query(f"sum by (group, reason) (rate(tideflow_router_migrations_total{RATE}))",
                             "migrations {{group}} {{reason}}")), unit="reqps"),
        )),
        ("KVCache", (
            PanelSpec("KV tier hit rate", "looked-up prompt tokens each tier held, of those the tiers above it did not",
                      (Query(f"sum by (tier) (rate(tideflow_kv_tier_hit_tokens_total{RATE})) / sum by (tier) "
                             f"(rate(tideflow_kv_tier_queried_tokens_total{RATE}))", "{{tier}}"),),
                      unit="percentunit"),
            PanelSpec("KV tier bytes", "bytes host memory and the disk hold against what they may hold (the store "
                                       "reports neither)",
                      (Query("sum by (tier) (tideflow_kv_tier_bytes)", "used {{tier}}"),
                       Query("sum by (tier) (tideflow_kv_tier_capacity_bytes)", "capacity {{tier}}")), unit="bytes"),
            PanelSpec("KV tier offload and onboard", "blocks per second written to each tier and loaded from it",
                      (Query(f"sum by (tier) (rate(tideflow_kv_tier_offload_blocks_total{RATE}))", "offload {{tier}}"),
                       Query(f"sum by (tier) (rate(tideflow_kv_tier_onboard_blocks_total{RATE}))",
                             "onboard {{tier}}"))),
            latency("KV tier onboard latency", "tideflow_kv_tier_onboard_seconds", "tier"),
            PanelSpec("KV tier evictions and expirations", "blocks per second each tier dropped for room and for age",
                      (Query(f"sum by (tier) (rate(tideflow_kv_tier_evictions_total{RATE}))", "evicted {{tier}}"),
                       Query(f"sum by (tier) (rate(tideflow_kv_tier_expirations_total{RATE}))", "expired {{tier}}"))),
            PanelSpec("KV tier fallbacks and write errors", "blocks recomputed instead of loaded, by reason (corrupt, "
                                                            "unavailable, missing), and block writes a tier refused",
                      (Query(f"sum by (tier, reason) (rate(tideflow_kv_tier_fallbacks_total{RATE}))",
                             "fallback {{tier}} {{reason}}"),
                       Query(f"sum by (tier) (rate(tideflow_kv_tier_write_errors_total{RATE}))",
                             "write errors {{tier}}"))),
        )),
    ))

PD_EP = (
    "tideflow PD + EP", "tideflow-pd-ep", (
        ("Prefill vs decode", (
            PanelSpec("Prefill vs decode load", "prompt tokens computed by prefill, tokens generated by decode",
                      (Query(f'sum by (group) (rate(tideflow_prefill_computed_tokens_total{{role="prefill"}}{RATE}))',
                             "prefill {{group}}"),
                       Query(f'sum by (group) (rate(tideflow_generation_tokens_total{{role="decode"}}{RATE}))',
                             "decode {{group}}")), unit="short"),
            PanelSpec("Running per role", "sequences running on prefill and decode members",
                      (Query('sum by (group, role) (tideflow_running_sequences{role=~"prefill|decode"})',
                             "{{group}} {{role}}"),)),
            latency("Time to first token per role", "tideflow_time_to_first_token_seconds", "group, role"),
        )),
        ("KV transfer (prefill -> decode)", (
            PanelSpec("KV transfer bytes", "KV cache bytes decode members pulled from prefill",
                      (Query(f"sum by (group) (rate(tideflow_kv_transfer_bytes_total{RATE}))", "{{group}}"),),
                      unit="Bps"),
            latency("KV transfer latency", "tideflow_kv_transfer_seconds", "group"),
            PanelSpec("KV transfer failures", "pulls that failed (the router retries the request elsewhere)",
                      (Query(f"sum by (group) (rate(tideflow_kv_transfer_failures_total{RATE}))", "{{group}}"),),
                      unit="reqps"),
            PanelSpec("KV blocks decode already held",
                      "prompt blocks left out of transfers because the decode member held them, and imports whose "
                      "held blocks were evicted before they arrived (recomputed on decode)",
                      (Query(f"sum by (group) (rate(tideflow_kv_transfer_skipped_blocks_total{RATE}))",
                             "skipped {{group}}"),
                       Query(f"sum by (group) (rate(tideflow_kv_transfer_recomputes_total{RATE}))",
                             "recomputed {{group}}"))),
        )),
        ("Experts", (
            PanelSpec("Expert load per rank", "tokens routed to each DEP rank's experts over its sliding window",
                      (Query("sum by (instance) (tideflow_expert_window_tokens)", "{{instance}}"),)),
            PanelSpec("EPLB imbalance", "max/mean tokens per expert over the window, per MoE layer (1.0 is even)",
                      (Query("max by (layer) (tideflow_expert_window_imbalance)", "layer {{layer}}"),)),
            PanelSpec("Expert rebalances", "live expert rebalances applied, and those refused or failed (the old "
                                           "placement kept: a rank lacked the memory to stage the new weights, or "
                                           "staging failed)",
                      (Query(f"sum by (group) (increase(tideflow_expert_rebalances_total{RATE}))", "applied {{group}}"),
                       Query(f"sum by (group) (increase(tideflow_expert_rebalance_failures_total{RATE}))",
                             "not applied {{group}}"))),
        )),
    ))

LIFECYCLE = (
    "tideflow lifecycle", "tideflow-lifecycle", (
        ("Groups", (
            PanelSpec("Group states", "Starting / Ready / Standby / Draining / Failed of every group over time",
                      (Query('max by (group, state) (tideflow_controller_group_state == 1)', "{{group}} {{state}}"),),
                      kind="state"),
            PanelSpec("Warm pool size", "standby groups: loaded, compiled, warm and not routed",
                      (Query('sum(tideflow_controller_group_state{state="Standby"})', "standby groups"),), kind="stat"),
            PanelSpec("Rebuilds", "whole-group rebuilds (fault drills' apart: they spend no restart budget), and the "
                                  "member failures behind them by reason",
                      (Query(f"sum by (group) (increase(tideflow_controller_group_rebuilds_total{RATE}))",
                             "rebuilds {{group}}"),
                       Query(f"sum by (group) (increase(tideflow_controller_group_drill_rebuilds_total{RATE}))",
                             "drill rebuilds {{group}}"),
                       Query(f"sum by (group, reason) (increase(tideflow_controller_member_failures_total{RATE}))",
                             "{{group}} {{reason}}"))),
        )),
        ("Scaling", (
            latency("Activation time", "tideflow_controller_activation_seconds", "trigger"),
            PanelSpec("Autoscaler and pool decisions", "groups activated, parked, cold-started, refilled, stopped",
                      (Query(f"sum by (pool, action) (increase(tideflow_controller_pool_scale_total{RATE}))",
                             "{{pool}} {{action}}"),)),
            PanelSpec("Falls", "serving groups that fell out of routing (a standby takes over where there is one)",
                      (Query(f"sum by (group) (increase(tideflow_controller_group_falls_total{RATE}))", "{{group}}"),)),
        )),
        ("Canary", (
            PanelSpec("Canary step and share", "the step being held and the canary's share of traffic",
                      (Query("max by (canary) (tideflow_controller_canary_step)", "step {{canary}}"),
                       Query("max by (canary) (tideflow_controller_canary_percent)", "% {{canary}}"))),
            PanelSpec("Traffic weights", "each group's weight at the router",
                      (Query("max by (group) (tideflow_router_group_weight)", "{{group}}"),)),
            PanelSpec("Canary decisions", "rollouts promoted and rolled back",
                      (Query("sum by (decision) (tideflow_controller_canary_decisions_total)", "{{decision}}"),),
                      kind="stat"),
        )),
    ))

BOARDS = {"fleet": FLEET, "pd-ep": PD_EP, "lifecycle": LIFECYCLE}


def panel(spec: PanelSpec):
    builder = {"timeseries": Timeseries, "stat": Stat, "state": StateTimeline}[spec.kind]()
    builder = builder.title(spec.title).description(spec.description).datasource(DATASOURCE).unit(spec.unit).span(8)
    for i, q in enumerate(spec.queries):
        builder = builder.with_target(Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i)))
    return builder


def build(board: tuple) -> dict:
    title, uid, rows = board
    dash = (Dashboard(title).uid(uid).tags(["tideflow", "generated"]).refresh("30s").time("now-1h", "now")
            .timezone("browser")
            .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus")))
    for row_title, panels in rows:
        dash = dash.with_row(Row(row_title))
        for spec in panels:
            dash = dash.with_panel(panel(spec))
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(dash.build()))


def queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of a built board."""
    return [(p["title"], t["expr"]) for p in board["panels"] if p.get("type") != "row" for t in p.get("targets", [])]


def write(out_dir: Path = HERE) -> list[Path]:
    written = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, board in BOARDS.items():
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(build(board), indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(f"wrote {p}")
