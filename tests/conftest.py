"""Session-wide fixtures: model checkpoints written once per test session."""

from __future__ import annotations

import os

import pytest

from engine.default_model import DEFAULT_CONFIG, TINY_CONFIG, write_default_model


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
