"""tools/exercise.py: a step's technique written by the learner, graded by the step's own tests.

The manifest names real functions and real tests; `start` empties exactly the listed functions
(each then raises its first hint) and copies everything else byte for byte, into any folder;
the graded tests, run with `pytest --step DIR`, fail every one on the emptied copy (each on a
function's hint: the copy is what ran, in the test process, in the ranks of `spawn` and in
train.py's) and pass on the copy with the reference put back; hints come in two levels and
traps are said; the grader runs a function installed in the model, on the step's own code,
before the test of the whole model, and names a function that passes alone and fails there;
`diff` and `restore` work function by function; bad input is refused with one line and exit
status 2.
"""

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, STEP_MODULES, assert_matches

sys.path.insert(0, str(ROOT / "tools"))
import exercise  # noqa: E402
from steps import STEPS, step_entry, step_files  # noqa: E402

STEP4 = step_entry(4)
TOOL = [sys.executable, str(ROOT / "tools" / "exercise.py")]


def tool(*args, cwd=ROOT):
    return subprocess.run([*TOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def start(tmp_path, step=STEP4):
    folder = tmp_path / step.folder
    result = tool("start", str(step.number), "--out", str(folder))
    assert result.returncode == 0, result.stderr
    return folder, result.stdout


def test_the_manifest_names_real_functions_and_tests():
    """Every blank names a function of its step's own file, one that the step adds or changes,
    with a one-line hint; every graded test is a test function of its file."""
    for step in STEPS:
        assert bool(step.blanks) == bool(step.graded), step.folder
        names = [(blank.file, blank.name) for blank in step.blanks]
        assert len(set(names)) == len(names), step.folder
        for blank in step.blanks:
            assert blank.file in step.changes, (step.folder, blank.file)
            source = (ROOT / step.folder / blank.file).read_text()
            exercise.find(ast.parse(source), blank.name, blank.file)  # raises if it is not there
            for text in (blank.hint, blank.nudge, *blank.traps):
                assert "\n" not in text and '"' not in text, blank
            assert blank.hint and blank.nudge != blank.hint, blank
            # A function installed in a test is graded by its own tests first.
            assert not blank.installed or blank.installed in step.graded, blank
        if any(blank.nudge for blank in step.blanks):  # two levels for the whole exercise
            assert all(blank.nudge for blank in step.blanks), step.folder
    # Their parameters exist too: the graded runs below find every test, in the manifest's order.
    nodes = [node for step in STEPS for node in step.graded]
    assert len(set(nodes)) == len(nodes)
    for node in nodes:
        file, test = node.split("::")
        tree = ast.parse((ROOT / file).read_text())
        functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert test.split("[")[0] in functions, node


def import_copy(folder, name):
    for module in STEP_MODULES:
        sys.modules.pop(module, None)
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
        for module in STEP_MODULES:
            sys.modules.pop(module, None)


def test_start_empties_the_listed_functions_and_copies_the_rest(tmp_path):
    folder, printed = start(tmp_path)
    reference = ROOT / STEP4.folder
    blanked = {blank.file for blank in STEP4.blanks}
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*step_files(ROOT, reference), ".exercise.json"]
    )
    for name in step_files(ROOT, reference):
        if name not in blanked:
            assert (folder / name).read_bytes() == (reference / name).read_bytes(), name
    # What it says: every function, in order, with its hint, and the command that grades.
    listed = re.findall(r"^ +\d+\. ([\w.]+):", printed, re.MULTILINE)
    assert listed == [blank.name for blank in STEP4.blanks], printed
    assert f"python tools/exercise.py grade {folder}" in printed
    assert "exercise.py hint" not in printed  # step 4's hints are of one level

    for file in blanked:
        ours, theirs = (folder / file).read_text(), (reference / file).read_text()
        # Only the bodies changed: with them put back, the file is the reference, byte for byte.
        restored = ours
        for blank in (b for b in STEP4.blanks if b.file == file):
            restored = exercise.put_back(restored, theirs, blank.name, file)
        assert restored == theirs
        # The signature, the decorators and the docstring stay; the file lints but for the
        # imports that only the bodies used.
        for blank in (b for b in STEP4.blanks if b.file == file):
            mine = exercise.find(ast.parse(ours), blank.name, file)
            ref = exercise.find(ast.parse(theirs), blank.name, file)
            assert ast.dump(mine.args) == ast.dump(ref.args), blank.name
            assert [ast.dump(d) for d in mine.decorator_list] == [
                ast.dump(d) for d in ref.decorator_list
            ]
            assert ast.get_docstring(mine) == ast.get_docstring(ref), blank.name
        lint = [sys.executable, "-m", "ruff", "check", "--ignore", "F401", str(folder / file)]
        assert subprocess.run(lint, cwd=ROOT, capture_output=True).returncode == 0
        formatted = [sys.executable, "-m", "ruff", "format", "--check", str(folder / file)]
        assert subprocess.run(formatted, cwd=ROOT, capture_output=True).returncode == 0
    assert "        # (.., D) -> (.., F/tp)\n" in (folder / "tensor_parallel.py").read_text()

    # Each emptied function raises its hint at once, whatever it is given.
    tp = import_copy(folder, "tensor_parallel")
    for blank in STEP4.blanks:
        function = tp
        for part in blank.name.split("."):
            function = getattr(function, part)
        arguments = [None] * len(inspect.signature(function).parameters)
        with pytest.raises(NotImplementedError) as raised:
            function(*arguments)
        assert str(raised.value) == f"write {blank.name}: {blank.hint}"


