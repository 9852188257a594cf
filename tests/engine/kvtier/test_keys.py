"""Block records: a block is read back only if it is whole and is the block its key names; namespaces keep versions,
dtypes and layouts apart."""

from __future__ import annotations

import pytest

from engine.kvtier.keys import CorruptBlock, KVNamespace, decode, encode, version_prefix

NS = KVNamespace.of("m", "v1", dtype="torch.float32", block_size=16, layout=(2, 2, 32), weights_id="w")
PAYLOAD = bytes(range(256)) * 4


def test_a_record_reads_back_as_its_payload():
    key = NS.key(42)
    assert bytes(decode(key, encode(key, PAYLOAD), len(PAYLOAD))) == PAYLOAD


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "header"])
def test_a_damaged_record_is_refused(damage):
    key = NS.key(42)
    record = bytearray(encode(key, PAYLOAD))
    if damage == "flip":
        record[-7] ^= 0x40
    elif damage == "truncate":
        del record[-100:]
    elif damage == "extend":
        record += b"\0"
    else:
        record[0:4] = b"XXXX"
    with pytest.raises(CorruptBlock):
        decode(key, bytes(record), len(PAYLOAD))


def test_a_record_under_another_key_is_refused():
    with pytest.raises(CorruptBlock, match="another block"):
        decode(NS.key(43), encode(NS.key(42), PAYLOAD), len(PAYLOAD))


def test_every_part_of_the_namespace_changes_the_keys():
    base = dict(dtype="torch.float32", block_size=16, layout=(2, 2, 32), weights_id="w")
    keys = {KVNamespace.of("m", "v1", **base).key(7)}
    for change in [dict(dtype="torch.bfloat16"), dict(block_size=32), dict(layout=(2, 4, 32)), dict(weights_id="x")]:
        keys.add(KVNamespace.of("m", "v1", **{**base, **change}).key(7))
    keys.add(KVNamespace.of("m", "v2", **base).key(7))
    keys.add(KVNamespace.of("other", "v1", **base).key(7))
    assert len(keys) == 7


def test_a_version_prefix_holds_every_key_of_that_version_only():
    v1 = KVNamespace.of("org/model", "v1", dtype="d", block_size=16, layout=(1,), weights_id="w")
    v10 = KVNamespace.of("org/model", "v10", dtype="d", block_size=16, layout=(1,), weights_id="w")
    assert v1.key(1).startswith(version_prefix("org/model", "v1"))
    assert not v10.key(1).startswith(version_prefix("org/model", "v1"))
    assert version_prefix("org/model", "v1") == "kv/org_model/v1/"  # a model id's '/' is no extra folder
