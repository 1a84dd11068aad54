"""`forkpoint serve --data-parallel-size N --ray-address ADDR`: documented, and bad values are clear
errors before anything starts."""

from __future__ import annotations

import pytest

from forkpoint.server.cli import build_parser, main


def test_serve_help_documents_the_replica_flags():
    serve_help = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"].format_help()
    assert "--data-parallel-size" in serve_help and "--ray-address" in serve_help


@pytest.mark.parametrize("argv,message", [
    (["serve", "--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["serve", "--data-parallel-size", "2", "--device", "cuda:1"], "each replica gets its own GPU"),
])
def test_bad_replica_options_are_clear_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
