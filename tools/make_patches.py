"""Write one patch per step: the diff from the previous step folder, for learners to read.

For every pair of consecutive step folders, patches/<later step>.patch holds the unified diff from
the earlier folder to the later one. Paths in the patch are relative to the step folder, with git's
a/ and b/ prefixes (`--- a/train.py`, `+++ b/train.py`), and added or removed files are diffed
against /dev/null, so the patch turns a copy of the earlier step into the later step, all but
the step's README.md, which is left out (a lesson is read whole, not diffed against the last):

    cp -r step1_model my_step && git apply --directory=my_step patches/step2_<name>.patch
    cp -r step1_model my_step && patch -p1 -d my_step < patches/step2_<name>.patch

The output is deterministic (files sorted, no timestamps), so a patch only changes when a step
does, and `--check` can tell whether the committed patches are stale. Patches of steps that no
longer exist are removed.

    python tools/make_patches.py           # write patches/, print a line per patch
    python tools/make_patches.py --check   # write nothing, exit 1 if patches/ is out of date
    python tools/make_patches.py --shares  # write nothing; how much of each patch is technique

`--shares` counts each patch's changed lines (added and removed) by what their files are: the
run machinery that step 3 brings besides its dataloader (the flags, bookkeeping, the checkpoint,
...; a later step that changes one of them changes it for its technique), the instruments that
watch a technique (the timelines), and the rest, the technique: the share a learner reads.
"""

import argparse
import difflib
import os
import stat
import sys
from itertools import pairwise
from pathlib import Path

from steps import STEP_NAME, STEPS, step_files, step_folders

PATCH_DIR = "patches"
# Files that watch a technique from outside; the run machinery is step 3's files but its own.
INSTRUMENTS = ("overlap_timeline.py", "pipeline_timeline.py")
MACHINERY = tuple(
    path
    for step in STEPS
    if step.number == 3
    for path in step.changes
    if path not in ("dataloader.py", "train.py", "README.md")
)
CONTEXT_LINES = 3


