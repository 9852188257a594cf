"""One Prefect local API for the whole flows suite (prefect_test_harness), and a private TIDEFLOW_HOME."""

from __future__ import annotations

import os

import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def flow_home(tmp_path_factory, prefect_api):
    home = tmp_path_factory.mktemp("flows-home")
    old = os.environ.get("TIDEFLOW_HOME")
    os.environ["TIDEFLOW_HOME"] = str(home)
    yield home
    from engine.group.groupset import close_groupsets

    close_groupsets()
    if old is None:
        os.environ.pop("TIDEFLOW_HOME", None)
    else:
        os.environ["TIDEFLOW_HOME"] = old
