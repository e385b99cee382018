"""Tests of the step tooling (tools/make_patches.py, tools/carry_forward.py) and of the steps.

The first half runs the tools on small git repositories built in tmp_path. The second half checks
the real repository: the patches are fresh, model.py is the same everywhere, each step changes only
the files it declares below, and the steps have no gaps.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))

from steps import STEPS, step_files, step_folders, step_number  # noqa: E402

# Files each step may add, modify or remove relative to the step before it (the manifest,
# tools/steps.py): every other file of the step must be byte-identical to the previous step's.
STEP_CHANGES = {step.folder: set(step.changes) for step in STEPS[1:]}

# Tool runs in temporary repositories must not depend on the user's git configuration.
GIT_ENV = {
    **os.environ,
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@example.com",
}


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", *args], cwd=repo, env=GIT_ENV, capture_output=True, text=True, check=True
    )
    return result.stdout


def run_tool(tool: str, root: Path, *args: str, env=GIT_ENV) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOLS / tool), "--root", str(root), *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode())


def make_repo(root: Path, files: dict[str, str]) -> Path:
    """A git repository holding `files`, all committed."""
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "-q")
    write(root, files)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "steps")
    return root


def tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


STEP1 = {
    "model.py": "class Model:\n    pass\n",
    "train.py": "import model\n\n\ndef main():\n    return 1",  # no final newline
    "old_helper.py": "def helper():\n    return 0\n",
    "empty.py": "",
}
STEP2 = {
    "model.py": STEP1["model.py"],
    "train.py": "import model\nimport pgm\n\n\ndef main():\n    return 2\n",
    "pgm.py": "class ProcessGroupManager:\n    pass\n",
    "sub/notes.md": "# Notes\n\nA file in a sub-folder.",
}


@pytest.fixture
def two_steps(tmp_path: Path) -> Path:
    """step1 -> step2 with a modified, an added, a removed and an empty file, and the noise
    (bytecode, ignored files, an untracked file) that must stay out of the patch."""
    files = {".gitignore": "*.log\n__pycache__/\n"}
    files |= {f"step1_model/{name}": text for name, text in STEP1.items()}
    files |= {f"step2_pgm/{name}": text for name, text in STEP2.items() if name != "pgm.py"}
    repo = make_repo(tmp_path / "repo", files)
    # Untracked but not ignored: it belongs to step 2 before it is committed.
    write(repo, {"step2_pgm/pgm.py": STEP2["pgm.py"]})
    # Ignored, or bytecode (even committed by force): never part of a step.
    write(
        repo, {"step2_pgm/run.log": "loss 1.0\n", "step2_pgm/__pycache__/pgm.cpython-311.pyc": "x"}
    )
    write(repo, {"step2_pgm/stray.pyc": "x"})
    git(repo, "add", "-f", "step2_pgm/stray.pyc")
    return repo


def expected_step2(repo: Path) -> dict[str, bytes]:
    return {name: (repo / "step2_pgm" / name).read_bytes() for name in STEP2}


# ---- make_patches.py --------------------------------------------------------------------------


def test_patch_content(two_steps: Path):
    result = run_tool("make_patches.py", two_steps)
    assert result.returncode == 0, result.stderr
    assert "patches/step2_pgm.patch: 5 files changed" in result.stdout
    text = (two_steps / "patches" / "step2_pgm.patch").read_text()
    assert text.endswith("\n")
    for noise in ("__pycache__", ".pyc", "run.log"):
        assert noise not in text
    assert "diff --git a/pgm.py b/pgm.py\nnew file mode 100644\n--- /dev/null\n" in text
    assert "deleted file mode 100644\n--- a/old_helper.py\n+++ /dev/null\n" in text
    assert "diff --git a/empty.py b/empty.py\ndeleted file mode 100644\n" in text
    # train.py had no final newline in step 1; notes.md has none in step 2.
    assert "-    return 1\n\\ No newline at end of file\n+    return 2\n" in text
    assert "+A file in a sub-folder.\n\\ No newline at end of file\ndiff --git" in text
    assert text.endswith("+    return 2\n")
    # Files in sorted order, one diff each.
    names = [line.split()[2][2:] for line in text.splitlines() if line.startswith("diff --git")]
    assert names == ["empty.py", "old_helper.py", "pgm.py", "sub/notes.md", "train.py"]


def test_patch_is_deterministic(two_steps: Path):
    assert run_tool("make_patches.py", two_steps).returncode == 0
    first = (two_steps / "patches" / "step2_pgm.patch").read_bytes()
    # Same steps, files created in another order and at another time, in another place.
    other = two_steps.parent / "other"
    shutil.copytree(two_steps, other)
    for path in sorted((other / "step2_pgm").rglob("*.py"), reverse=True):
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
    (other / "patches" / "step2_pgm.patch").unlink()
    result = run_tool("make_patches.py", other)
    assert result.returncode == 0, result.stderr
    assert (other / "patches" / "step2_pgm.patch").read_bytes() == first
    again = run_tool("make_patches.py", two_steps)
    assert "(unchanged)" in again.stdout
    assert (two_steps / "patches" / "step2_pgm.patch").read_bytes() == first


@pytest.mark.parametrize("applier", ["git apply", "patch -p1"])
def test_patch_turns_a_copy_of_the_earlier_step_into_the_later(two_steps: Path, applier: str):
    if applier == "patch -p1" and shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed")
    if applier == "patch -p1":  # GNU patch neither creates nor deletes an empty file
        (two_steps / "step1_model" / "empty.py").unlink()
    assert run_tool("make_patches.py", two_steps).returncode == 0
    patch = two_steps / "patches" / "step2_pgm.patch"
    copy = two_steps / "copy"
    shutil.copytree(two_steps / "step1_model", copy)
    if applier == "git apply":  # from the repository root, as tools/README.md says
        git(two_steps, "apply", "--directory=copy", str(patch))
    else:
        subprocess.run(
            ["patch", "-p1", "-s", "-d", str(copy), "-i", str(patch)],
            check=True,
            capture_output=True,
        )
    assert tree(copy) == expected_step2(two_steps)


def test_check_finds_stale_missing_and_extra_patches(two_steps: Path):
    patches = two_steps / "patches"
    result = run_tool("make_patches.py", two_steps, "--check")
    assert result.returncode == 1 and "missing: patches/step2_pgm.patch" in result.stdout
    assert not patches.exists(), "--check must not write"

    assert run_tool("make_patches.py", two_steps).returncode == 0
    assert run_tool("make_patches.py", two_steps, "--check").returncode == 0

    before = (patches / "step2_pgm.patch").read_bytes()
    write(two_steps, {"step2_pgm/pgm.py": "class ProcessGroupManager:\n    size = 1\n"})
    (patches / "step7_gone.patch").write_text("old\n")
    result = run_tool("make_patches.py", two_steps, "--check")
    assert result.returncode == 1
    assert "stale: patches/step2_pgm.patch" in result.stdout
    assert "extra: patches/step7_gone.patch" in result.stdout
    assert (patches / "step2_pgm.patch").read_bytes() == before, "--check must not write"

    assert run_tool("make_patches.py", two_steps).returncode == 0
    assert not (patches / "step7_gone.patch").exists()
    assert run_tool("make_patches.py", two_steps, "--check").returncode == 0


# ---- carry_forward.py -------------------------------------------------------------------------

TRAIN = "".join(f"line {i}\n" for i in range(1, 21))


@pytest.fixture
def three_steps(tmp_path: Path) -> Path:
    """train.py is the same in steps 1 and 2; step 3 appended its own lines to it."""
    return make_repo(
        tmp_path / "repo",
        {
            "step1_a/train.py": TRAIN,
            "step2_b/train.py": TRAIN,
            "step3_c/train.py": TRAIN + "step 3 addition\n",
            "step3_c/only3.py": "x = 3\n",
        },
    )


def test_carry_forward_copies_and_merges(three_steps: Path):
    fixed = TRAIN.replace("line 2\n", "line 2 fixed\n")
    write(three_steps, {"step1_a/train.py": fixed})
    result = run_tool("carry_forward.py", three_steps, "step1_a/train.py")
    assert result.returncode == 0, result.stderr
    assert "copied" in result.stdout and "merged" in result.stdout
    assert (three_steps / "step2_b/train.py").read_text() == fixed
    assert (three_steps / "step3_c/train.py").read_text() == fixed + "step 3 addition\n"
    # Carrying again finds nothing left to do.
    again = run_tool("carry_forward.py", three_steps, "--step", "1")
    assert again.returncode == 0 and "already up to date" in again.stdout


def test_carry_forward_refuses_a_conflict_and_writes_nothing(three_steps: Path):
    # Step 3 changed the same line as the fix; step 2 could take the fix, but must not either.
    write(three_steps, {"step3_c/train.py": TRAIN.replace("line 2\n", "line 2 step 3\n")})
    git(three_steps, "commit", "-qam", "step 3 edits line 2")
    write(three_steps, {"step1_a/train.py": TRAIN.replace("line 2\n", "line 2 fixed\n")})
    before = {step: tree(three_steps / step) for step in ("step2_b", "step3_c")}
    result = run_tool("carry_forward.py", three_steps, "step1_a/train.py")
    assert result.returncode == 1
    assert "step3_c/train.py" in result.stderr and "nothing was written" in result.stderr
    assert {step: tree(three_steps / step) for step in ("step2_b", "step3_c")} == before


def test_carry_forward_new_and_deleted_files_need_a_flag(three_steps: Path):
    write(three_steps, {"step2_b/new.py": "n = 1\n", "step2_b/only3.py": "x = 3\n"})
    (three_steps / "step2_b/train.py").unlink()
    # Without flags, and with --dry-run, nothing changes in step 3.
    before = tree(three_steps / "step3_c")
    result = run_tool("carry_forward.py", three_steps, "--step", "2")
    assert result.returncode == 0, result.stderr
    assert "pass --new" in result.stdout and "pass --delete" in result.stdout
    dry = run_tool("carry_forward.py", three_steps, "--step", "2", "--new", "--dry-run")
    assert dry.returncode == 0 and "new.py: created" in dry.stdout
    assert tree(three_steps / "step3_c") == before
    # --new copies new.py, and only3.py which step 3 already has is left alone.
    assert run_tool("carry_forward.py", three_steps, "--step", "2", "--new").returncode == 0
    assert (three_steps / "step3_c/new.py").read_text() == "n = 1\n"
    # Step 3's train.py differs from step 2's, so deleting it is refused.
    result = run_tool("carry_forward.py", three_steps, "--step", "2", "--delete")
    assert result.returncode == 1 and "step3_c/train.py" in result.stderr
    assert (three_steps / "step3_c/train.py").exists()


def test_steps_past_nine_are_ordered_by_number(tmp_path: Path):
    """step10 comes after step9 (not after step1, as in alphabetical order): patches and carries
    go 9 -> 10 -> 11."""
    files = {f"step{n}_s{n}/train.py": TRAIN for n in (1, 2, 9, 10, 11)}
    repo = make_repo(tmp_path / "repo", files)
    assert [step_number(step) for step in step_folders(repo)] == [1, 2, 9, 10, 11]
    write(repo, {"step9_s9/train.py": TRAIN.replace("line 2\n", "line 2 fixed\n")})
    result = run_tool("carry_forward.py", repo, "--step", "9")
    assert result.returncode == 0, result.stderr
    for n in (10, 11):
        assert "line 2 fixed" in (repo / f"step{n}_s{n}/train.py").read_text()
    assert "line 2 fixed" not in (repo / "step2_s2/train.py").read_text()
    assert run_tool("make_patches.py", repo).returncode == 0
    patches = sorted(p.name for p in (repo / "patches").iterdir())
    assert patches == [f"step{n}_s{n}.patch" for n in (10, 11, 2, 9)]  # sorted as names here
    header = (repo / "patches" / "step10_s10.patch").read_text().splitlines()[0]
    assert header.startswith("Changes from step9_s9 to step10_s10")


# ---- the real repository ----------------------------------------------------------------------


def real_steps() -> list[Path]:
    return step_folders(ROOT)


def test_steps_have_no_gaps():
    numbers = [step_number(step) for step in real_steps()]
    assert numbers == list(range(1, len(numbers) + 1)), (
        f"step folders {[s.name for s in real_steps()]}: every step needs the one before it"
    )


def test_patches_are_fresh():
    if len(real_steps()) < 2:
        pytest.skip("fewer than 2 step folders: no patches to check")
    result = run_tool("make_patches.py", ROOT, "--check", env=None)
    assert result.returncode == 0, (
        f"{result.stdout}{result.stderr}run python tools/make_patches.py and commit patches/"
    )


def test_model_identical_in_every_step():
    models = [step / "model.py" for step in real_steps() if (step / "model.py").is_file()]
    if len(models) < 2:
        pytest.skip("fewer than 2 steps have model.py")
    differ = [m.parent.name for m in models[1:] if m.read_bytes() != models[0].read_bytes()]
    assert not differ, (
        f"model.py differs from {models[0].parent.name}'s in {differ}: fix it in the earliest "
        "step and run tools/carry_forward.py"
    )


# Modules that no later step changes: byte-identical from the step that introduces them on, so
# they never show in a later patch. Run plumbing lives here, not in train.py.
FROZEN_FROM = {name: step.folder for step in STEPS for name in step.frozen}


def test_the_manifest_lists_every_step_once_in_order():
    """tools/steps.py's table is the steps on disk; what a step freezes, it adds or changes."""
    assert [step.folder for step in STEPS] == [step.name for step in real_steps()]
    for step in STEPS:
        assert set(step.frozen) <= set(step.changes), step.folder
        assert all((ROOT / step.folder / name).is_file() for name in step.changes if name), step


