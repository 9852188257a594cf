"""One Prefect local API for the whole flows suite (prefect_test_harness), and a controller per module
in its own process: the flows find it through $TIDEFLOW_HOME, as they do when a user runs them."""

from __future__ import annotations

import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def controller_model_dir():
    """None: the controller writes the default model into the home (the release publishes it)."""
    return None


@pytest.fixture(scope="module")
def flow_home(tideflow_home, prefect_api, controller):
    yield tideflow_home
