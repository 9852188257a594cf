"""FaultConfig parsing and the seeded draw of failed requests."""

import asyncio

import pytest

from engine.api.fault_config import FaultConfig
from engine.server.faults import INJECTED_CODE, FaultInjector
from engine.api.errors import APIError


def failures(injector, n=200):
    out = []
    for _ in range(n):
        try:
            injector.check()
            out.append(False)
        except APIError as exc:
            assert exc.status == 500 and exc.code == INJECTED_CODE
            out.append(True)
    return out


def test_parse_inline_json_and_file(tmp_path):
    assert FaultConfig.parse('{"error_rate": 0.25, "seed": 3}') == FaultConfig(error_rate=0.25, seed=3)
    path = tmp_path / "faults.json"
    path.write_text('{"token_delay_s": 0.01}')
    assert FaultConfig.parse(str(path)).token_delay_s == 0.01


@pytest.mark.parametrize("text, words", [('{"error_rate": 2}', "error_rate"), ('{"nope": 1}', "nope"),
                                         ("{bad", "not valid JSON"), ("/no/such/file", "cannot read")])
def test_bad_faults_name_the_problem(text, words):
    with pytest.raises(ValueError, match=words):
        FaultConfig.parse(text)


def test_same_seed_same_failures_and_about_the_share():
    a = failures(FaultInjector(FaultConfig(error_rate=0.3, seed=7)))
    b = failures(FaultInjector(FaultConfig(error_rate=0.3, seed=7)))
    c = failures(FaultInjector(FaultConfig(error_rate=0.3, seed=8)))
    assert a == b and a != c
    assert 30 < sum(a) < 90


def test_no_faults_by_default():
    injector = FaultInjector()
    assert not any(failures(injector))
    stream = object()
    assert injector.slow(stream) is stream


class FakeStream:
    request_id = "r1"

    async def __aiter__(self):
        for i in range(3):
            yield i


def test_slow_stream_keeps_outputs_and_request_id():
    slowed = FaultInjector(FaultConfig(token_delay_s=0.001)).slow(FakeStream())

    async def collect():
        return [x async for x in slowed]

    assert slowed.request_id == "r1"
    assert asyncio.run(collect()) == [0, 1, 2]
