"""Carry a change made in one step folder into every later step folder.

A fix goes into the earliest step that has the code; this tool repeats it in the later steps, so
that no copy is fixed by hand and none is forgotten. The change is the difference between the file
at git HEAD and in the working tree of step K. For each later step that has the file:

- identical to step K at HEAD: the new version is copied over;
- different (the later step added its own code): the change is merged in with
  `git merge-file`, using step K at HEAD as the common base, which keeps the later step's own
  lines. If any merge conflicts, the tool names the file and step and writes nothing at all.

A file that is new in step K is copied into later steps only with --new, a deleted one is removed
from later steps only with --delete: either change may belong to step K alone.

    python tools/carry_forward.py step3_dataloader/train.py [more files of the same step]
    python tools/carry_forward.py --step 3 [--new] [--delete] [--dry-run]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from steps import git, is_build_output, step_files, step_folders, step_number


@dataclass
class Change:
    path: str  # relative to the step folder
    old: bytes | None  # at HEAD; None for a new file
    new: bytes | None  # in the working tree; None for a deleted file


@dataclass
class Action:
    step: Path
    path: str
    note: str  # what happens, for the report
    data: bytes | None = None  # what to write
    delete: bool = False
    mode_from: Path | None = None  # a created file takes its mode from step K


class Conflict(Exception):
    pass


def head_version(root: Path, path: str) -> bytes | None:
    """The file's content at HEAD, or None if HEAD does not have it."""
    # HEAD:./path is relative to the root even if the root is not the top of the repository.
    result = subprocess.run(
        ["git", "-C", str(root), "cat-file", "blob", f"HEAD:./{path}"], capture_output=True
    )
    return result.stdout if result.returncode == 0 else None