WITH_EXERCISE = [pytest.param(step, id=step.folder) for step in STEPS if step.blanks]
# A graded run is a pytest of its own, which starts its ranks' forkserver before its first
# spawned test: a quarter of a minute on the 2-core machine even when every test fails at once
# (the emptied copies graded here share one). These steps' graded runs, emptied and put back, are
# made by hand; the suite checks their copies with test_every_exercise_starts_with_its_hints.
GRADED_BY_HAND = {2, 5, 6, 7, 8, 10, 12, 13, 14, 15}
GRADED_HERE = [param for param in WITH_EXERCISE if param.values[0].number not in GRADED_BY_HAND]
# Step 11's emptied copy is graded here (it shows that the training test runs the copy, through
# tools/convergence.py), its copy put back by hand: its graded tests take a minute.
PUT_BACK_BY_HAND = {11}


@pytest.fixture(scope="module")
def emptied(tmp_path_factory):
    """The graded tests of every step graded here, each against its step's emptied copy, in one
    pytest (one `--step` per copy: each step's tests see their own copy and the other steps' own
    folders): (results, exit status, output)."""
    tmp = tmp_path_factory.mktemp("emptied")
    steps = [param.values[0] for param in GRADED_HERE]
    folders = [start(tmp, step)[0] for step in steps]
    nodes = [node for step in steps for node in step.graded]
    return exercise.run_graded(folders, nodes, stop_first=False)


@pytest.mark.parametrize("step", GRADED_HERE)
def test_the_graded_tests_fail_every_one_on_the_emptied_copy(emptied, step):
    """Each fails, on a function's hint: the copy's code ran, not the step's, in the test
    process, in spawn's ranks and in the ranks of train.py that tests/launch.py forks."""
    results, status, output = emptied
    assert status == 1, output[-3000:]  # tests failed; none errored at collection (2, 4)
    mine = {node: result for node, result in results.items() if node in step.graded}
    assert list(mine) == list(step.graded), output[-3000:]
    for node, (outcome, message) in mine.items():
        assert outcome == "failed", (node, outcome, message[-2000:])
        assert "NotImplementedError: write " in message, (node, message[-2000:])