def test_frozen_modules_identical_from_their_step():
    steps = real_steps()
    problems = []
    for name, first in FROZEN_FROM.items():
        later = [s for s in steps if step_number(s) >= step_number(ROOT / first)]
        if not (ROOT / first / name).is_file():
            problems.append(f"{first} has no {name}")
            continue
        want = (ROOT / first / name).read_bytes()
        problems += [
            f"{s.name}/{name} differs from {first}'s (or is missing): change it there and run "
            "tools/carry_forward.py"
            for s in later
            if not (s / name).is_file() or (s / name).read_bytes() != want
        ]
    assert not problems, "\n".join(problems)


# The names a step brings in: its axis (ranks, sizes and groups carry it as prefix) and the files
# it writes. A module never names what a later step brings, so that plumbing written once (a frozen
# module) is not taught each new axis: where it must know, the step tells it (Run's `replicas`,
# the checkpoint files a step calls its own). Step 2's grid has the dp, pp and tp axes.
LATER_NAMES = {
    2: [r"\b(tp|pp|dp)_", r"tensor.parallel", r"pipeline", r"data.parallel"],
    4: [r"-of-(\d|\{)"],  # a checkpoint's shards, named after the layout
    9: [r"index\.json"],  # the checkpoint's index of slices
    10: [r"ZeRO", r"\bzero1\b"],
    11: [r"\bcp\b", r"\bcp_", r"(?i)context.?parallel"],
    12: [r"(?i)zero.?[23]\b", r"zero_stage", r"(?i)fully.?shard"],
    13: [r"(?i)sequence.?parallel", r"--recompute\b"],
    14: [r"(?i)interleaved 1F1B", r"--pp_engine interleaved", r"pp_virtual_stages"],
}
# model.py is written once, in step 1, for every step: it says why it reads head counts from
# tensor shapes (tensor parallelism) and runs any slice of its layers (pipeline parallelism).
NAMES_ALLOWED = {("model.py", 2)}


