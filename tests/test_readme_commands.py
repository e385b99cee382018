"""The commands the READMEs show work as printed. Every `torchrun ...`, `python stepK_*/...` and
`python tools/...` command in the code blocks of README.md and the step READMEs, and in the step
table, is checked: the script exists, its flags parse with the step's own parser, and the process
count equals tp_size x pp_size x dp_size (x cp_size). Then it runs for two steps with the process
count and every flag as written (its ranks started as torchrun starts them on one node, by
tests/launch.py), only the model shrunk to test size (TINY, with enough layers and heads for the
pipeline and tensor sizes asked) and cheap evaluation and sampling. A command of several nodes
(`--nnodes N`) runs as N torchrun launchers at once, its nodes, the rendezvous endpoint moved to
127.0.0.1 and a free port (their workers are tests/launch.py, which forks each rank): they must
meet as one world, each with a block of consecutive ranks, and save the checkpoint once. A
command marked in a comment as needing a GPU, the network or two nodes (nodes larger than this
machine) is checked but not run; so are the convergence harness's commands
(tests/test_convergence.py runs the harness) and the exercise tool's (tests/test_exercise.py runs
it). tools/README.md contributes its convergence commands; its other examples name placeholder
checkpoints. A tool that times what it measures (bench.py, activation_memory.py, data_bench.py)
runs one timed round: its agreement checks and its figures other than times are those of the
command as written (data_bench.py's shard sets are shrunk too).

The commands of one README share a working folder, in order: a command that reads a checkpoint
finds the one an earlier `--save_dir` command of the same README wrote there (one folder stands
for the nodes' shared file system). A later command with the same `--save_dir` and a larger
`--max_steps` goes on with that run: it trains two steps more, and must resume at the run's last
step and log with it, step by step, what one uninterrupted run logs (the same process grid on one
node)."""

import contextlib
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import LAUNCH, ROOT, TINY, import_step

sys.path.insert(0, str(ROOT / "tools"))
import convergence  # noqa: E402

READMES = [
    "README.md",
    *sorted(path.relative_to(ROOT).as_posix() for path in ROOT.glob("step*/README.md")),
    "tools/README.md",
]
# What a command needs that a CPU machine without a network lacks, said in a comment on its line
# or on a comment line above it.
MARKER = re.compile(r"#.*\b(needs (a|\d+) GPUs?|needs the network|two nodes)")
SCRIPT = re.compile(r"(step\d+_\w+|tools)/\w+\.py$")
SHAPE = ["num_hidden_layers", "hidden_size", "intermediate_size"]
SHAPE += ["num_attention_heads", "num_key_value_heads"]


@dataclass
class Command:
    readme: str
    line: int
    text: str
    marked: bool  # needs a GPU, the network or two nodes: checked, not run

    @property
    def tokens(self):
        return shlex.split(self.text, comments=True)

    @property
    def launcher(self):
        """torchrun's own flags as a dict (--nproc_per_node 4 -> {'nproc_per_node': '4'})."""
        if self.tokens[0] != "torchrun":
            return {}
        tokens = self.tokens[1 : self.tokens.index(self.script)]
        tokens = [part for token in tokens for part in token.split("=", 1)]  # --a=b or --a b
        return {
            key.lstrip("-"): value for key, value in zip(tokens[::2], tokens[1::2], strict=True)
        }

    @property
    def nodes(self):
        return int(self.launcher.get("nnodes", 1))

    def flag(self, name):
        """The value the command gives a flag of its script (None: not given)."""
        args = self.args
        return next((args[i + 1] for i in range(len(args) - 1) if args[i] == name), None)

    @property
    def script(self):
        return next((t for t in self.tokens if t.endswith(".py")), "")

    @property
    def args(self):
        return self.tokens[self.tokens.index(self.script) + 1 :]

    @property
    def step(self):
        return self.script.split("/")[0]

    @property
    def trains(self):
        return self.script.endswith("/train.py")

    @property
    def runs(self):
        # tests/test_exercise.py runs the exercise tool (a grade here would run the tests again).
        skipped = ("convergence.py", "exercise.py")
        return not self.marked and not self.script.endswith(skipped)

    @property
    def writes(self):
        """It reads or writes files relative to the working folder."""
        flags = ["--save_dir", "--init_from_hf", "--pp_timeline", "--dp_timeline"]
        return not self.trains or any(f in self.args for f in flags)

    def __str__(self):
        return f"{self.readme}:{self.line}: {self.text}"


def words(text, comments=False):
    """The shell words of a line; a line with an unbalanced quote (prose in a folder listing,
    "the model's shape") is split at spaces, so that a broken command still shows as one."""
    try:
        return shlex.split(text, comments=comments)
    except ValueError:
        return text.split()


