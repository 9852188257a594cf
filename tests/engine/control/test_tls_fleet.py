"""A fleet with TLS on, run as users run it: `tideflow controller --tls on` makes the fleet CA and serves TLS, its
routers and members take their certificates from it, the openai client reaches the router over HTTPS, KV
crosses from prefill to decode over mutual TLS, certificates are renewed under load with no failed request,
a member whose certificate comes from another CA is refused both ways, and the real Prometheus scrapes it all
over TLS."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from engine.control import discovery
from engine.control.store import Store
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.runtime import tls
from engine.runtime.pki import FleetCA, identity_paths
from engine.runtime.process import Child, free_port, tideflow_argv
from harness.prometheus import LocalPrometheus, PrometheusSetup, ScrapeJob

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

CERT_LIFETIME_H = 0.01  # 36 s: renewed every 24 s, so a renewal happens while the test runs


@pytest.fixture(scope="module")
def controller_args() -> list[str]:
    return ["--tls", "on", "--cert-lifetime-h", str(CERT_LIFETIME_H), "--router-replicas", "1"]


@pytest.fixture(scope="module")
def controller_scheme() -> str:
    return "https"


@pytest.fixture(scope="module", autouse=True)
def quick_reload():
    """Every process of the fleet looks at its certificate file each second (the default is 5 s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDEFLOW_TLS_RELOAD_S", "1")
        yield


@pytest.fixture(scope="module")
def pd(controller, tiny_model_dir):
    spec = InferenceGroup.model_validate({
        "name": "tls-pd", "version": "v1", "model": {"path": str(tiny_model_dir)}, "transfer": "tcp",
        "roles": [{"role": "prefill", "engine": {"kv_cache_bytes": 8_000_000, "max_wait_ms": 0}},
                  {"role": "decode", "engine": {"kv_cache_bytes": 8_000_000, "max_wait_ms": 0}}]})
    controller.apply(spec)
    assert controller.wait_for("tls-pd", {GroupState.READY, GroupState.FAILED}, 180).state == GroupState.READY
    (group,) = [g for g in controller.status().groups if g.name == "tls-pd"]
    return {m.role: m.endpoint for m in group.members}


def _client(home: Path) -> openai.OpenAI:
    """The openai client as an operator points it at a TLS router: the fleet CA is what it trusts."""
    status_url = discovery.find().url
    assert status_url.startswith("https://")
    return openai.OpenAI(base_url=_router_url() + "/v1", api_key=discovery.router_key(), max_retries=0, timeout=30,
                         http_client=httpx.Client(verify=ssl.create_default_context(cafile=home / "tls" / "ca.pem")))


def _router_url() -> str:
    from engine.control.client import ControlClient

    with ControlClient.connect() as c:
        return c.status().router_url


def _member_key(home: Path) -> str:
    store = Store(home / "controller.db")
    try:
        return store.secret("member")
    finally:
        store.close()


def _serial(url: str, ca: Path) -> int:
    """The serial of the certificate `url` serves now (a new handshake)."""
    host, port = url.split("//")[1].split(":")
    context = ssl.create_default_context(cafile=ca)
    context.check_hostname = False  # only the certificate is read here; the fleet's clients check names
    with context.wrap_socket(socket.create_connection((host, int(port)), timeout=5)) as s:
        return x509.load_der_x509_certificate(s.getpeercert(binary_form=True)).serial_number


def test_every_hop_is_tls_and_the_openai_client_gets_its_tokens(controller, pd, tideflow_home):
    assert set(pd) == {"prefill", "decode"} and all(url.startswith("https://") for url in pd.values())
    assert _router_url().startswith("https://")
    client = _client(tideflow_home)
    answer = client.completions.create(model="default", prompt="hello over tls", max_tokens=6,
                                       extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 6
    streamed = list(client.completions.create(model="default", prompt="hello again", max_tokens=6, stream=True,
                                              stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert streamed[-1].usage.completion_tokens == 6 and "".join(c.choices[0].text for c in streamed if c.choices)
    # the KV went prefill -> decode over the TCP transport (mutual TLS, as tests/engine/test_tls.py shows it)
    router = identity_paths(tideflow_home / "tls", "router")
    with httpx.Client(verify=tls.client_context_for(router, router.ca), trust_env=False,
                      headers={"authorization": f"Bearer {_member_key(tideflow_home)}"}) as member:
        text = member.get(pd["decode"] + "/metrics").text
    pulled = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name.startswith("tideflow_kv_transfer_")}
    assert pulled["tideflow_kv_transfer_bytes_total"] > 0 and pulled["tideflow_kv_transfer_failures_total"] == 0
    # a member lets in no client without the fleet's certificate, however good its key
    with httpx.Client(verify=tls.client_context_for(None, router.ca), trust_env=False,
                      headers={"authorization": f"Bearer {_member_key(tideflow_home)}"}) as keyed_only:
        with pytest.raises(httpx.RemoteProtocolError):
            keyed_only.get(pd["decode"] + "/metrics")


def test_certificates_are_renewed_under_load_and_no_request_fails(controller, pd, tideflow_home):
    ca = tideflow_home / "tls" / "ca.pem"
    before = {role: _serial(url, ca) for role, url in pd.items()}
    client = _client(tideflow_home)
    failures, answered, stop = [], [0], threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                got = client.completions.create(model="default", prompt="renewal", max_tokens=4,
                                                extra_body={"ignore_eos": True})
                assert got.usage.completion_tokens == 4
                answered[0] += 1
            except Exception as exc:  # every failure is kept and shown
                failures.append(repr(exc))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60  # a renewal comes at most every 24 s; processes reload within a second
        while time.monotonic() < deadline:
            if all(_serial(url, ca) != before[role] for role, url in pd.items()):
                break
            time.sleep(1)
        renewed = {role: _serial(url, ca) != before[role] for role, url in pd.items()}
        time.sleep(2)  # and requests go on through the renewed certificates
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert renewed == {"prefill": True, "decode": True}
    assert failures == [] and answered[0] > 0, failures[:3]
    events = [e.message for e in controller.events(200) if e.kind == "tls"]
    assert any("member" in m for m in events), events


def test_a_member_with_another_ca_s_certificate_is_refused_both_ways(controller, pd, tideflow_home, tiny_model_dir,
                                                                     tmp_path):
    stranger = FleetCA(tmp_path / "stranger", dt.timedelta(hours=1))
    rogue = stranger.issue("member", ["127.0.0.1", "localhost"])
    port = free_port()
    child = Child("rogue", tideflow_argv("serve", "--model", str(tiny_model_dir), "--port", str(port),
                                         "--tls-cert", str(rogue.cert), "--tls-key", str(rogue.key),
                                         "--tls-ca", str(rogue.ca)), tmp_path / "rogue.log",
                  {"TIDEFLOW_API_KEYS": "rogue-key"})
    try:
        rogue_url = f"https://127.0.0.1:{port}"
        own = tls.client_context_for(stranger.issue("client", ["127.0.0.1"]), rogue.ca)
        deadline = time.monotonic() + 120
        while True:  # up, as its own CA sees it
            try:
                if httpx.get(rogue_url + "/health", verify=own, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert child.alive() and time.monotonic() < deadline, child.log_tail()
            time.sleep(0.2)
        router = identity_paths(tideflow_home / "tls", "router")
        fleet = tls.client_context_for(router, router.ca)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # the fleet does not trust it
            httpx.get(rogue_url + "/health", verify=fleet, trust_env=False)
        as_rogue = tls.client_context_for(rogue, router.ca)  # trusting the fleet, showing its own certificate
        with pytest.raises(httpx.RemoteProtocolError):  # and the fleet's members do not let it in
            httpx.get(pd["decode"] + "/health", verify=as_rogue, trust_env=False)
        assert httpx.get(pd["decode"] + "/health", verify=fleet, trust_env=False).status_code == 200
    finally:
        child.stop()


def test_prometheus_discovers_and_scrapes_every_process_over_tls(controller, pd, tideflow_home, tmp_path):
    """The rendered prometheus.yml as an operator uses it on a TLS fleet: https, the fleet CA, a fleet certificate."""
    identity = identity_paths(tideflow_home / "tls", "router")
    client_key, url = discovery.router_key(), discovery.find().url
    jobs = [ScrapeJob(name="router", sd_url=url + "/v1/targets?job=router", key=client_key, tls=identity),
            ScrapeJob(name="engines", sd_url=url + "/v1/targets?job=engines", key=_member_key(tideflow_home),
                      sd_key=client_key, tls=identity)]
    with LocalPrometheus(jobs, tmp_path, PrometheusSetup(scrape_interval_s=1)) as prom:
        deadline, seen = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            active = httpx.get(prom.url + "/api/v1/targets", trust_env=False, timeout=30).json()["data"]["activeTargets"]
            seen = sorted((t["labels"]["job"], t["scrapeUrl"], t["health"], t["lastError"]) for t in active)
            if len(seen) == 3 and all(health == "up" for _, _, health, _ in seen):
                break
            time.sleep(0.5)
    assert [(job, scrape.split("://")[0], health) for job, scrape, health, _ in seen] == \
        [("engines", "https", "up"), ("engines", "https", "up"), ("router", "https", "up")], seen