def later_names(steps):
    """{step number: the patterns of what it brings}: LATER_NAMES, the modules it adds (imported
    or named as a file), and the step itself ("step 11")."""
    names = {number: list(patterns) for number, patterns in LATER_NAMES.items()}
    seen = set()
    for step in steps:
        number, modules = step_number(step), {p.stem for p in step.glob("*.py")}
        names.setdefault(number, []).append(rf"\bsteps? {number}\b")
        for stem in sorted(modules - seen) if seen else []:
            names[number].append(rf"\b{stem}\.py\b|\bimport {stem}\b|\bfrom {stem} import\b")
        seen |= modules
    return names


def test_modules_name_nothing_of_a_later_step():
    steps, problems = real_steps(), []
    names = later_names(steps)
    for step in steps:
        for path in sorted(step.glob("*.py")):
            for line_number, line in enumerate(path.read_text().splitlines(), 1):
                problems += [
                    f"{step.name}/{path.name}:{line_number} names step {later}'s "
                    f"{re.search(pattern, line).group(0)!r}: {line.strip()}"
                    for later, patterns in names.items()
                    if later > step_number(step) and (path.name, later) not in NAMES_ALLOWED
                    for pattern in patterns
                    if re.search(pattern, line)
                ]
    assert not problems, "\n".join(problems)