def is_command(tokens, readme):
    if not tokens:
        return False
    if tokens[0] == "torchrun":
        return True
    if tokens[0] != "python" or len(tokens) < 2 or not SCRIPT.match(tokens[1]):
        return False
    # tools/README.md's other examples name checkpoints that only exist after a run of yours.
    return readme != "tools/README.md" or tokens[1] == "tools/convergence.py"


def extract(readme):
    """The commands of one README: code-block lines (with their continuations) and the inline
    code of table rows."""
    found, in_block, marked = [], False, False
    lines = (ROOT / readme).read_text().splitlines()
    number = 0
    while number < len(lines):
        line, start = lines[number].strip(), number + 1
        number += 1
        if line.startswith("```"):
            in_block, marked = not in_block, False
            continue
        if not in_block:
            if line.startswith("|"):  # the step table: inline code in a cell
                for code in re.findall(r"`([^`]+)`", line):
                    if is_command(words(code), readme):
                        found.append(Command(readme, start, code, False))
            continue
        while line.endswith("\\") and number < len(lines):
            line = line[:-1].rstrip() + " " + lines[number].strip()
            number += 1
        if line.startswith("#"):
            marked = marked or bool(MARKER.search(line))
        elif is_command(words(line, comments=True), readme):
            found.append(Command(readme, start, line, marked or bool(MARKER.search(line))))
            marked = False
    return found


COMMANDS = [command for readme in READMES for command in extract(readme)]


def by_step(command):
    """The step a command belongs to: the one it trains, or the README's (tools otherwise)."""
    if command.trains:
        return command.step
    folder = command.readme.split("/")[0]
    return folder if folder.startswith("step") else "tools"


PARAMS = [
    pytest.param(c, id=f"{by_step(c)}-{c.readme}:{c.line}")
    for c in sorted(COMMANDS, key=lambda c: (by_step(c), READMES.index(c.readme), c.line))
]


def test_the_readmes_show_commands():
    """The extraction finds what it must: the step table, continuations, the markers."""
    table = [c for c in COMMANDS if c.readme == "README.md" and c.text.startswith(("torch", "py"))]
    steps = {c.step for c in table if c.trains}
    assert len(steps) >= 9, sorted(steps)
    assert any(c.marked for c in COMMANDS) and any(c.runs for c in COMMANDS)
    assert any(c.runs and c.nodes > 1 and continued(c) for c in COMMANDS)  # README.md's corpus
    assert all("\\" not in c.text for c in COMMANDS)


def parse(command):
    """The flags parse with the step's parser, and the processes fill the grid."""
    assert (ROOT / command.script).is_file(), f"{command}\nno such script: {command.script}"
    if command.script.endswith("convergence.py"):
        try:
            _, layouts, common = convergence.parse_args(command.args)
            for layout in [convergence.baseline_layout(2), *layouts]:  # every train.py it starts
                import_step(layout.step, "train").parse_args([*common, *layout.flags])
        except SystemExit:
            pytest.fail(f"{command}\nthe flags do not parse")
        return None
    if not command.trains:
        return None
    try:
        args = import_step(command.step, "train").parse_args(command.args)
    except SystemExit:  # argparse has printed why
        pytest.fail(f"{command}\nthe flags do not parse with {command.step}/train.py")
    launcher = command.launcher
    world = int(launcher.get("nproc_per_node", 1)) * int(launcher.get("nnodes", 1))
    grid = [getattr(args, f"{axis}_size", 1) for axis in ["tp", "pp", "dp", "cp"]]
    assert world == grid[0] * grid[1] * grid[2] * grid[3], (
        f"{command}\n{world} processes for tp {grid[0]} x pp {grid[1]} x dp {grid[2]} x "
        f"cp {grid[3]}"
    )
    return args


def continued(command):
    """The earlier command of the README whose run this one goes on with, by resuming it: the
    same --save_dir and a larger --max_steps (None if there is none)."""
    if not command.trains or not command.flag("--save_dir") or not command.flag("--max_steps"):
        return None
    earlier = [
        c
        for c in COMMANDS
        if c.readme == command.readme and c.line < command.line and c.runs and c.trains
        if c.flag("--save_dir") == command.flag("--save_dir") and c.flag("--max_steps")
        if int(c.flag("--max_steps")) < int(command.flag("--max_steps"))
    ]
    return earlier[-1] if earlier else None


def steps(command):
    """Two steps (three with --profile, which records from step 3); two more than the run it
    goes on with."""
    if before := continued(command):
        return steps(before) + 2
    return 3 if "--profile" in command.args else 2