@pytest.mark.parametrize(
    "step", [param for param in GRADED_HERE if param.values[0].number not in PUT_BACK_BY_HAND]
)
def test_the_graded_tests_pass_on_the_copy_put_back(tmp_path, step):
    folder, _ = start(tmp_path, step)
    result = tool("restore", str(folder))
    assert result.returncode == 0, result.stderr
    for file in {blank.file for blank in step.blanks}:
        assert (folder / file).read_bytes() == (ROOT / step.folder / file).read_bytes(), file
    result = tool("grade", str(folder))
    assert result.returncode == 0, result.stdout + result.stderr
    count = len(step.graded)
    assert f"{count} of {count} graded tests pass" in result.stdout, result.stdout
    assert result.stdout.count("  passed  ") == count


@pytest.mark.parametrize("step", WITH_EXERCISE)
def test_every_exercise_starts_with_its_hints(tmp_path, step):
    """Every step's copy, in seconds: it lists its functions in the manifest's order, each with
    its first hint (the nudge where there is one, not the detail) and its traps; only their
    bodies changed (put back, each file is the step's, byte for byte); the files lint but for the
    imports only the bodies used; each emptied function raises its first hint at once."""
    folder, printed = start(tmp_path, step)
    listed = re.findall(r"^ +\d+\. ([\w.]+):", printed, re.MULTILINE)
    assert listed == [blank.name for blank in step.blanks], printed
    said = " ".join(printed.split())
    for blank in step.blanks:
        assert f"{blank.name}: {' '.join((blank.nudge or blank.hint).split())}" in said, blank
        assert not blank.nudge or " ".join(blank.hint.split()) not in said, blank.name
        for trap in blank.traps:
            assert f"trap: {' '.join(trap.split())}" in said, (blank.name, trap)
    assert ("exercise.py hint" in printed) == any(blank.nudge for blank in step.blanks)
    for file in dict.fromkeys(blank.file for blank in step.blanks):
        ours, theirs = (folder / file).read_text(), (ROOT / step.folder / file).read_text()
        blanks = [blank for blank in step.blanks if blank.file == file]
        restored = ours
        for blank in blanks:
            restored = exercise.put_back(restored, theirs, blank.name, file)
        assert restored == theirs, file
        for check in (["check", "--ignore", "F401"], ["format", "--check"]):
            ruff = [sys.executable, "-m", "ruff", *check, str(folder / file)]
            result = subprocess.run(ruff, cwd=ROOT, capture_output=True, text=True)
            assert result.returncode == 0, (check, file, result.stdout)
        module = import_copy(folder, file.removesuffix(".py"))
        for blank in blanks:
            function = module
            for part in blank.name.split("."):
                function = getattr(function, part)
            function = inspect.unwrap(function)  # its body, not what a decorator does first
            arguments = [None] * len(inspect.signature(function).parameters)
            with pytest.raises(NotImplementedError) as raised:
                function(*arguments)
            more = " (how: exercise.py hint)" if blank.nudge else ""
            assert str(raised.value) == f"write {blank.name}: {blank.nudge or blank.hint}{more}"


def test_diff_and_restore_work_function_by_function(tmp_path):
    folder, _ = start(tmp_path)
    lines = tool("diff", str(folder)).stdout.splitlines()
    assert lines == [f"{blank.name}: not written yet" for blank in STEP4.blanks]

    assert tool("restore", str(folder), "ColumnParallelLinear.forward").returncode == 0
    source = (folder / "tensor_parallel.py").read_text()
    wrong = source.replace("F.linear(x, self.weight)  #", "F.linear(x, self.weight) * 2  #")
    assert wrong != source
    (folder / "tensor_parallel.py").write_text(wrong.replace("# rows\n", "# rows!\n"))
    (folder / "model.py").write_text((folder / "model.py").read_text() + "\n")
    out = tool("diff", str(folder)).stdout
    assert "ColumnParallelLinear.forward: yours differs from the reference" in out
    assert "-        return F.linear(x, self.weight)  # (.., D) -> (.., F/tp)" in out
    assert "+        return F.linear(x, self.weight) * 2  # (.., D) -> (.., F/tp)" in out
    assert "Copy.forward: not written yet" in out
    assert "tensor_parallel.py: changed outside the functions of the exercise" in out
    assert (
        '+        place(self, "weight", Split("tp", 0, self.tp_rank, self.tp_size))  # rows!' in out
    )
    assert "model.py: changed" in out

    assert tool("restore", str(folder)).returncode == 0  # every function, not the rest
    out = tool("diff", str(folder)).stdout
    assert f"{STEP4.blanks[0].name}: as the reference" in out
    assert "yours differs" not in out and "not written yet" not in out
    assert "changed outside" in out and "model.py: changed" in out


