"""Writes a fault drill's report: the whole report as JSON, a row per repeat as CSV, and the timeline plot
(each request's longest pause against when it was sent, the kill marked)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers or CI
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from drills.fault import FaultDrillReport  # noqa: E402


def _fault_timeline(report: FaultDrillReport, path: Path) -> None:
    """Per repeat: each request's longest pause between two chunks against when it was sent, the kill marked."""
    fig, axes = plt.subplots(len(report.runs), 1, figsize=(9, 3.2 * len(report.runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], report.runs):
        frame = run.load.request_frame()
        ok = frame[frame["ok"]]
        ax.scatter(ok["sent_s"], ok["max_gap_ms"].fillna(0), s=8, label="longest pause in the stream")
        ax.scatter(ok["sent_s"], ok["ttft_ms"], s=8, alpha=0.5, label="TTFT")
        failed = frame[~frame["ok"]]
        if len(failed):
            ax.scatter(failed["sent_s"], [0] * len(failed), marker="x", color="red", label="error")
        ax.axvline(run.kill_at_s, color="red", ls="--", lw=1, label=f"kill: {run.killed}")
        ax.set(xlabel="send time (s from start)", ylabel="ms",
               title=f"repeat {run.repeat}: {run.migrated} migrated, lost {run.lost_tokens}, "
                     f"duplicated {run.duplicated_tokens}, errors {run.load.error}")
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_fault_report(report: FaultDrillReport, out_dir: Path) -> dict[str, str]:
    """fault.json (the whole report), fault.csv (one row per repeat) and fault.png; returns kind -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "fault.json", "table": out_dir / "fault.csv", "plot": out_dir / "fault.png"}
    files["json"].write_text(report.model_dump_json(indent=2))
    pd.DataFrame(report.table()).to_csv(files["table"], index=False)
    _fault_timeline(report, files["plot"])
    return {k: str(v) for k, v in files.items()}