def overrides(command, args):
    """The test's number of steps, the test-size model; the flags the command gives itself are
    kept."""
    given = {token for token in command.args if token.startswith("--")}
    extra = {"--max_steps": str(steps(command)), **model_size(args)}
    if int(re.match(r"step(\d+)", command.step)[1]) >= 3:  # the data flags come with step 3
        extra.update({"--eval_steps": "1", "--sample_tokens": "4", "--num_proc": "1"})
    return [s for k, v in extra.items() if k == "--max_steps" or k not in given for s in (k, v)]


# The tools that time what they measure, side by side: their commands run with one timed round
# (the flags written after the command's own, so they win); the rest of the command, what it
# builds and checks, runs as written.
TIMED = {
    "tools/bench.py": {"--steps": "1", "--warmup": "0"},
    "tools/activation_memory.py": {"--repeats": "1"},
    "tools/data_bench.py": {"--rounds": "1", "--batches": "10", "--sizes_mb": "1,2"},
}


def model_size(args):
    """TINY, with as many layers as stages (chunks of layers) and heads as tensor-parallel
    ranks."""
    tiny = dict(zip(TINY[::2], TINY[1::2], strict=True))
    tp, pp = getattr(args, "tp_size", 1), getattr(args, "pp_size", 1)
    pp *= getattr(args, "pp_virtual_stages", 1)
    if getattr(args, "init_from_hf", None):  # the shape comes from the checkpoint (tiny here)
        return {k: v for k, v in tiny.items() if k.lstrip("-") not in SHAPE}
    tiny["--num_hidden_layers"] = str(max(2, pp))
    tiny["--num_attention_heads"] = str(max(4, tp))
    tiny["--num_key_value_heads"] = str(max(2, tp))
    return tiny


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def argv(command, args):
    script = str(ROOT / command.script)
    # --max_restarts only acts when a worker dies, which a run of the README's does not.
    flags = {k: v for k, v in command.launcher.items() if k != "max_restarts"}
    if command.nodes > 1:
        # torchrun itself on each node, the rendezvous here; its workers are tests/launch.py,
        # which forks the rank from the imported libraries, in the environment torchrun set.
        flags["rdzv_endpoint"] = f"127.0.0.1:{free_port()}"
        launcher = [f"--{key}={value}" for key, value in flags.items()]
        head = [sys.executable, "-m", "torch.distributed.run", *launcher, LAUNCH[1], "--python"]
    elif command.tokens[0] == "torchrun":
        # torchrun's start on one node, the ranks forked from one import of the libraries.
        launcher = [f"--{key}={value}" for key, value in flags.items()]
        head = [*LAUNCH, *launcher]
    else:
        head = [*LAUNCH, "--python"]  # as python runs it, forked from the same imports
    extra = overrides(command, args) if command.trains else []
    extra += [s for flag, value in TIMED.get(command.script, {}).items() for s in (flag, value)]
    return [*head, script, *command.args, *extra]


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """One working folder per README, and what already ran: {command text: result}."""
    return {"dirs": {}, "done": {}, "factory": tmp_path_factory}


def workdir(command, workdirs):
    readme = command.readme
    if readme not in workdirs["dirs"]:
        workdirs["dirs"][readme] = workdirs["factory"].mktemp(readme.replace("/", "_"))
    return workdirs["dirs"][readme]


ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@dataclass
class Nodes:
    """The launchers of a several-node command, as one result."""

    returncode: int
    outputs: list  # each launcher's stdout and stderr
    stderr = ""

    @property
    def stdout(self):
        return "".join(self.outputs)


def run_nodes(argv, nodes, cwd, timeout=600):
    """The same launcher command started `nodes` times at once; when one fails, or the time is
    up, the others are stopped (a node left alone would wait for its peers): SIGTERM, on which
    torchrun stops its workers, then SIGKILL."""
    with tempfile.TemporaryDirectory() as folder:
        files = [open(Path(folder) / f"node{i}", "w+") for i in range(nodes)]
        launchers = [
            subprocess.Popen(
                argv, cwd=cwd, env={**os.environ, **ENV}, stdout=f, stderr=subprocess.STDOUT
            )
            for f in files
        ]
        deadline, kill_at = time.monotonic() + timeout, None
        while any(launcher.poll() is None for launcher in launchers):
            failed = any(launcher.returncode for launcher in launchers)  # None while running
            if kill_at is None and (failed or time.monotonic() > deadline):
                kill_at = time.monotonic() + 30
                for launcher in launchers:
                    launcher.terminate()
            if kill_at is not None and time.monotonic() > kill_at:
                for launcher in launchers:
                    launcher.kill()
            time.sleep(0.1)
        outputs = []
        for f in files:
            f.seek(0)
            outputs.append(f.read())
            f.close()
    if time.monotonic() > deadline:
        outputs[-1] += f"\nthe launchers were stopped after {timeout} s\n"
    codes = [launcher.returncode for launcher in launchers]
    return Nodes(next((code for code in codes if code), 0), outputs)


