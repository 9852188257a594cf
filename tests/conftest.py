"""Session-wide fixtures: model checkpoints written once per test session, and a moto S3 server over HTTP."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from engine.offline.default_model import DEFAULT_CONFIG, TINY_CONFIG, write_default_model
from engine.runtime.process import start_ticks
from harness.moto import start_moto
from tideflow_kernels.spec import KERNELS_ENV

# Members started by tests use a kernel build only where a test made one (tests/kernels, the release flow):
# greedy outputs are compared with in-process references on torch's ops, and compiling in every module's
# private home would cost ~20 s each. tests/kernels/test_startup.py covers the default (auto) build.
os.environ.setdefault(KERNELS_ENV, "cached")

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A moto S3 server in its own process on 127.0.0.1; env points boto3 (and children) at it."""
    saved = {k: os.environ.get(k) for k in [*_AWS_ENV, "TIDEFLOW_S3_ENDPOINT_URL", "AWS_PROFILE"]}
    server, endpoint = start_moto(tmp_path_factory.mktemp("moto") / "server.log", timeout_s=60)
    try:
        os.environ.update(_AWS_ENV, TIDEFLOW_S3_ENDPOINT_URL=endpoint)
        os.environ.pop("AWS_PROFILE", None)
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer, 4-expert MoE with a 512-token BPE vocabulary: fast enough for any test."""
    return write_default_model(tmp_path_factory.mktemp("tiny-model"), TINY_CONFIG, seed=0)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    """The ~115M-parameter default model that `tideflow model init` writes."""
    return write_default_model(tmp_path_factory.mktemp("default-model"), DEFAULT_CONFIG, seed=0)


@pytest.fixture(scope="module")
def tideflow_home(tmp_path_factory):
    """A private TIDEFLOW_HOME for the module: processes it starts keep their state there."""
    home = tmp_path_factory.mktemp("tideflow-home")
    old = os.environ.get("TIDEFLOW_HOME")
    os.environ["TIDEFLOW_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("TIDEFLOW_HOME", None)
    else:
        os.environ["TIDEFLOW_HOME"] = old


def tideflow_processes(home: Path) -> list[int]:
    """Live processes started for this TIDEFLOW_HOME (their environment names it): what must be gone
    once a test has stopped its fleet."""
    needle = f"TIDEFLOW_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and start_ticks(int(entry.name)) is not None:
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def assert_nothing_left(home: Path, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := tideflow_processes(home)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in left]


@pytest.fixture(scope="module")
def controller_model_dir(tiny_model_dir):
    """The controller's --model-dir (its router's tokenizer); None: the default model it writes into the home."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def controller_args() -> list[str]:
    """More `tideflow controller` flags for a module's controller (a module overrides this fixture)."""
    return []


@pytest.fixture(scope="module")
def controller_scheme() -> str:
    """https for a module whose controller_args turn TLS on."""
    return "http"


@pytest.fixture(scope="module")
def controller(tideflow_home, controller_model_dir, controller_args, controller_scheme):
    """`tideflow controller` in its own process (as users run it); yields its client. Afterwards
    `tideflow down` stops the fleet, and no process of this home may be left."""
    from engine.control.client import ControlClient
    from engine.control.local_runtime import stop_recorded_fleet
    from engine.runtime.process import free_port, start_service, tideflow_argv

    port = free_port()
    model = ["--model-dir", str(controller_model_dir)] if controller_model_dir is not None else []
    argv = tideflow_argv("controller", "--port", str(port), *model, *controller_args)
    child = start_service("controller", argv, tideflow_home / "logs" / "controller.log",
                          f"{controller_scheme}://127.0.0.1:{port}/health", timeout_s=120)
    client = ControlClient.connect()
    try:
        yield client
    finally:
        client.close()
        try:
            down = subprocess.run(tideflow_argv("down"), capture_output=True, text=True, timeout=180)
            assert down.returncode == 0, down.stderr
        finally:
            child.stop(grace_s=60)
            stop_recorded_fleet()  # whatever a failed `down` left
            assert_nothing_left(tideflow_home)


