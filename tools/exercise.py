"""Write a step's technique yourself, and be graded by the tests that prove the course's own.

    python tools/exercise.py start 4 [--out DIR]    a copy of step 4 whose technique you write
    python tools/exercise.py hint COPY [NAME]       how to write NAME (the first one left)
    python tools/exercise.py grade COPY             its graded tests, smallest first
    python tools/exercise.py diff COPY              your functions against the reference's
    python tools/exercise.py restore COPY [NAME]    the reference's NAME back, or all of them

`start` copies the step's folder to COPY, `DIR/<the step's folder>` (DIR: `exercises` by default,
or a folder named like the step's, which is then the copy itself: the copy keeps the folder's
name, which is how `pytest --step COPY` knows which step it stands in for) and empties the
functions that tools/steps.py lists for the step's exercise: each keeps its signature and
docstring, the shapes its lines were commented with, and raises `NotImplementedError("write NAME:
HINT")` until you write it. Every other file is the step's, byte for byte. Where the manifest
gives a function a nudge, the hints come in two levels: HINT and the listing that `start` prints
say what the function is for, and `hint` says how to write it, only when asked; `start` and
`hint` also say each function's traps. `grade` runs the step's graded tests with
`pytest --step COPY`, in the manifest's order (each layer against its single-device reference,
then the collectives counted, then the whole layout against one device), and stops at the first
that fails, with what it says. Before a test that runs functions inside the model the step's own
plan builds (the manifest's `installed`), it runs that test on the step's code with only those of
your functions that differ from the reference's put in: a function that passes its own test
alone but fails once the model calls it (a norm's forward that calls the norm, which is itself
once installed) is named there.
"""

import argparse
import ast
import difflib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tokenize
from pathlib import Path

from steps import STEPS, step_files

ROOT = Path(__file__).resolve().parents[1]
MARK = ".exercise.json"  # what makes a folder an exercise: the step it copies
WIDTH = 100  # ruff's line length


class Refused(Exception):
    """Bad input: one line, exit status 2."""


# ---- The code: find a function, empty it, put it back ------------------------------------------


def find(tree, name, file):
    """The FunctionDef of `name` (`function` or `Class.method`) at the top of module `tree`."""
    scope, node = tree.body, None
    for part in name.split("."):
        node = next((n for n in scope if getattr(n, "name", None) == part), None)
        if node is None:
            raise Refused(f"{file} has no {name}")
        scope = node.body
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        raise Refused(f"{name} in {file} is not a function")
    return node


def parse(source, file):
    try:
        return ast.parse(source)
    except SyntaxError as error:
        raise Refused(f"{file} does not parse: {error.msg} at line {error.lineno}") from None


def body_lines(source, node):
    """The lines (1-based, inclusive) of a function's body after its docstring."""
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    if docstring and isinstance(first.value.value, str):
        return first.end_lineno + 1, node.end_lineno
    # No docstring: the body starts after the signature's colon (a comment may come first).
    lines = source.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno]
    depth = 0
    for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
        elif token.type == tokenize.OP and token.string == ":" and depth == 0:
            return node.lineno + token.end[0], node.end_lineno
    raise AssertionError(f"no colon ends the signature of {node.name}")


def shapes(text):
    """The shape comments at the end of the lines of `text` (`# (B, T, D/tp)`), each once."""
    found = []
    tokens = tokenize.generate_tokens(io.StringIO(textwrap.dedent(text)).readline)
    for token in tokens:
        trailing = token.line[: token.start[1]].strip()
        if token.type == tokenize.COMMENT and trailing and token.string.startswith("# ("):
            shape = token.string[2:].strip()
            if shape not in found:
                found.append(shape)
    return found


def first_hint(blank):
    """What `start` lists and the emptied function raises: the nudge, or the one hint."""
    return blank.nudge or blank.hint


def stub(blank, indent, shape_list):
    """What a blanked body holds: its shapes in one comment, and the raise with the hint."""
    lines = []
    if shape_list:
        label = "" if len(shape_list) == 1 else "shapes: "
        lines.append(f"{indent}# {label}{', '.join(shape_list)}\n")
    more = " (how: exercise.py hint)" if blank.nudge else ""
    message = f"write {blank.name}: {first_hint(blank)}{more}"
    one_line = f'{indent}raise NotImplementedError("{message}")\n'
    if len(one_line) <= WIDTH + 1:
        return [*lines, one_line]
    parts = textwrap.wrap(message, WIDTH - len(indent) - 6, drop_whitespace=False)
    return [
        *lines,
        f"{indent}raise NotImplementedError(\n",
        *(f'{indent}    "{part}"\n' for part in parts),
        f"{indent})\n",
    ]


