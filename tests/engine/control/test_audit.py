"""The audit log on its own: a chain that verifies, and each kind of tampering caught at its line; a torn write
cut off and put on record; secrets redacted; a large spec kept by digest."""

from __future__ import annotations

import json
import stat

from engine.control.audit import AuditLog, read_entries, verify
from engine.control.audit_http import result_of, target_of


def _log(tmp_path, n: int = 5) -> AuditLog:
    audit = AuditLog(tmp_path / "audit.jsonl")
    for i in range(n):
        audit.record(f"admin:{i:016x}", "PUT /v1/groups", f"g{i}", {"body": {"name": f"g{i}"}}, "ok", 200)
    return audit


def test_a_written_chain_verifies_and_a_reopened_log_goes_on_from_its_head(tmp_path):
    audit = _log(tmp_path)
    report = verify(audit.path)
    assert report.intact and report.entries == 5 and report.head == read_entries(audit.path)[-1].hash
    assert stat.S_IMODE(audit.path.stat().st_mode) == 0o600
    again = AuditLog(audit.path)  # a restarted controller
    entry = again.record("client:1", "DELETE /v1/groups/g1", "g1", {}, "ok", 200)
    assert entry.seq == 6 and entry.prev == report.head and verify(audit.path).intact


def test_an_edited_line_is_caught_at_its_position_and_only_there(tmp_path):
    audit = _log(tmp_path)
    lines = audit.path.read_text().splitlines()
    edited = json.loads(lines[2])
    edited["target"] = "someone-else"
    lines[2] = json.dumps(edited)
    audit.path.write_text("\n".join(lines) + "\n")
    report = verify(audit.path)
    assert [b.line for b in report.breaks] == [3] and "edited" in report.breaks[0].why


def test_a_rehashed_edit_a_removed_line_and_a_swap_are_caught_where_the_chain_breaks(tmp_path):
    audit = _log(tmp_path)
    lines = audit.path.read_text().splitlines()
    forged = json.loads(lines[1])
    forged["result"] = "refused"
    from engine.control.audit import entry_hash
    forged["hash"] = entry_hash({k: v for k, v in forged.items() if k != "hash"})  # an editor who rehashes it
    (tmp_path / "rehashed.jsonl").write_text("\n".join([lines[0], json.dumps(forged), *lines[2:]]) + "\n")
    assert [b.line for b in verify(tmp_path / "rehashed.jsonl").breaks] == [3]  # the next line no longer follows
    (tmp_path / "removed.jsonl").write_text("\n".join([lines[0], *lines[2:]]) + "\n")
    assert [b.line for b in verify(tmp_path / "removed.jsonl").breaks] == [2]
    (tmp_path / "swapped.jsonl").write_text("\n".join([lines[0], lines[2], lines[1], *lines[3:]]) + "\n")
    assert [b.line for b in verify(tmp_path / "swapped.jsonl").breaks] == [2, 3, 4]
    (tmp_path / "garbage.jsonl").write_text("\n".join([*lines[:4], "not json", lines[4]]) + "\n")
    assert [b.line for b in verify(tmp_path / "garbage.jsonl").breaks] == [5, 6]


def test_a_torn_last_write_is_cut_off_and_recorded(tmp_path):
    audit = _log(tmp_path, 3)
    with open(audit.path, "ab") as f:
        f.write(b'{"seq": 4, "at": "2026-')  # the controller died mid-write
    reopened = AuditLog(audit.path)
    entries = read_entries(reopened.path)
    assert [e.action for e in entries][-1] == "audit.recover" and entries[-1].params == {"torn_bytes": 23}
    assert verify(reopened.path).intact and entries[-1].seq == 4


def test_secrets_are_redacted_and_a_large_body_is_kept_by_digest(tmp_path):
    audit = AuditLog(tmp_path / "audit.jsonl")
    e = audit.record("admin:x", "PUT /v1/groups", "g", {"body": {"name": "g", "env": {"HF_TOKEN": "hf_secret"},
                                                                    "api_key": "sk-1"}}, "ok", 200)
    assert e.params["body"]["env"]["HF_TOKEN"] == "<redacted>" and e.params["body"]["api_key"] == "<redacted>"
    assert "hf_secret" not in audit.path.read_text() and "sk-1" not in audit.path.read_text()
    big = audit.record("admin:x", "PUT /v1/groups", "big", {"body": {"name": "big", "version": "v2",
                                                                     "roles": ["x" * 100] * 100}}, "ok", 200)
    assert set(big.params["body"]) == {"name", "version", "sha256", "bytes"} and big.params["body"]["bytes"] > 4096


def test_results_and_targets_are_read_from_the_call():
    assert [result_of(s) for s in (200, 401, 403, 409, 422, 500, 0)] == [
        "ok", "refused", "refused", "rejected", "rejected", "failed", "failed"]
    assert target_of("/v1/groups/ctl-a/park", None) == "ctl-a"
    assert target_of("/v1/groups", {"name": "ctl-b"}) == "ctl-b"
    assert target_of("/v1/pools/scale", {"template": {"name": "pool"}}) == "pool"
    assert target_of("/v1/weights", {"weights": {"b": 1, "a": 2}}) == "a,b"

