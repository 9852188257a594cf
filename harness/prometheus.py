"""A Prometheus process on loopback scraping a group set (router + engine members), from the template.

For runs without a cluster Prometheus: the canary's PrometheusSource reads from it. Keys go into
0600 files next to the rendered config, never into the config or the logs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

import jinja2
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from engine.runtime.errors import TideflowError
from engine.runtime.process import Child, free_port, wait_http_ok
from engine.runtime.tls import TlsIdentity

TEMPLATE = Path(__file__).resolve().parents[1] / "deployments" / "prometheus" / "prometheus.yml.j2"


class PrometheusError(TideflowError):
    """Prometheus is not installed or did not come up."""


class ScrapeJob(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str = Field(pattern=r"^[a-zA-Z_][a-zA-Z0-9_-]*$", description="job label of the scraped series")
    targets: list[str] = Field(default_factory=list, description="host:port of each /metrics endpoint")
    sd_url: str | None = Field(None, pattern=r"^https?://\S+$",
                               description="or where Prometheus asks for them (HTTP service discovery: the "
                                           "controller's /v1/targets?job=..., with the same key)")
    key: SecretStr = Field(description="bearer key the targets' /metrics require")
    sd_key: SecretStr | None = Field(None, description="bearer key of the discovery URL (None: `key`); the "
                                                       "controller takes its client key, not the members'")
    tls: TlsIdentity | None = Field(None, description="a fleet with TLS on: scrape and discover over https, "
                                                      "trusting this CA and showing this certificate (members ask "
                                                      "for one: mutual TLS)")

    @model_validator(mode="after")
    def _targets_or_discovery(self) -> "ScrapeJob":
        if bool(self.targets) == bool(self.sd_url):
            raise ValueError("a scrape job needs static targets or an sd_url (one of them)")
        return self


class PrometheusSetup(BaseModel):
    scrape_interval_s: float = Field(1.0, gt=0, le=300, description="scrape (and evaluation) period")
    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(0, ge=0, le=65535, description="listen port (0 = any free port)")
    ready_timeout_s: float = Field(30.0, gt=0, description="how long to wait for /-/ready")


def render_config(jobs: list[ScrapeJob], scrape_interval_s: float, key_dir: Path) -> str:
    """prometheus.yml text from the template; writes each job's key to key_dir/<job>.key (and a discovery key
    to <job>.sd.key), mode 0600."""
    key_dir.mkdir(parents=True, exist_ok=True)
    rendered = []
    for job in jobs:
        path, sd_path = key_dir / f"{job.name}.key", key_dir / f"{job.name}.sd.key"
        _write_secret(path, job.key)
        if job.sd_url:
            _write_secret(sd_path, job.sd_key or job.key)
        rendered.append({"name": job.name, "targets": job.targets, "sd_url": job.sd_url, "credentials_file": str(path),
                         "sd_credentials_file": str(sd_path), "tls": _tls_config(job.tls)})
    template = jinja2.Template(TEMPLATE.read_text(), undefined=jinja2.StrictUndefined)
    return template.render(jobs=rendered, scrape_interval_s=f"{scrape_interval_s:g}", scrape_timeout_s=f"{scrape_interval_s:g}")


def _tls_config(identity: TlsIdentity | None) -> dict[str, str] | None:
    """Prometheus's tls_config for `identity` (its key may share the certificate's file: Prometheus reads the
    blocks it needs from each)."""
    if identity is None:
        return None
    return {"ca_file": str(identity.ca), "cert_file": str(identity.cert), "key_file": str(identity.key)}


def _write_secret(path: Path, secret: SecretStr) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.get_secret_value())


def groupset_jobs(groupset) -> list[ScrapeJob]:
    """A `router` job and an `engines` job over the members registered in a LocalGroupSet's router now."""
    engines = sorted({urlparse(e["url"]).netloc for g in groupset.admin.groups() for e in g["endpoints"]})
    identity = TlsIdentity.from_env() if groupset.config.tls else None  # the set's own certificate
    jobs = [ScrapeJob(name="router", targets=[urlparse(groupset.url).netloc], key=groupset.client_key, tls=identity)]
    if engines:
        jobs.append(ScrapeJob(name="engines", targets=engines, key=groupset.backend.api_key, tls=identity))
    return jobs


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if found is None:
        raise PrometheusError("prometheus is not installed: run `make prometheus` (apt-get install -y prometheus)")
    return found


class LocalPrometheus:
    """Owns its process: `close()` (or the context manager) stops and reaps it."""

    def __init__(self, jobs: list[ScrapeJob], workdir: Path, setup: PrometheusSetup | None = None) -> None:
        setup = setup or PrometheusSetup()
        port = setup.port or free_port(setup.host)
        self.url = f"http://{setup.host}:{port}"
        config = workdir / "prometheus.yml"
        config.write_text(render_config(jobs, setup.scrape_interval_s, workdir / "keys"))
        argv = [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={setup.host}:{port}", "--log.level=warn"]
        self.child = Child(f"prometheus-{port}", argv, workdir / "prometheus.log")
        try:
            if not wait_http_ok(self.url + "/-/ready", setup.ready_timeout_s, child=self.child):
                raise PrometheusError(f"prometheus did not become ready: {self.child.log_tail()}")
        except BaseException:
            self.child.stop()
            raise

    def close(self) -> None:
        self.child.stop()

    def __enter__(self) -> "LocalPrometheus":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