def test_bad_input_is_refused_in_one_line(tmp_path):
    folder, _ = start(tmp_path / "a")
    with_one = ", ".join(str(step.number) for step in STEPS if step.blanks)
    refusals = {
        ("start", "99"): "there is no step 99",
        ("start", "1"): f"step 1 has no exercise yet (steps with one: {with_one})",
        ("start", "4", "--out", str(folder)): "exists",
        ("start", "4", "--out", str(folder.parent)): "exists",  # the same copy, DIR/step4_...
        ("grade", str(tmp_path / "none")): "no such folder",
        ("grade", str(ROOT / STEP4.folder)): "is not an exercise copy",
        ("diff", str(tmp_path)): "is not an exercise copy",
        ("restore", str(folder), "Column"): "Column is not a function of step 4's exercise",
        ("hint", str(folder), "Column"): "Column is not a function of step 4's exercise",
        ("hint", str(tmp_path)): "is not an exercise copy",
    }
    for args, words in refusals.items():
        result = tool(*args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert len(result.stderr.splitlines()) == 1 and words in result.stderr, (
            args,
            result.stderr,
        )


def test_a_failure_names_the_first_element_that_differs():
    expected = torch.zeros(2, 3, 4)
    actual = expected.clone()
    actual[1, 2, 1:3] = torch.tensor([0.5, -0.25])
    with pytest.raises(AssertionError) as raised:
        assert_matches(actual, expected, "ColumnParallelLinear.forward: output", rtol=0, atol=0.1)
    assert str(raised.value) == (
        "ColumnParallelLinear.forward: output[1, 2, 1] is 0.5, one device gives 0 "
        "(max |diff| 0.5 over 2 of 24 elements)"
    )
    with pytest.raises(AssertionError) as raised:
        assert_matches(actual[..., :2], expected, "x", rtol=0, atol=0.1)
    assert str(raised.value) == "x has shape (2, 3, 2), one device gives (2, 3, 4)"
    assert_matches(actual, expected + 0.5, "x", rtol=0, atol=0.8)  # within the tolerance


def test_out_is_the_folder_the_copy_goes_in(tmp_path):
    """`--out DIR` puts the copy in DIR, named like the step's folder (the name that tells
    `pytest --step` which step it stands in for), whatever DIR is called; the copy works with the
    other commands; a DIR named like the step's folder is the copy itself."""
    result = tool("start", "4", "--out", str(tmp_path / "my work"))
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "my work" / STEP4.folder
    assert (folder / exercise.MARK).is_file()
    assert result.stdout.startswith(f"{folder}: step 4's folder"), result.stdout
    assert (tmp_path / "my work" / "assets").is_symlink()  # flags.py finds the configs above
    lines = tool("diff", str(folder)).stdout.splitlines()
    assert lines == [f"{blank.name}: not written yet" for blank in STEP4.blanks]
    assert not (tmp_path / "my work" / STEP4.folder / STEP4.folder).exists()


STEP13 = step_entry(13)


def test_hint_says_how_and_the_traps(tmp_path):
    """`hint COPY NAME`: the detail the listing keeps back, and the traps; without a name, the
    first function not written yet."""
    folder, printed = start(tmp_path, STEP13)
    first, second, *_ = STEP13.blanks
    last = STEP13.blanks[-1]
    said = lambda *args: " ".join(tool("hint", str(folder), *args).stdout.split())  # noqa: E731
    assert said().startswith(f"{first.name} ({first.file}): {first.hint}")
    assert tool("restore", str(folder), first.name).returncode == 0
    assert said().startswith(f"{second.name} ({second.file}): {second.hint}")
    text = said(last.name)
    assert text.startswith(f"{last.name} ({last.file}): {last.hint}")
    assert "after keep_stage (step 7) the layers are an nn.ModuleDict" in text
    for trap in last.traps:
        assert f"trap: {' '.join(trap.split())}" in text
    assert tool("restore", str(folder)).returncode == 0
    assert said() == f"{folder}: every function is written; name one for its hint"


RECURSING = ("        return RMSNorm.forward(norm, x)\n", "        return norm.forward(x)\n")


def recursing_norm(tmp_path):
    """Step 13's copy, every function ours but norm_forward, which calls the norm: right alone,
    and once installed as every norm's forward, a call of itself."""
    folder, _ = start(tmp_path, STEP13)
    assert tool("restore", str(folder)).returncode == 0
    path = folder / "sequence_parallel.py"
    source = path.read_text()
    assert source.count(RECURSING[0]) == 1
    path.write_text(source.replace(*RECURSING))
    return folder


def test_the_grader_runs_installed_functions_before_the_model_test(tmp_path, monkeypatch, capsys):
    """The order of a grading, its pytest runs faked: the tests before the model's on the copy;
    then the model's on the step's code with only the copy's functions installed there that
    differ from ours (norm_forward), which fails; grading stops there and names it."""
    folder = recursing_norm(tmp_path)
    installed = {blank.installed for blank in STEP13.blanks if blank.installed}
    model = next(n for n in STEP13.graded if n.endswith("-model]"))
    assert model in installed
    runs = []

    def run_graded(copy, nodes, stop_first=True):
        copy = Path(copy)
        runs.append((copy, list(nodes), (copy / "sequence_parallel.py").read_text()))
        if copy == folder:
            return {node: ("passed", "") for node in nodes}, 0, ""
        error = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    f()\n'
        return {nodes[0]: ("failed", error + "RecursionError: maximum recursion depth")}, 1, ""

    monkeypatch.setattr(exercise, "run_graded", run_graded)
    assert exercise.grade(folder) == 1
    printed = capsys.readouterr().out
    before = STEP13.graded[: STEP13.graded.index(model)]
    assert [nodes for _, nodes, _ in runs] == [list(before), [model]]
    mixed, _, source = runs[1]
    assert mixed != folder and mixed.name == STEP13.folder
    reference = (ROOT / STEP13.folder / "sequence_parallel.py").read_text()
    mine = (folder / "sequence_parallel.py").read_text()
    for blank in (b for b in STEP13.blanks if b.file == "sequence_parallel.py"):
        want = mine if blank.name == "norm_forward" else reference
        assert exercise.function_text(source, blank.name, blank.file) == exercise.function_text(
            want, blank.name, blank.file
        ), blank.name
    name = model.split("::")[1]
    assert f"  FAILED  {name} with norm_forward yours, the rest the step's" in printed, printed
    assert "RecursionError: maximum recursion depth" in printed
    assert f"{len(before)} of {len(STEP13.graded)} graded tests pass" in printed
    assert "the whole report" not in printed


def test_a_norm_forward_that_recurses_once_installed_fails_the_model_test(tmp_path, capsys):
    """For real: norm_forward calling `norm.forward(x)` passes the norm's own test (it calls the
    function on a norm whose forward is still RMSNorm's); on the step's code around it, the
    model's test fails with the recursion, and names the function. Without a function of its own
    there, nothing runs."""
    folder = recursing_norm(tmp_path)
    model = next(n for n in STEP13.graded if n.endswith("-model]"))
    norm = next(n for n in STEP13.graded if n.endswith("-norm]"))
    results, _, output = exercise.run_graded(folder, [norm])
    assert results[norm][0] == "passed", output[-3000:]
    assert not exercise.check_installed(folder, STEP13, model)
    printed = capsys.readouterr().out
    assert "with norm_forward yours, the rest the step's" in printed, printed
    assert "RecursionError" in printed and "at sequence_parallel.py, norm_forward" in printed
    assert tool("restore", str(folder), "norm_forward").returncode == 0
    assert exercise.check_installed(folder, STEP13, model)  # every function ours: no run
    assert capsys.readouterr().out == ""