def test_patches_leave_the_lessons_out():
    for patch in sorted((ROOT / "patches").glob("*.patch")):
        assert "diff --git a/README.md" not in patch.read_text(), patch.name


def test_steps_change_only_declared_files():
    steps = real_steps()
    if len(steps) < 2:
        pytest.skip("fewer than 2 step folders")
    problems = []
    for earlier, later in pairwise(steps):
        if later.name not in STEP_CHANGES:
            problems.append(
                f"{later.name} has no entry in STEP_CHANGES in {Path(__file__).name}: "
                "declare the files it may add, modify or remove"
            )
            continue
        allowed = STEP_CHANGES[later.name]
        old, new = set(step_files(ROOT, earlier)), set(step_files(ROOT, later))
        for path in sorted(old | new):
            if path in allowed:
                continue
            if path not in new:
                problems.append(f"{later.name} removes {path}, which is not declared")
            elif path not in old:
                problems.append(f"{later.name} adds {path}, which is not declared")
            elif (earlier / path).read_bytes() != (later / path).read_bytes():
                problems.append(
                    f"{later.name}/{path} differs from {earlier.name}/{path}, which is not "
                    "declared (a fix? put it in the earliest step and run carry_forward)"
                )
    assert not problems, "\n".join(problems)


def test_the_quick_tier_proves_every_step_and_the_tests_readme_lists_every_file():
    """tests/tiers.py names at least one test for each step of the manifest (conftest.py refuses a
    name that collects nothing); tests/README.md has a row for each test file."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiers

    assert set(tiers.QUICK) == {step.folder for step in STEPS} | {"tools"}
    assert all(tiers.QUICK.values())
    listed = re.findall(r"^\| \[(test_\w+\.py)\]", (ROOT / "tests" / "README.md").read_text(), re.M)
    files = sorted(path.name for path in (ROOT / "tests").glob("test_*.py"))
    assert sorted(listed) == files


# What a checkpoint may know of a step: where each parameter lives (its placement record, the
# grid's axes) and how to log; never a technique, whose knowledge reaches it through those records
# and through what train.py hands it (the layout check, the optimizer's state names).
CHECKPOINT_KNOWS = {"placement", "process_group_manager", "utils"}


def test_checkpoint_imports_no_technique_module():
    modules = {path.stem for step in step_folders(ROOT) for path in step.glob("*.py")}
    wrong = {}
    for step in step_folders(ROOT):
        path = step / "checkpoint.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        names = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        technique = sorted((names & modules) - CHECKPOINT_KNOWS)
        if technique:
            wrong[step.name] = technique
    assert not wrong, f"checkpoint.py imports technique modules: {wrong}"


def test_the_shares_of_each_patch_add_up_to_its_changed_lines():
    """`make_patches.py --shares`: a row per patch, its technique, machinery and instrument lines
    adding up to the patch's insertions and deletions; the run machinery only in step 3's."""
    result = run_tool("make_patches.py", ROOT, "--shares")
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines()[2:]]
    summaries = run_tool("make_patches.py", ROOT, "--check")
    assert summaries.returncode == 0, summaries.stdout
    steps = step_folders(ROOT)
    assert [row[0].strip() for row in rows] == [step.name for step in steps[1:]]
    number = lambda text: int(text.strip().replace(",", ""))
    for name, total, technique, machinery, instruments, _ in rows:
        assert number(technique) + number(machinery) + number(instruments) == number(total)
        assert number(machinery) == 0 or name.strip() == "step3_dataloader", name
        patch = (ROOT / "patches" / f"{name.strip()}.patch").read_text().splitlines()
        changed = sum(
            line[:1] in "+-" and not line.startswith(("+++", "---")) for line in patch if line
        )
        assert changed == number(total), name
