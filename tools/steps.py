"""Find the step folders of the course and the files that belong to each step.

A step folder sits at the repository root and is named `step<number>_<topic>`; the steps are
ordered by their number (step10 comes after step9). A file belongs to a step when git tracks it
or would track it: untracked files count as soon as they exist (so a new file is part of the step
before it is committed), ignored files never do, and neither does anything in `__pycache__` or
ending in `.pyc`, even if it was committed by mistake.
"""

import os
import re
import subprocess
from itertools import pairwise
from pathlib import Path

STEP_NAME = re.compile(r"step(\d+)_[A-Za-z0-9_]+")


def git(root: Path, *args: str) -> bytes:
    """Run git in `root` and return its stdout; a failure raises with git's own message."""
    result = subprocess.run(["git", "-C", str(root), *args], capture_output=True)
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"`git {' '.join(args)}` failed in {root}: {message}")
    return result.stdout


def step_number(folder: Path) -> int:
    match = STEP_NAME.fullmatch(folder.name)
    assert match, f"{folder.name} is not a step folder"
    return int(match.group(1))


def step_folders(root: Path) -> list[Path]:
    """The step folders at the root, ordered by their number (as numbers: 9 before 10)."""
    folders = [p for p in root.iterdir() if p.is_dir() and STEP_NAME.fullmatch(p.name)]
    folders.sort(key=step_number)
    for earlier, later in pairwise(folders):
        if step_number(earlier) == step_number(later):
            raise ValueError(
                f"two folders for step {step_number(later)}: {earlier.name}, {later.name}"
            )
    return folders


def step_modules(root: Path) -> list[str]:
    """The names of the Python modules the step folders hold (model, train, ...). The steps share
    them: a process that imports two steps' modules drops these from its cache in between."""
    return sorted({p.stem for step in step_folders(root) for p in step.glob("*.py")})


def is_build_output(path: str) -> bool:
    return "__pycache__" in path.split("/") or path.endswith(".pyc")


def step_files(root: Path, step: Path) -> list[str]:
    """Files of one step, as sorted posix paths relative to the step folder."""
    # --cached: tracked files; --others --exclude-standard: untracked files git does not ignore.
    listing = ["ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    out = git(root, *listing, "--", step.name)
    prefix = step.name + "/"
    files = set()
    for name in os.fsdecode(out).split("\0"):
        if not name.startswith(prefix) or is_build_output(name):
            continue
        # A tracked file deleted from the working tree is no longer part of the step.
        if (root / name).is_file():
            files.add(name[len(prefix) :])
    return sorted(files)
