"""Writes a load drill's tables (per-request CSV, per-step CSV, JSON summary) and PNG plots."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers or CI
import matplotlib.pyplot as plt  # noqa: E402

from drills.results import LoadDrillReport  # noqa: E402


def _latency_over_time(report: LoadDrillReport, path: Path) -> None:
    frame = report.request_frame()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ok = frame[frame["ok"]]
    ax.scatter(ok["sent_s"], ok["e2e_ms"], s=6, label="end-to-end", alpha=0.6)
    ax.scatter(ok["sent_s"], ok["ttft_ms"], s=6, label="TTFT", alpha=0.6)
    failed = frame[~frame["ok"]]
    if len(failed):
        ax.scatter(failed["sent_s"], [0] * len(failed), marker="x", color="red", label="error")
    for k in range(1, len(report.steps)):
        ax.axvline(k * report.spec.step_hold_s, color="grey", lw=0.5, ls="--")
    ax.set(xlabel="send time (s from start)", ylabel="latency (ms)", title="latency over time")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _latency_per_step(report: LoadDrillReport, path: Path) -> None:
    frame = report.step_frame()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, slo in ((a, "ttft", report.spec.slo_ttft_ms), (b, "tpot", report.spec.slo_tpot_ms)):
        for q in ("p50", "p90", "p99"):
            ax.plot(frame["offered_rate"], frame[f"{metric}_{q}"], marker="o", label=q)
        if slo is not None:
            ax.axhline(slo, color="red", ls="--", label="SLO")
        ax.set(xlabel="offered rate (req/s)", ylabel=f"{metric.upper()} (ms)", title=f"{metric.upper()} per step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _throughput(report: LoadDrillReport, path: Path) -> None:
    frame = report.step_frame()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(frame["offered_rate"], frame["req_s"], marker="o", label="completed")
    a.plot(frame["offered_rate"], frame["goodput_req_s"], marker="o", label="goodput (within SLO)")
    a.plot(frame["offered_rate"], frame["offered_rate"], ls=":", color="grey", label="offered")
    if report.capacity_rps is not None:
        a.axvline(report.capacity_rps, color="green", ls="--", label=f"capacity {report.capacity_rps:g} req/s")
    a.set(xlabel="offered rate (req/s)", ylabel="req/s", title="requests vs offered rate")
    a.legend()
    b.plot(frame["offered_rate"], frame["output_tok_s"], marker="o")
    b.set(xlabel="offered rate (req/s)", ylabel="output tokens/s", title="output throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: LoadDrillReport, out_dir: Path) -> dict[str, str]:
    """Write every file into `out_dir`; return kind -> path (also stored in the JSON summary)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"requests_csv": out / "requests.csv", "steps_csv": out / "steps.csv", "summary_json": out / "summary.json",
             "latency_over_time_png": out / "latency_over_time.png", "latency_per_step_png": out / "latency_per_step.png",
             "throughput_png": out / "throughput.png"}
    names = {k: str(p) for k, p in files.items()}
    report.request_frame().to_csv(files["requests_csv"], index=False)
    report.step_frame().to_csv(files["steps_csv"], index=False)
    _latency_over_time(report, files["latency_over_time_png"])
    _latency_per_step(report, files["latency_per_step_png"])
    _throughput(report, files["throughput_png"])
    files["summary_json"].write_text(report.model_copy(update={"files": names}).model_dump_json(indent=2))
    return names