def working_version(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def changes_of_step(root: Path, step: Path) -> list[str]:
    """Files of the step that differ between HEAD and the working tree (new and deleted too)."""
    try:
        out = git(root, "ls-tree", "-r", "-z", "--name-only", "HEAD", "--", step.name)
    except RuntimeError:  # no commit yet: every file is new
        out = b""
    prefix = step.name + "/"
    at_head = {
        name[len(prefix) :] for name in os.fsdecode(out).split("\0") if name.startswith(prefix)
    }
    candidates = sorted(p for p in at_head | set(step_files(root, step)) if not is_build_output(p))
    changed = []
    for path in candidates:
        if head_version(root, f"{step.name}/{path}") != working_version(step / path):
            changed.append(path)
    return changed


def merge(current: bytes, base: bytes, other: bytes) -> tuple[bytes, int]:
    """Three-way merge of base->other into current; returns the result and the conflict count."""
    with tempfile.TemporaryDirectory() as tmp:
        names = []
        for name, data in (("current", current), ("base", base), ("other", other)):
            (Path(tmp) / name).write_bytes(data)
            names.append(str(Path(tmp) / name))
        result = subprocess.run(["git", "merge-file", "-p", *names], capture_output=True)
    # merge-file exits with the number of conflicts (at most 127), or with a negative code.
    if not 0 <= result.returncode <= 127:
        raise RuntimeError(f"git merge-file failed: {result.stderr.decode().strip()}")
    return result.stdout, result.returncode


def plan_one(change: Change, source: Path, later: Path, args) -> Action:
    """What to do with one changed file in one later step; raises Conflict if it cannot."""
    path, old, new = change.path, change.old, change.new
    target = working_version(later / path)
    where = f"{later.name}/{path}"
    if new is None and not args.delete:
        return Action(
            later, path, f"not carried: deleted in {source.name}, pass --delete to carry it"
        )
    if old is None and not args.new:
        return Action(later, path, f"not carried: new in {source.name}, pass --new to copy it")
    if target == new:
        return Action(later, path, "already up to date")
    if new is None:  # deleted in step K
        if target is None:
            return Action(later, path, "not in this step")
        if target != old:
            raise Conflict(
                f"{where} differs from {source.name}/{path} at HEAD; "
                "delete it by hand if it should go"
            )
        return Action(later, path, "deleted", delete=True)
    if old is None:  # new in step K
        if target is not None:
            raise Conflict(
                f"{where} already exists with other content than the new {source.name}/{path}"
            )
        return Action(later, path, "created", data=new, mode_from=source / path)
    if target is None:
        return Action(later, path, "not in this step")
    if target == old:
        return Action(later, path, f"copied (was identical to {source.name} at HEAD)", data=new)
    merged, conflicts = merge(target, old, new)
    if conflicts:
        raise Conflict(
            f"{where}: the change from {source.name}/{path} does not apply cleanly "
            f"({conflicts} conflicting hunk(s)); carry it into {later.name} by hand"
        )
    if merged == target:
        return Action(later, path, "already has the change")
    return Action(later, path, "merged (3-way, the step's own changes kept)", data=merged)


def resolve_paths(root: Path, steps: list[Path], paths: list[str]) -> tuple[Path, list[str]]:
    """Split the given files into their step folder and paths inside it; one step only."""
    by_name = {step.name: step for step in steps}
    found = []
    for arg in paths:
        path = Path(arg).resolve()  # relative to the current directory, like any command
        try:
            parts = path.relative_to(root).parts
        except ValueError:
            raise ValueError(f"{arg} is not inside {root}") from None
        if path.is_dir():
            raise ValueError(f"{arg} is a folder: name its changed files, or use --step N")
        if len(parts) < 2 or parts[0] not in by_name:
            raise ValueError(f"{arg} is not a file inside a step folder")
        found.append((by_name[parts[0]], "/".join(parts[1:])))
    sources = {step for step, _ in found}
    if len(sources) > 1:
        names = ", ".join(sorted(s.name for s in sources))
        raise ValueError(f"files come from several steps ({names}); carry one step at a time")
    return found[0][0], sorted({path for _, path in found})


def find_source(root: Path, steps: list[Path], args) -> tuple[Path, list[str]]:
    """Step K and the files to carry from it, inside the step folder."""
    if args.step is None:
        return resolve_paths(root, steps, args.paths)
    source = next((s for s in steps if step_number(s) == args.step), None)
    if source is None:
        raise ValueError(f"there is no step{args.step}_* folder in {root}")
    return source, changes_of_step(root, source)


def read_changes(root: Path, source: Path, paths: list[str]) -> list[Change]:
    changes = []
    for path in paths:
        old = head_version(root, f"{source.name}/{path}")
        new = working_version(source / path)
        if old is None and new is None:
            raise ValueError(f"{source.name}/{path} is neither at HEAD nor on disk")
        if old == new:
            print(f"{source.name}/{path}: unchanged since HEAD, nothing to carry")
        else:
            changes.append(Change(path, old, new))
    return changes


def plan(changes: list[Change], source: Path, later_steps: list[Path], args):
    """Every action in every later step, and every conflict. Nothing is written here, so that a
    conflict in step 9 cannot leave steps 4 to 8 already changed."""
    actions, conflicts = [], []
    for later in later_steps:
        for change in changes:
            try:
                actions.append(plan_one(change, source, later, args))
            except Conflict as conflict:
                conflicts.append(str(conflict))
    return actions, conflicts


def write(actions: list[Action]) -> None:
    for action in actions:
        target = action.step / action.path
        if action.delete:
            target.unlink()
        elif action.data is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(action.data)  # an existing file keeps its mode
            if action.mode_from is not None:
                shutil.copymode(action.mode_from, target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", help="changed files, all in the same step folder")
    parser.add_argument("--step", type=int, help="carry every changed file of this step number")
    parser.add_argument("--new", action="store_true", help="also copy files new in the step")
    parser.add_argument("--delete", action="store_true", help="also carry deleted files")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="repository root holding the step folders (default: %(default)s)",
    )
    args = parser.parse_args()
    if bool(args.paths) == (args.step is not None):
        parser.error("give either files of one step or --step N")
    root = args.root.resolve()

    try:
        steps = step_folders(root)
        source, paths = find_source(root, steps, args)
        changes = read_changes(root, source, paths)
        later_steps = [s for s in steps if step_number(s) > step_number(source)]
        actions, conflicts = plan(changes, source, later_steps, args)
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    if conflicts:
        for conflict in conflicts:
            print(f"conflict: {conflict}", file=sys.stderr)
        print("nothing was written", file=sys.stderr)
        return 1
    if not changes:
        print(f"no changes in {source.name} to carry")
        return 0
    if not later_steps:
        print(f"{source.name} is the last step: nothing to carry into")
        return 0
    for later in later_steps:
        print(later.name)
        for action in actions:
            if action.step == later:
                print(f"  {action.path}: {action.note}")
    if args.dry_run:
        print("dry run: nothing written")
        return 0
    write(actions)
    if any(a.data is not None or a.delete for a in actions):
        print("now run: python tools/make_patches.py, and commit the steps and patches together")
    return 0


if __name__ == "__main__":
    sys.exit(main())
