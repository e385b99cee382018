"""The formatter and the linter agree with every file, so formatting never shows in a step diff."""

import subprocess
import sys

from conftest import ROOT


def ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True)


def test_ruff_format():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_ruff_lint():
    result = ruff("check", ".")
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