def blank_out(source, blank):
    """`source` with the body of `blank.name` emptied (see stub)."""
    node = find(parse(source, blank.file), blank.name, blank.file)
    start, end = body_lines(source, node)
    lines = source.splitlines(keepends=True)
    body = "".join(lines[start - 1 : end])
    first_statement = next(n for n in node.body if n.lineno >= start)  # after the docstring
    indent = " " * first_statement.col_offset
    return "".join(lines[: start - 1] + stub(blank, indent, shapes(body)) + lines[end:])


def function_lines(source, name, file):
    """(first, last) lines of `name`'s definition, its decorators included."""
    node = find(parse(source, file), name, file)
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return first, node.end_lineno


def function_text(source, name, file):
    first, last = function_lines(source, name, file)
    return "".join(source.splitlines(keepends=True)[first - 1 : last])


def put_back(source, reference, name, file):
    """`source` with `name`'s definition replaced by the reference's."""
    first, last = function_lines(source, name, file)
    lines = source.splitlines(keepends=True)
    ours = function_text(reference, name, file)
    return "".join(lines[: first - 1]) + ours + "".join(lines[last:])


# ---- The folders -------------------------------------------------------------------------------


def step_with_exercise(number):
    steps = {step.number: step for step in STEPS}
    if number not in steps:
        raise Refused(f"there is no step {number} (steps 1 to {max(steps)})")
    if not steps[number].blanks:
        with_one = ", ".join(str(s.number) for s in STEPS if s.blanks)
        raise Refused(f"step {number} has no exercise yet (steps with one: {with_one})")
    return steps[number]


def open_copy(folder):
    """The step of the exercise in `folder`, refusing a folder that is not one."""
    if not folder.is_dir():
        raise Refused(f"{folder}: no such folder (make one with: exercise.py start STEP)")
    if not (folder / MARK).is_file():
        raise Refused(f"{folder} is not an exercise copy (no {MARK}; make one with `start`)")
    name = json.loads((folder / MARK).read_text())["step"]
    step = next((s for s in STEPS if s.folder == name), None)
    if step is None or not step.blanks:
        raise Refused(f"{folder} copies {name}, which has no exercise")
    return step


def shown(folder):
    """`folder` as the learner would type it: relative to the working folder when inside it."""
    folder = Path(os.path.abspath(folder))
    try:
        return str(folder.relative_to(Path.cwd()))
    except ValueError:
        return str(folder)


def start(number, out):
    step = step_with_exercise(number)
    folder = Path(out or "exercises")
    if folder.name != step.folder:  # the folder the copy goes in; the copy keeps the step's name
        folder = folder / step.folder
    if folder.exists():
        raise Refused(f"{folder} exists: grade it, restore it, or remove it first")
    reference = ROOT / step.folder
    for name in step_files(ROOT, reference):
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(reference / name, target)
    for file in dict.fromkeys(blank.file for blank in step.blanks):
        source = (folder / file).read_text()
        for blank in (b for b in step.blanks if b.file == file):
            source = blank_out(source, blank)
        (folder / file).write_text(source)
    (folder / MARK).write_text(json.dumps({"step": step.folder}) + "\n")
    # The step's flags.py finds the configs in the folder above its own.
    assets = folder.parent / "assets"
    if not assets.exists() and not assets.is_symlink():
        assets.symlink_to(ROOT / "assets", target_is_directory=True)

    count = len(step.blanks)
    print(f"{shown(folder)}: step {step.number}'s folder, with {count} functions to write")
    print("in this order (each raises NotImplementedError with its hint until you write it):")
    file = None
    for i, blank in enumerate(step.blanks, 1):
        if blank.file != file:
            file = blank.file
            print(f"  {file}")
        line = f"{i:5}. {blank.name}: {first_hint(blank)}"
        print(textwrap.fill(line, WIDTH, subsequent_indent=" " * 11))
        for trap in blank.traps:
            print(textwrap.fill(f"trap: {trap}", WIDTH, initial_indent=" " * 11,
                                subsequent_indent=" " * 17))  # fmt: skip
    if any(blank.nudge for blank in step.blanks):
        print(f"a hint:     python tools/exercise.py hint {shown(folder)} NAME")
    print(f"grade it:   python tools/exercise.py grade {shown(folder)}")
    print(f"your diff:  python tools/exercise.py diff {shown(folder)}")
    print(f"a function back as it was: python tools/exercise.py restore {shown(folder)} NAME")
    return 0


