"""The formatter and the linter agree with every file, so formatting never shows in a step diff;
every train.py's main() reads in a screen."""

import ast
import subprocess
import sys

from conftest import ROOT
from steps import step_folders


def ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True)


def test_ruff_format():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_ruff_lint():
    result = ruff("check", ".")
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_every_train_main_reads_in_a_screen():
    """STYLE.md: train.py is a `main()` that calls small named functions; at most 60 lines in every
    step, so that a technique's wiring is one call, not lines of the loop."""
    long = {}
    for step in step_folders(ROOT):
        path = step / "train.py"
        if not path.exists():
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long[step.name] = lines
    assert not long, f"main() longer than 60 lines: {long}"
