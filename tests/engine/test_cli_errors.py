"""Bad input on the command line or in files: one line on stderr naming the problem, exit 2, never a
traceback; key files are 0600 whatever was there."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess

import pytest

from engine.control import discovery
from engine.runtime.process import tideflow_argv

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(tideflow_argv(*args), capture_output=True, text=True, timeout=120, env=env)


def assert_one_line_error(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode in (1, 2), (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and needle in done.stderr, done.stderr


def test_router_without_admin_keys(monkeypatch):
    monkeypatch.delenv("TIDEFLOW_ADMIN_KEYS", raising=False)
    assert_one_line_error(run("router", "--port", "0"), "TIDEFLOW_ADMIN_KEYS")


def test_a_spec_that_is_not_utf8(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_bytes(b"name: \xff\xfe\n")
    assert_one_line_error(run("group", "render", str(spec), "--backend", "kubernetes"), "bad.yaml")


def test_a_manifest_path_with_a_nul(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    entry = {"path": "a\u0000b", "size": 1, "sha256": "0" * 64, "part_size": 1,
             "parts": ["LCa0a2j/xo/5m0U8HTBBNBNCLXBkg7+g+YpeiGJm564="]}
    (store / "manifest.json").write_text(json.dumps({"format": 1, "part_size": 1, "files": [entry]}))
    done = run("weights", "pull", store.as_uri() + "/", "--cache", str(tmp_path / "cache"))
    assert_one_line_error(done, "control character")


def test_key_files_are_0600_even_when_they_existed_wider(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path))
    for path in (discovery.router_key_path(), discovery.info_path()):
        path.write_text("old")
        path.chmod(0o644)
    discovery.register(discovery.ControllerInfo(url="http://127.0.0.1:1", admin_key="k", pid=1, ticks=1), "client")
    for path in (discovery.router_key_path(), discovery.info_path()):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert discovery.router_key() == "client"


def test_a_tokenizer_that_is_not_json_is_one_line(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").write_text("this is not json\n")
    assert_one_line_error(run("generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "1"),
                          "tokenizer.json is not a tokenizer")


def test_a_spec_past_the_last_port_is_refused_before_anything_starts(tmp_path):
    spec = tmp_path / "ports.yaml"
    spec.write_text("name: g\nversion: v1\nmodel: {path: /m}\nroles:\n  - {role: colocated, instances: 2, "
                    "port_base: 65535}\n")
    assert_one_line_error(run("group", "render", str(spec), "--backend", "kubernetes"), "past 65535")
