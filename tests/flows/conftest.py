"""One Prefect local API for the whole flows suite (prefect_test_harness), and a private TIDEFLOW_HOME."""

from __future__ import annotations

import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def flow_home(tideflow_home, prefect_api):
    yield tideflow_home
    from engine.group.groupset import close_groupsets

    close_groupsets()
