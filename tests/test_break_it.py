"""The exercises that break finished code, as data: each edit that a lesson's "Exercises" tells the
learner to make is written out in tests/break_it/<step folder>.json (the text to find in a file of
the step, once, and what to put in its place), beside the commands the exercise runs and what they
print. The tests make each edit in a copy of the step, run the lesson's commands against it, and
check the promised outcome: the error and the ranks that print it, the figures. The lesson must
quote the edit and every figure the tests check, so the instruction and the test cannot drift
apart.

The edits live here, not in the step folders: a step folder holds only what tools/steps.py
declares, and a file in it would be carried into every later step.

An exercise's runs (`runs`), in order, in one working folder that holds the edited copy, named
like the step, and `assets` (as the repository root does for the step itself):

- `torchrun --nproc_per_node N stepK/train.py ...` or `python stepK/train.py ...`: started as
  torchrun or python would, by tests/launch.py;
- `python tools/X.py ...`: the tool, its `ROOT` the working folder, so that a tool that imports the
  step's modules (the pipeline simulator) imports the edited copy's;
- `pytest NODE`: that test of the repository against the copy (`pytest --step`).

`exit`: 0, "error" (any other status) or, for a test, "failed". `expect`: regular expressions
that must match the output (`count`: that many times), and `any`: lists of them of which one must
match whole (where the outcome is a race). An expectation's `lesson` is the text the exercise
shows for it (compared with the line breaks and indentation of the lesson as single spaces);
`quotes`: the code the exercise quotes for its edit.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCH, ROOT

sys.path.insert(0, str(ROOT / "tools"))
import exercise  # noqa: E402
from steps import step_files  # noqa: E402

DATA = ROOT / "tests" / "break_it"
LESSONS = {path.stem: json.loads(path.read_text()) for path in sorted(DATA.glob("*.json"))}
ITEM = re.compile(r"^(\d+)\. \*\*(.+?)\.?\*\*", re.MULTILINE)
# Run a tool with its ROOT the working folder (`python -c TOOL name args...`).
TOOL = (
    "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
    "tool = __import__(sys.argv[2]); tool.ROOT = Path.cwd(); "
    "sys.argv = sys.argv[2:]; sys.exit(tool.main())"
)


def flat(text):
    return " ".join(text.split())


def exercise_items(step):
    """{number: (title, text)} of the lesson's "Exercises" section, the text on one line."""
    lesson = (ROOT / LESSONS[step]["lesson"]).read_text()
    section = lesson.split("\n## Exercises\n", 1)[1].split("\n## ", 1)[0]
    found = list(ITEM.finditer(section))
    items = {}
    for match, after in zip(found, [*found[1:], None], strict=True):
        end = after.start() if after else len(section)
        items[int(match.group(1))] = (match.group(2), flat(section[match.start() : end]))
    return items


def edited(step, number, folder):
    """`folder`/step: a copy of the step with exercise `number`'s edits made; `folder`/assets."""
    [entry] = [e for e in LESSONS[step]["exercises"] if e["number"] == number]
    copy = folder / step
    for name in step_files(ROOT, ROOT / step):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / step / name, copy / name)
    for edit in entry["edits"]:
        path = copy / edit["file"]
        source = path.read_text()
        found = source.count(edit["old"])
        assert found == 1, f"{step} exercise {number}: {edit['file']} holds the text {found} times"
        path.write_text(source.replace(edit["old"], edit["new"]))
    (folder / "assets").symlink_to(ROOT / "assets", target_is_directory=True)
    return entry, copy


def run(command, folder, copy):
    """Run one of an exercise's commands in `folder`: (exit status or test outcome, output)."""
    words = shlex.split(command)
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if words[0] == "pytest":
        results, _, output = exercise.run_graded(copy, words[1:], stop_first=False)
        outcome, message = results.get(words[1], ("did not run", output[-3000:]))
        return outcome, message
    if words[0] == "torchrun":
        assert words[1] == "--nproc_per_node", command
        words = [*LAUNCH, f"--nproc_per_node={words[2]}", *words[3:]]
    elif words[1].startswith("tools/"):
        words = [sys.executable, "-c", TOOL, str(ROOT / "tools"), Path(words[1]).stem, *words[2:]]
    else:
        words = [*LAUNCH, "--python", *words[1:]]
    result = subprocess.run(
        words,
        cwd=folder,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result.returncode, result.stdout + result.stderr


def unmet(expectations, output):
    """The expectations that `output` does not meet."""
    missing = []
    for expect in expectations:
        count = len(re.findall(expect["output"], output))
        if count != expect.get("count", count or 1):
            missing.append(f"{expect['output']!r}: {count} times, not {expect.get('count', 1)}")
    return missing


def expectations(run_):
    return [*run_.get("expect", []), *(e for group in run_.get("any", []) for e in group)]


EXERCISES = [
    pytest.param(step, entry["number"], id=f"{step}-{entry['number']}")
    for step, data in LESSONS.items()
    for entry in data["exercises"]
]


def test_every_exercise_is_written_out_as_the_lesson_says():
    """Every exercise of each lesson's "Exercises" section has its entry, under its title; each
    edit's text is in the step's file once, and the edited file still parses; the lesson quotes
    the code of each edit and the text of each outcome the tests check."""
    assert LESSONS, f"no exercises in {DATA}"
    for step, data in LESSONS.items():
        assert data["lesson"] == f"{step}/README.md"
        items = exercise_items(step)
        assert sorted(items) == [e["number"] for e in data["exercises"]], (step, sorted(items))
        for entry in data["exercises"]:
            title, text = items[entry["number"]]
            where = f"{step} exercise {entry['number']}"
            assert title == entry["title"], (where, title)
            changed = {}
            for edit in entry["edits"]:
                path = edit["file"]
                source = changed.get(path, (ROOT / step / path).read_text())
                assert source.count(edit["old"]) == 1, (where, path, edit["old"])
                changed[path] = source.replace(edit["old"], edit["new"])
            for path, source in changed.items():
                compile(source, path, "exec")  # the edit leaves no `if` without a body
            assert entry["runs"], where
            quoted = [*entry["quotes"], *(e["lesson"] for r in entry["runs"] for e in
                                          expectations(r) if "lesson" in e)]  # fmt: skip
            for words in quoted:
                assert flat(words) in text, f"{where} does not quote {words!r}: {text}"
            for run_ in entry["runs"]:
                assert run_["exit"] in (0, "error", "failed"), where
                for expect in expectations(run_):
                    re.compile(expect["output"])


@pytest.mark.parametrize("step, number", EXERCISES)
def test_the_edit_does_what_the_lesson_says(tmp_path, step, number):
    """The exercise's edit, made in a copy of the step, and its commands run as the lesson shows
    them: each ends as the lesson says, and prints what it says."""
    entry, copy = edited(step, number, tmp_path)
    for run_ in entry["runs"]:
        status, output = run(run_["command"], tmp_path, copy)
        what = f"{step} exercise {number}, `{run_['command']}`"
        wanted = run_["exit"]
        ended = status == wanted or (wanted == "error" and status not in (0, "passed"))
        assert ended, f"{what}: ended with {status}, the lesson says {wanted}\n{output[-4000:]}"
        missing = unmet(run_.get("expect", []), output)
        assert not missing, f"{what}: not printed: {missing}\n{output[-4000:]}"
        alternatives = run_.get("any", [])
        if alternatives:
            met = [group for group in alternatives if not unmet(group, output)]
            assert met, f"{what}: none of the outcomes the lesson names\n{output[-4000:]}"