# ---- the inner loop: `make test-fast` (`pytest -m "not fleet"`) -------------------------------------------------
# A `fleet` test starts processes or servers: a server through the one supervisor (members, routers, controllers,
# Prometheus, moto, Prefect's API), a `tideflow` command line, another Python process, a compiler (a kernel build),
# a multiprocessing worker (DEP ranks), or a socket that listens (an app served on a thread). Those need ports,
# homes and reaping, and they are what makes the suite take minutes. A module says so with
# `pytestmark = pytest.mark.fleet`; a module with a test that uses one of FLEET_FIXTURES is marked here. A test
# not marked may start none of them: the guard below fails such a test, naming what it started, so the
# marks stay true as tests change. Slow tests count as fleet tests.
FLEET_FIXTURES = frozenset({"s3_endpoint", "controller", "prefect_api", "flow_home"})
_HARMLESS = frozenset({"uname"})  # platform.processor() asks it


def pytest_collection_modifyitems(config, items):
    """Whole modules: a module-scoped fixture of a fleet test is torn down after the module's last test. A slow
    test is a fleet test too (each runs a pipeline, a drill or a simulation in processes of its own), so
    `-m "not fleet"` alone is the inner loop."""
    fleet_modules = {item.module for item in items
                     if FLEET_FIXTURES & set(getattr(item, "fixturenames", ()))
                     or item.get_closest_marker("fleet") or item.get_closest_marker("slow")}
    for item in items:
        if item.module in fleet_modules:
            item.add_marker(pytest.mark.fleet)


class _Guard:
    """Refuses processes and listening sockets while an unmarked test runs (setup and teardown included)."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.saved = (subprocess.Popen.__init__, socket.socket.listen, multiprocessing.process.BaseProcess.start)

    def refuse(self, what: str):
        raise RuntimeError(f"{self.nodeid} starts {what} but is not marked fleet: add `pytestmark = "
                           "pytest.mark.fleet` to its module (tests/conftest.py says why)")

    def __enter__(self) -> "_Guard":
        popen, listen, start = self.saved
        guard = self

        def guarded_popen(proc, args, *a, **kw):
            argv = [str(x) for x in (args if isinstance(args, (list, tuple)) else [args])]
            if os.path.basename(argv[0]) not in _HARMLESS:
                guard.refuse(f"a process ({' '.join(argv[:3])})")
            return popen(proc, args, *a, **kw)

        def guarded_listen(sock, *a):
            guard.refuse(f"a server (a socket listening on {sock.getsockname()})")

        def guarded_start(process):
            guard.refuse(f"a multiprocessing worker ({process.name})")

        subprocess.Popen.__init__ = guarded_popen
        socket.socket.listen = guarded_listen
        multiprocessing.process.BaseProcess.start = guarded_start
        return self

    def __exit__(self, *exc) -> None:
        subprocess.Popen.__init__, socket.socket.listen, multiprocessing.process.BaseProcess.start = self.saved


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("fleet") is not None:
        yield
        return
    with _Guard(item.nodeid):
        yield


# A TLS identity in this process's environment reaches every process a later test starts (engine.runtime.tls reads
# it from there): members would serve https where their controller expects http. No test may leave one behind.
_TLS_ENV = ("TIDEFLOW_TLS_CERT", "TIDEFLOW_TLS_KEY", "TIDEFLOW_TLS_CA")


@pytest.fixture(autouse=True)
def no_tls_identity_left_behind():
    before = {name: os.environ.get(name) for name in _TLS_ENV}
    yield
    left = {name: os.environ.get(name) for name in _TLS_ENV if os.environ.get(name) != before[name]}
    for name in left:  # put back, so one leak fails one test and not the rest of the run
        if before[name] is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before[name]
    assert not left, f"the test left a TLS identity in this process's environment: {left}"
