"""`tideflow weights ...` through a parser built the way the top-level CLI builds it."""

import argparse

import pytest

from engine.weights.cli import add_commands

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tideflow")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_publish_verify_pull_commands(backend, checkpoint, tmp_path, capsys):
    assert _main(["weights", "publish", str(checkpoint), "--to", backend.url,
                  "--part-size", "5", "--concurrency", "2"]) == 0
    assert capsys.readouterr().out.startswith("published: ")
    assert _main(["weights", "publish", str(checkpoint), "--to", backend.url, "--part-size", "5"]) == 0
    assert "already published (identical)" in capsys.readouterr().out
    assert _main(["weights", "verify", backend.url]) == 0
    assert _main(["weights", "verify", backend.url, "--deep"]) == 0
    assert "verified (deep)" in capsys.readouterr().out
    cache = tmp_path / "cache"
    assert _main(["weights", "pull", backend.url, "--cache", str(cache)]) == 0
    assert _main(["weights", "pull", backend.url, "--cache", str(cache)]) == 0
    assert "cache already verified" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["weights", "verify", "{url}"], "no manifest.json at"),
    (["weights", "pull", "{url}", "--cache", "{tmp}/c"], "no manifest.json at"),
    (["weights", "publish", "{tmp}/missing", "--to", "{url}"], "is not a directory"),
    (["weights", "publish", "{ckpt}", "--to", "{url}", "--part-size", "1"], "part_size"),
    (["weights", "verify", "ftp://host/x/"], "unsupported URL scheme"),
])
def test_failures_are_one_line_errors(argv, message, backend, checkpoint, tmp_path, capsys):
    argv = [a.format(url=backend.url, tmp=tmp_path, ckpt=checkpoint) for a in argv]
    assert _main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_conflict_exit_code_names_force(backend, own_checkpoint, capsys):
    assert _main(["weights", "publish", str(own_checkpoint), "--to", backend.url, "--part-size", "5"]) == 0
    (own_checkpoint / "config.json").write_text('{"model_type": "changed"}')
    assert _main(["weights", "publish", str(own_checkpoint), "--to", backend.url]) == 1
    err = capsys.readouterr().err
    assert "config.json" in err and "--force" in err
    assert _main(["weights", "publish", str(own_checkpoint), "--to", backend.url, "--force"]) == 0


@pytest.mark.parametrize("linked", ["tokenizer.json", "sub"])
def test_publish_refuses_a_symbolic_link_and_stores_nothing(linked, backend, own_checkpoint, tmp_path, capsys):
    """A checkpoint's link to a host file (or folder) must not carry that file into the store."""
    secret = tmp_path / "host-secret"
    secret.mkdir()
    (secret / "key.pem").write_text("PRIVATE KEY")
    target = secret / "key.pem" if linked == "tokenizer.json" else secret
    (own_checkpoint / linked).unlink(missing_ok=True)
    (own_checkpoint / linked).symlink_to(target)
    assert _main(["weights", "publish", str(own_checkpoint), "--to", backend.url]) == 1
    err = capsys.readouterr().err
    assert "symbolic link" in err and linked in err and "Traceback" not in err
    assert _main(["weights", "verify", backend.url]) == 1
    assert "no manifest.json at" in capsys.readouterr().err