def read_lines(path: Path) -> list[str]:
    """Lines with their "\\n"; only the last line may lack one (no newline at end of file)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; make_patches only diffs text files") from None
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]  # the piece after the last "\n" has no newline of its own
    return lines if lines[-1] else lines[:-1]


def git_mode(path: Path) -> str:
    return "100755" if os.stat(path).st_mode & stat.S_IXUSR else "100644"


def span(start: int, stop: int) -> str:
    """A hunk range as diff writes it: 1-based first line, count omitted when it is 1."""
    length = stop - start
    first = start + 1 if length else start  # an empty range names the line before it
    return str(first) if length == 1 else f"{first},{length}"


def hunks(old: list[str], new: list[str]) -> list[str]:
    # autojunk=False: by default difflib treats frequent lines (blank lines, a lone `)`) of long
    # files as noise, which gives correct but needlessly scattered hunks.
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    out = []
    for group in matcher.get_grouped_opcodes(CONTEXT_LINES):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        out.append(f"@@ -{span(i1, i2)} +{span(j1, j2)} @@\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out += [" " + line for line in old[i1:i2]]
                continue
            out += ["-" + line for line in old[i1:i2]]
            out += ["+" + line for line in new[j1:j2]]
    return [
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in out
    ]


def check_path(path: str) -> None:
    # git would quote such names in the headers, and neither git apply nor patch reads them back
    # the same way from a hand-rolled diff.
    if not path.isascii() or any(c.isspace() or c in '"\\' for c in path):
        raise ValueError(f"cannot write a patch header for {path!r}: use a plain ASCII file name")


# A step's lesson is read whole, not as a diff against the previous lesson.
LESSON = "README.md"


def file_diff(path: str, old: Path | None, new: Path | None) -> tuple[str, int, int]:
    """The git-style diff of one file, and its numbers of added and removed lines."""
    check_path(path)
    old_lines = read_lines(old) if old else []
    new_lines = read_lines(new) if new else []
    header = [f"diff --git a/{path} b/{path}\n"]
    if old is None:
        header.append(f"new file mode {git_mode(new)}\n")
    elif new is None:
        header.append(f"deleted file mode {git_mode(old)}\n")
    elif git_mode(old) != git_mode(new):
        header += [f"old mode {git_mode(old)}\n", f"new mode {git_mode(new)}\n"]
    if old_lines == new_lines:  # only the mode changed, or an empty file came or went
        return ("".join(header) if len(header) > 1 else ""), 0, 0
    body = hunks(old_lines, new_lines)
    header.append(f"--- a/{path}\n" if old else "--- /dev/null\n")
    header.append(f"+++ b/{path}\n" if new else "+++ /dev/null\n")
    added = sum(line.startswith("+") for line in body)
    removed = sum(line.startswith("-") for line in body)
    return "".join(header + body), added, removed


def make_patch(root: Path, earlier: Path, later: Path) -> tuple[str, str]:
    """The patch from one step folder to the next, and its one-line summary."""
    old_files, new_files = set(step_files(root, earlier)), set(step_files(root, later))
    parts = [
        f"Changes from {earlier.name} to {later.name}, written by tools/make_patches.py.\n"
        "Paths are relative to the step folder. To turn a copy of the earlier step into the\n"
        f"later one: git apply --directory=<copy> {PATCH_DIR}/{later.name}.patch\n"
        f"The step's {LESSON}, its lesson, is left out: read it whole.\n\n"
    ]
    changed = added = removed = 0
    for path in sorted((old_files | new_files) - {LESSON}):
        diff, plus, minus = file_diff(
            path,
            earlier / path if path in old_files else None,
            later / path if path in new_files else None,
        )
        if diff:
            parts.append(diff)
            changed, added, removed = changed + 1, added + plus, removed + minus
    summary = f"{changed} files changed, {added} insertions(+), {removed} deletions(-)"
    return "".join(parts), summary


def kind(path: str, step: Path) -> str:
    if path in INSTRUMENTS:
        return "instruments"
    machinery = path in MACHINERY and STEP_NAME.fullmatch(step.name).group(1) == "3"
    return "machinery" if machinery else "technique"


def shares(root: Path, earlier: Path, later: Path) -> dict[str, int]:
    """The changed lines (added and removed) of the patch from `earlier` to `later`, by `kind`."""
    old_files, new_files = set(step_files(root, earlier)), set(step_files(root, later))
    lines = {"technique": 0, "machinery": 0, "instruments": 0}
    for path in sorted((old_files | new_files) - {LESSON}):
        _, plus, minus = file_diff(
            path,
            earlier / path if path in old_files else None,
            later / path if path in new_files else None,
        )
        lines[kind(path, later)] += plus + minus
    return lines


def print_shares(root: Path, steps: list[Path]) -> None:
    print("| patch | changed lines | technique | machinery | instruments | technique share |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for earlier, later in pairwise(steps):
        lines = shares(root, earlier, later)
        total = sum(lines.values())
        share = f"{100 * lines['technique'] / total:.0f} %" if total else "-"
        counts = " | ".join(f"{lines[k]:,}" for k in ("technique", "machinery", "instruments"))
        print(f"| {later.name} | {total:,} | {counts} | {share} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 and list stale, missing and extra patches",
    )
    parser.add_argument(
        "--shares",
        action="store_true",
        help="write nothing; print each patch's changed lines: technique, machinery, instruments",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="repository root holding the step folders (default: %(default)s)",
    )
    args = parser.parse_args()
    root = args.root.resolve()
    patch_dir = root / PATCH_DIR

    try:
        steps = step_folders(root)
        if args.shares:
            print_shares(root, steps)
            return 0
        wanted = {
            f"{later.name}.patch": make_patch(root, earlier, later)
            for earlier, later in pairwise(steps)
        }
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    # Every patch named after a step folder is ours; a step that is gone leaves an extra one.
    on_disk = {
        p.name
        for p in (patch_dir.glob("*.patch") if patch_dir.is_dir() else [])
        if STEP_NAME.fullmatch(p.name.removesuffix(".patch"))
    }
    missing = sorted(set(wanted) - on_disk)
    extra = sorted(on_disk - set(wanted))
    stale = sorted(
        name
        for name in set(wanted) & on_disk
        if (patch_dir / name).read_bytes() != wanted[name][0].encode()
    )

    if args.check:
        for label, names in (("stale", stale), ("missing", missing), ("extra", extra)):
            for name in names:
                print(f"{label}: {PATCH_DIR}/{name}")
        if stale or missing or extra:
            print("patches are out of date: run python tools/make_patches.py", file=sys.stderr)
            return 1
        print(f"{len(wanted)} patches up to date")
        return 0

    patch_dir.mkdir(exist_ok=True)
    for name, (text, summary) in wanted.items():
        status = "written" if name in stale or name in missing else "unchanged"
        if status == "written":
            (patch_dir / name).write_bytes(text.encode())
        print(f"{PATCH_DIR}/{name}: {summary} ({status})")
    for name in extra:
        (patch_dir / name).unlink()
        print(f"{PATCH_DIR}/{name}: removed, no such step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