def run(command, workdirs):
    # The same command in several READMEs runs once, unless it works with files.
    key = " ".join(command.tokens) if not command.writes else f"{command.readme}:{command.line}"
    if key in workdirs["done"]:
        return workdirs["done"][key]
    folder = workdir(command, workdirs)
    with contextlib.chdir(folder):  # paths it reads are the folder's
        args = parse(command)
    if command.nodes > 1:
        result = run_nodes(argv(command, args), command.nodes, folder)
    else:
        result = subprocess.run(
            argv(command, args),
            cwd=folder,
            env={**os.environ, **ENV},
            capture_output=True,
            text=True,
            timeout=600,
        )
    workdirs["done"][key] = result
    return result


def check_nodes(command, result, folder):
    """The launchers met as one world, each node with a block of consecutive ranks, and rank 0
    (on one of them) wrote the run's one checkpoint into the folder they share."""
    per_node = int(command.launcher.get("nproc_per_node", 1))
    world = command.nodes * per_node
    placed = [
        sorted(map(int, re.findall(rf"rank (\d+)/{world}: dp", out))) for out in result.outputs
    ]
    blocks = [list(range(i * per_node, (i + 1) * per_node)) for i in range(command.nodes)]
    assert sorted(placed) == blocks, f"{command}\nranks by node: {placed}\n{result.stdout[-4000:]}"
    save_dir = command.flag("--save_dir")
    if save_dir:
        last = f"step_{steps(command):06d}"
        saved = re.findall(r"\] saved (\S+)", result.stdout)
        assert saved == [f"{save_dir}/{last}"], f"{command}\nsaved {saved}, not once {last}"
        assert (folder / save_dir / "latest").read_text() == last, command


LOSS = re.compile(r"step (\d+)/\d+ \| loss (\S+) \| lr (\S+) \| grad_norm (\S+)")


def check_continued(command, before, output, workdirs):
    """The run resumed at the last step of the run it goes on with, and the two logged what one
    uninterrupted run of all the steps logs: the same command on one node, the same process
    grid, without --resume and --save_dir."""
    first = steps(before)
    resumed = f"resumed from {command.flag('--save_dir')}/step_{first:06d} at step {first}"
    assert resumed in output, f"{command}\nno '{resumed}'\n{output[-4000:]}"
    folder = workdir(command, workdirs)
    with contextlib.chdir(folder):
        args = parse(command)
    own = [a for a in command.args if a != "--resume"]
    del own[own.index("--save_dir") : own.index("--save_dir") + 2]
    world = command.nodes * int(command.launcher.get("nproc_per_node", 1))
    straight = subprocess.run(
        [*LAUNCH, f"--nproc_per_node={world}", str(ROOT / command.script), *own]
        + overrides(command, args),
        cwd=folder,
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert straight.returncode == 0, f"the uninterrupted run failed\n{straight.stderr[-4000:]}"
    logged = LOSS.findall(run(before, workdirs).stdout) + LOSS.findall(output)
    assert logged == LOSS.findall(straight.stdout), (
        f"{command}\nsteps logged by {before.readme}:{before.line} and this one (step, loss, lr, "
        f"grad_norm): {logged}\nby one uninterrupted run: {LOSS.findall(straight.stdout)}"
    )


@pytest.mark.parametrize("command", PARAMS)
def test_command(command, workdirs):
    if not command.runs:
        parse(command)
        return
    # What a command reads (a checkpoint, an export) was written by earlier commands of its README.
    for earlier in COMMANDS:
        if earlier.readme == command.readme and earlier.line < command.line and earlier.runs:
            if earlier.writes:
                before = run(earlier, workdirs)
                assert before.returncode == 0, f"{command}\nneeds {earlier}, which failed"
    result = run(command, workdirs)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{command}\nexit {result.returncode}\n{output[-4000:]}"
    before = continued(command)
    if command.trains and ("--resume" not in command.args or before):  # else maybe no step left
        last = steps(command)
        assert re.search(rf"step {last}/{last} \| loss", output), f"{command}\n{output[-4000:]}"
    if command.nodes > 1:
        check_nodes(command, result, workdir(command, workdirs))
    if before:
        check_continued(command, before, output, workdirs)
