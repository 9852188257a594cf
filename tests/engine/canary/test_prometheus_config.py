"""The rendered prometheus.yml: valid YAML, static targets, keys only in 0600 files."""

import stat

import pytest
import yaml
from pydantic import ValidationError

from engine.runtime.tls import TlsIdentity
from harness.prometheus import ScrapeJob, render_config


def test_config_names_targets_and_keeps_keys_out(tmp_path):
    jobs = [ScrapeJob(name="router", targets=["127.0.0.1:8000"], key="secret-router"),
            ScrapeJob(name="engines", targets=["127.0.0.1:9001", "127.0.0.1:9002"], key="secret-engine")]
    text = render_config(jobs, 1.0, tmp_path / "keys")
    assert "secret" not in text
    config = yaml.safe_load(text)
    assert config["global"]["scrape_interval"] == "1s"
    engines = config["scrape_configs"][1]
    assert engines["job_name"] == "engines"
    assert engines["static_configs"][0]["targets"] == ["127.0.0.1:9001", "127.0.0.1:9002"]
    key_file = tmp_path / "keys" / "engines.key"
    assert engines["authorization"]["credentials_file"] == str(key_file)
    assert key_file.read_text() == "secret-engine"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_a_job_asks_the_controller_for_its_targets(tmp_path):
    job = ScrapeJob(name="router", sd_url="http://127.0.0.1:7000/v1/targets?job=router", key="secret-router")
    config = yaml.safe_load(render_config([job], 2.0, tmp_path / "keys"))
    sd = config["scrape_configs"][0]["http_sd_configs"][0]
    assert sd["url"] == "http://127.0.0.1:7000/v1/targets?job=router" and sd["refresh_interval"] == "2s"
    assert sd["authorization"]["credentials_file"] == str(tmp_path / "keys" / "router.sd.key")
    assert (tmp_path / "keys" / "router.sd.key").read_text() == "secret-router"  # no sd_key: the job's key
    assert "static_configs" not in config["scrape_configs"][0]


def test_a_job_needs_targets_and_a_plain_name():
    with pytest.raises(ValidationError, match="targets"):
        ScrapeJob(name="router", targets=[], key="k")
    with pytest.raises(ValidationError, match="one of them"):
        ScrapeJob(name="router", targets=["127.0.0.1:1"], sd_url="http://127.0.0.1:2/v1/targets", key="k")
    with pytest.raises(ValidationError, match="name"):
        ScrapeJob(name="bad name", targets=["127.0.0.1:1"], key="k")


def test_a_tls_fleet_is_discovered_and_scraped_over_https_with_a_fleet_certificate(tmp_path):
    identity = TlsIdentity(cert=tmp_path / "p.pem", key=tmp_path / "p.pem", ca=tmp_path / "ca.pem")
    job = ScrapeJob(name="engines", sd_url="https://127.0.0.1:7000/v1/targets?job=engines", key="k", tls=identity)
    (scrape,) = yaml.safe_load(render_config([job], 1.0, tmp_path / "keys"))["scrape_configs"]
    want = {"ca_file": str(tmp_path / "ca.pem"), "cert_file": str(tmp_path / "p.pem"), "key_file": str(tmp_path / "p.pem")}
    assert scrape["scheme"] == "https" and scrape["tls_config"] == want
    assert scrape["http_sd_configs"][0]["tls_config"] == want
    plain = yaml.safe_load(render_config([job.model_copy(update={"tls": None})], 1.0, tmp_path / "keys"))
    assert "scheme" not in plain["scrape_configs"][0] and "tls_config" not in plain["scrape_configs"][0]