# ---- Grading -----------------------------------------------------------------------------------

# A pytest plugin (`-p exercise`): each test's outcome, and the message of a failure, one JSON
# object a line in the file that run_graded names in REPORT.
REPORT = "PICO3D_EXERCISE_REPORT"


def pytest_runtest_logreport(report):
    record(report, report.nodeid)


def pytest_collectreport(report):
    if report.failed:
        record(report, report.nodeid or "collection")


def record(report, nodeid):
    path = os.environ.get(REPORT)
    if not path or not (report.failed or report.when == "call"):
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr or "")
    entry = {"nodeid": nodeid, "when": report.when, "outcome": report.outcome, "message": message}
    with open(path, "a") as file:
        file.write(json.dumps(entry) + "\n")


def run_graded(folder, nodes, stop_first=True):
    """Run `nodes` against `folder` (or a list of copies of different steps) in one pytest;
    returns ({node id: (outcome, message)}, pytest's exit status, its output). A test that did
    not run is absent."""
    folders = [folder] if isinstance(folder, (str, Path)) else folder
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        # -n 0: in this process, not on the workers that pyproject.toml's addopts start.
        command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider"]
        command += ["-p", "exercise"]
        command += [arg for f in folders for arg in ("--step", str(Path(f).resolve()))]
        command += [*(["-x"] if stop_first else []), *nodes]
        path = os.pathsep.join([str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path, REPORT: str(report)}
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        results = {}
        if report.exists():
            for line in report.read_text().splitlines():
                entry = json.loads(line)
                if entry["nodeid"] not in results or entry["outcome"] == "failed":
                    outcome = "error" if entry["when"] != "call" else entry["outcome"]
                    results[entry["nodeid"]] = (outcome, entry["message"])
    return results, result.returncode, result.stdout + result.stderr


ENDS = ("Traceback", "During handling", "The above exception", "launch.py:", "[rank")


def summarize(message, folder, line_numbers=True):
    """What a failure says that a learner reads first: the error a rank raised (its rank, and the
    line of the learner's code it came from, when it is no check of the tests), or the test's own
    assertion. `line_numbers`: False where `folder` is not the learner's copy but a mix of it and
    the reference (its lines are numbered otherwise)."""
    lines = message.splitlines()
    rank = re.search(r"-- Process (\d+) terminated", message)
    rank = f"rank {rank.group(1)}: " if rank else ""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        errors = [line[1:].strip() for line in lines if line.startswith("E ")]  # pytest's own
        kept = errors[-4:] or [line for line in lines if line.strip()][:4]
        return "\n".join(kept).removeprefix("AssertionError: ")
    i, frames = starts[0] + 1, []
    while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
        frames.append(lines[i])
        i += 1
    error = []
    for line in lines[i:]:
        if not line.strip() or line.startswith(ENDS) or len(error) == 4:
            break
        error.append(line)
    text = "\n".join(error)
    if text.startswith(("AssertionError: ", "NotImplementedError: write ")):
        return text.split(": ", 1)[1]  # the same on every rank, or it names the rank
    # An error of the learner's code: where in it.
    where = str(Path(folder).resolve())
    mine = [n for n, frame in enumerate(frames) if f'File "{where}/' in frame]
    if mine:
        frame, code = frames[mine[-1]], frames[mine[-1] + 1].strip()
        file, line, function = re.search(r'File "([^"]+)", line (\d+), in (\S+)', frame).groups()
        place = f"{Path(file).name}:{line}" if line_numbers else f"{Path(file).name}, {function}"
        text += f"\n  at {place}: {code}"
    return rank + text


def report(nodes, results, output, folder):
    """Print each of `nodes`' outcome, in order, up to the first that did not pass: (how many
    passed, the node that failed or None)."""
    passed = 0
    for node in nodes:
        name = node.split("::")[-1]
        if node in results and results[node][0] == "passed":
            passed += 1
            print(f"  passed  {name}")
            continue
        if node in results:
            print(f"  FAILED  {name}")
            why = summarize(results[node][1], folder)
        else:  # it could not run: an error outside the tests (the test file's import)
            print(f"  ERROR   {name} did not run")
            others = [m for n, (o, m) in results.items() if n not in nodes and o != "passed"]
            why = summarize(others[0], folder) if others else output[-3000:]
        print(textwrap.indent(why, " " * 10))
        return passed, node
    return passed, None


def mixed_copy(folder, step, yours, into):
    """`into`/<step folder>: the learner's copy with every function of the exercise but those
    named in `yours` put back as the reference has them, and `into`/assets."""
    mixed = into / step.folder
    shutil.copytree(folder, mixed, ignore=shutil.ignore_patterns("__pycache__", MARK))
    reference = ROOT / step.folder
    for file in dict.fromkeys(b.file for b in step.blanks):
        source, theirs = (mixed / file).read_text(), (reference / file).read_text()
        for blank in (b for b in step.blanks if b.file == file and b.name not in yours):
            source = put_back(source, theirs, blank.name, file)
        (mixed / file).write_text(source)
    (into / "assets").symlink_to(ROOT / "assets", target_is_directory=True)
    return mixed


def check_installed(folder, step, node):
    """Run `node` on the step's code with only your functions installed by it (those that differ
    from the reference's) put in; when it fails, each of them alone, to name the one that fails
    once the model calls it. True when it passes (or nothing of yours is installed there)."""
    reference = ROOT / step.folder
    yours = []
    for blank in (b for b in step.blanks if b.installed == node):
        mine = function_text((folder / blank.file).read_text(), blank.name, blank.file)
        if mine != function_text((reference / blank.file).read_text(), blank.name, blank.file):
            yours.append(blank.name)
    if not yours:
        return True
    test = node.split("::")[-1]
    tries = [yours] + ([[name] for name in yours] if len(yours) > 1 else [])
    failed = None
    for names in tries:
        with tempfile.TemporaryDirectory() as tmp:
            mixed = mixed_copy(folder, step, names, Path(tmp))
            results, _, output = run_graded(mixed, [node])
            outcome, message = results.get(node, ("error", output[-3000:]))
            if outcome == "passed":
                if names is yours:
                    print(f"  passed  {test} with {', '.join(yours)} yours, the rest the step's")
                    return True
                continue
            failed = (names, summarize(message, mixed, line_numbers=False))
            if names is not yours:
                break  # the first that fails alone
    names, why = failed
    one = len(names) == 1
    print(f"  FAILED  {test} with {', '.join(names)} yours, the rest the step's")
    print(
        f"          {' and '.join(names)}: {'it passed its' if one else 'they passed their'} own "
        f"tests, and {'fails' if one else 'fail'} inside the model the step's plan builds"
    )
    print(textwrap.indent(why, " " * 10))
    return False


def grade(folder):
    step = open_copy(folder)
    nodes = step.graded
    installed = {blank.installed for blank in step.blanks if blank.installed}
    print(f"grading {shown(folder)} with step {step.number}'s tests, smallest first")
    # The graded tests in runs of one pytest each, cut before each test that functions are
    # installed in: that test first runs with only them yours.
    passed, failed, run, alone = 0, None, [], False
    for node in [*nodes, None]:
        if node is not None and node not in installed:
            run.append(node)
            continue
        if run:
            results, _, output = run_graded(folder, run)
            done, failed = report(run, results, output, folder)
            passed, run = passed + done, []
            if failed is not None:
                break
        if node is None:
            break
        if not check_installed(folder, step, node):
            failed, alone = node, True
            break
        run.append(node)
    print(f"{passed} of {len(nodes)} graded tests pass")
    if failed is not None and not alone:  # (a failure installed: no command shows it whole)
        test = f"{shown(ROOT / failed.split('::')[0])}::{failed.split('::', 1)[1]}"
        print(f"the whole report: python -m pytest --step {shown(folder)} '{test}'")
    return 0 if passed == len(nodes) else 1


# ---- Hints -------------------------------------------------------------------------------------


def hint(folder, name):
    """How to write `name`, or the first function of the exercise not written yet, and its traps."""
    step = open_copy(folder)
    names = [b.name for b in step.blanks]
    if name is not None and name not in names:
        raise Refused(
            f"{name} is not a function of step {step.number}'s exercise: {', '.join(names)}"
        )
    if name is None:
        reference = ROOT / step.folder
        for blank in step.blanks:
            mine = function_text((folder / blank.file).read_text(), blank.name, blank.file)
            emptied = blank_out((reference / blank.file).read_text(), blank)
            if mine == function_text(emptied, blank.name, blank.file):
                name = blank.name
                break
        else:
            print(f"{shown(folder)}: every function is written; name one for its hint")
            return 0
    blank = next(b for b in step.blanks if b.name == name)
    print(
        textwrap.fill(f"{blank.name} ({blank.file}): {blank.hint}", WIDTH, subsequent_indent="  ")
    )
    for trap in blank.traps:
        print(textwrap.fill(f"trap: {trap}", WIDTH, initial_indent="  ", subsequent_indent="    "))
    return 0


# ---- Diff and restore --------------------------------------------------------------------------


def diff(folder):
    step = open_copy(folder)
    reference = ROOT / step.folder
    for file in dict.fromkeys(b.file for b in step.blanks):
        mine, theirs = (folder / file).read_text(), (reference / file).read_text()
        for blank in (b for b in step.blanks if b.file == file):
            yours = function_text(mine, blank.name, file)
            ours = function_text(theirs, blank.name, file)
            if yours == ours:
                print(f"{blank.name}: as the reference")
            elif yours == function_text(blank_out(theirs, blank), blank.name, file):
                print(f"{blank.name}: not written yet")
            else:
                print(f"{blank.name}: yours differs from the reference")
                lines = difflib.unified_diff(
                    ours.splitlines(keepends=True),
                    yours.splitlines(keepends=True),
                    f"reference/{file}: {blank.name}",
                    f"yours/{file}: {blank.name}",
                )
                sys.stdout.writelines(lines)
            mine = put_back(mine, theirs, blank.name, file)
        if mine != theirs:  # what else you changed in the file
            print(f"{file}: changed outside the functions of the exercise")
            sys.stdout.writelines(
                difflib.unified_diff(
                    theirs.splitlines(keepends=True),
                    mine.splitlines(keepends=True),
                    f"reference/{file}",
                    f"yours/{file}",
                )
            )
    blanked = {b.file for b in step.blanks}
    for name in step_files(ROOT, reference):
        copy = folder / name
        same = copy.exists() and copy.read_bytes() == (reference / name).read_bytes()
        if name not in blanked and not same:
            print(f"{name}: changed (the exercise is in {', '.join(sorted(blanked))})")
    return 0


def restore(folder, name):
    step = open_copy(folder)
    names = [b.name for b in step.blanks]
    if name is not None and name not in names:
        raise Refused(
            f"{name} is not a function of step {step.number}'s exercise: {', '.join(names)}"
        )
    chosen = [b for b in step.blanks if name in (None, b.name)]
    for file in dict.fromkeys(b.file for b in chosen):
        source, reference = (folder / file).read_text(), (ROOT / step.folder / file).read_text()
        for blank in (b for b in chosen if b.file == file):
            source = put_back(source, reference, blank.name, file)
        (folder / file).write_text(source)
    print(f"{shown(folder)}: put back the reference's {', '.join(b.name for b in chosen)}")
    return 0


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    begin = commands.add_parser("start", help="copy a step with its technique to write")
    begin.add_argument("step", type=int, help="the step's number")
    begin.add_argument(
        "--out",
        help="the folder the copy goes in, as DIR/<step folder> (default: exercises); a DIR named "
        "like the step's folder is the copy itself",
    )
    for command, text in [("grade", "run the graded tests"), ("diff", "yours against ours")]:
        commands.add_parser(command, help=text).add_argument("dir", type=Path)
    more = commands.add_parser("hint", help="how to write a function, and its traps")
    more.add_argument("dir", type=Path)
    more.add_argument(
        "name", nargs="?", help="one function (Class.method); default: the first left"
    )
    back = commands.add_parser("restore", help="put the reference's functions back")
    back.add_argument("dir", type=Path)
    back.add_argument("name", nargs="?", help="one function (Class.method); default: all")
    args = parser.parse_args()
    try:
        if args.command == "start":
            return start(args.step, args.out)
        if args.command == "grade":
            return grade(args.dir)
        if args.command == "diff":
            return diff(args.dir)
        if args.command == "hint":
            return hint(args.dir, args.name)
        return restore(args.dir, args.name)
    except Refused as error:
        print(f"exercise.py: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
