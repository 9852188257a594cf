"""Prometheus HTTP service discovery (`http_sd_configs`) from the controller: what to scrape, as it runs now.

Router replicas that share one port each keep their own counters, so a static target on the shared port
would read whichever replica the kernel picks at each scrape (counters jumping between two series, and part
of the traffic never counted). The controller knows where each replica alone answers (their reports) and
which members run; Prometheus asks it every refresh, so a replica started again or a group rebuilt on new
ports is scraped without editing its config.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, Field

Job = Literal["router", "engines"]


class TargetGroup(BaseModel):
    """One entry of Prometheus's HTTP SD answer."""

    targets: list[str] = Field(description="host:port of each /metrics endpoint")
    labels: dict[str, str] = Field(default_factory=dict)


def scrape_targets(job: Job, replica_urls: list[str], member_urls: list[str]) -> list[TargetGroup]:
    """The `router` job: each router replica where it alone answers; `engines`: every member of a Ready or
    Standby group. An empty list when there is nothing to scrape (Prometheus keeps asking)."""
    urls = replica_urls if job == "router" else member_urls
    hosts = sorted({urlparse(u).netloc for u in urls if urlparse(u).netloc})
    return [TargetGroup(targets=hosts)] if hosts else []
