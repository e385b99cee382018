"""Helpers for the tests: import a step's modules, and run a step's train.py under torchrun."""

import faulthandler
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# No network here: the hub libraries fail at once instead of retrying for a minute.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import tiers  # noqa: E402
from steps import STEP_NAME, step_modules  # noqa: E402

STEP_MODULES = step_modules(ROOT)
# A model small enough for a 2-core machine; the vocabulary comes from assets/configs/tiny.
TINY = [
    "--num_hidden_layers", "2", "--hidden_size", "64", "--intermediate_size", "128",
    "--num_attention_heads", "4", "--num_key_value_heads", "2",
    "--seq_len", "32", "--micro_batch_size", "2",
]  # fmt: skip


# `pytest --step DIR tests/...` tests DIR, a copy of a step's folder with the same name
# (tools/exercise.py makes one for the learner to fill in), wherever a test would use that step's
# folder; `--step` again adds a copy of another step. An environment variable carries them, so
# that every process started from here sees them too: the ranks of `spawn` (which import this file
# afresh), a run of train.py, a pytest that a test starts. Set by hand (the folders joined by the
# path separator, ":"), the variable does what the option does. (Without a test path, write
# `--step=DIR`: pytest reads its options before it finds this file, and would take DIR alone for
# the tests to run.)
STEP_DIR = "PICO3D_STEP_DIR"


def pytest_addoption(parser):
    parser.addoption(
        "--step",
        action="append",
        metavar="DIR",
        help="test DIR, a copy of a step's folder named like it (exercises/step4_tensor_parallel), "
        "instead of that step's folder; once per step",
    )


def pytest_configure(config):
    folders = config.getoption("--step") or os.environ.get(STEP_DIR, "").split(os.pathsep)
    paths = []
    for folder in filter(None, folders):
        path = Path(folder).resolve()
        if not path.is_dir():
            raise pytest.UsageError(f"--step {folder}: no such folder")
        if not STEP_NAME.fullmatch(path.name) or not (ROOT / path.name).is_dir():
            raise pytest.UsageError(
                f"--step {folder}: the copy must be named like the step's folder it replaces "
                f"(step4_tensor_parallel, ...), not {path.name}"
            )
        if path.name in [other.name for other in paths]:
            raise pytest.UsageError(f"--step {folder}: a second copy of {path.name}")
        paths.append(path)
    if paths:
        os.environ[STEP_DIR] = os.pathsep.join(map(str, paths))


def copies():
    """The copies that --step names, by the step folder each replaces."""
    folders = filter(None, os.environ.get(STEP_DIR, "").split(os.pathsep))
    return {Path(folder).name: Path(folder) for folder in folders}


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (each starts its own launch server, and the
    runs of a layout start several ranks each). On the 2-core machine, 4 workers took longer
    than 2."""
    return max(1, min(4, os.cpu_count() or 1))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Mark the quick tier (tests/tiers.py), refusing an entry that names no collected test of a
    module that was collected; put each test in its xdist group, the heaviest groups first."""
    # Whole modules collected (no test named on the command line): each entry must name a test.
    whole = not any("::" in arg for arg in config.args)
    collected = {item.nodeid.split("::")[0] for item in items} if whole else set()
    for entry in sorted(tiers.quick_ids()):
        if entry.split("::")[0] in collected and not any(
            tiers.matches(item.nodeid, entry) for item in items
        ):
            raise pytest.UsageError(f"tests/tiers.py: the quick tier names no test {entry}")
    quick = tiers.quick_ids()
    for item in items:
        if any(tiers.matches(item.nodeid, entry) for entry in quick):
            item.add_marker(pytest.mark.quick)
        item.add_marker(pytest.mark.xdist_group(tiers.group(item)))
    if not hasattr(config, "workerinput"):  # not on xdist's workers: the order asked for
        return
    heavy = {name: rank for rank, name in enumerate(tiers.HEAVY)}
    first = {}
    for item in items:
        first.setdefault(tiers.group(item), len(first))
    # A stable sort: the tests of a group keep their order.
    items.sort(
        key=lambda item: (heavy.get(tiers.group(item), len(heavy)), first[tiers.group(item)])
    )


def pytest_report_header(config):
    return [f"{name} is tested in {path} (--step)" for name, path in copies().items()]


def step_dir(step):
    """Where the tests find step folder `step`: ROOT / step, or the copy that --step names."""
    return copies().get(step, ROOT / step)


def import_step(step, name):
    """Import module `name` of step folder `step` (the steps share module names)."""
    for module in STEP_MODULES:
        sys.modules.pop(module, None)
    folder = str(step_dir(step))
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


# What torchrun does for one node, with the libraries imported once and the ranks forked
# (tests/launch.py): a third of the CPU time of a short run. The tests of torchrun's own
# behaviour (its restarts, its report of a failure, two launchers) use torchrun itself.
LAUNCH = [sys.executable, str(ROOT / "tests" / "launch.py")]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


import convergence  # noqa: E402

convergence.TORCHRUN = LAUNCH  # the layouts of the convergence tests start the same way


@pytest.fixture(scope="session", autouse=True)
def launch_server(tmp_path_factory):
    """tests/launch.py's server: torch, transformers and datasets imported once for the session,
    every run forked from there. A pytest that a test starts (a graded run of tools/exercise.py)
    uses the server of the pytest that started it."""
    running = os.environ.get("PICO3D_LAUNCH_SERVER")
    if running and Path(running).exists():
        yield Path(running)
        return
    path = tmp_path_factory.mktemp("launch") / "server.sock"
    log = path.with_name("server.log")
    with open(log, "w") as output:
        server = subprocess.Popen(
            [*LAUNCH, "--serve", str(path)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
        )
    deadline = time.monotonic() + 300
    while not path.exists():
        assert server.poll() is None, f"the launch server ended: {log.read_text()}"
        assert time.monotonic() < deadline, "the launch server did not start in 300 s"
        time.sleep(0.1)
    os.environ["PICO3D_LAUNCH_SERVER"] = str(path)
    yield path
    del os.environ["PICO3D_LAUNCH_SERVER"]
    server.kill()
    server.wait()


def run_step(step, args, nproc=1, timeout=300, env=None, torchrun=True, fork=True, script=None):
    """Run step/train.py with `nproc` processes, as torchrun starts them (`torchrun=False`: one,
    as plain python does), forked by tests/launch.py (`fork=False`: started by torchrun or python
    themselves); returns the CompletedProcess. `script`: a launcher that runs train.py itself."""
    script = script or str(step_dir(step) / "train.py")
    if torchrun:
        command = [*(LAUNCH if fork else TORCHRUN), f"--nproc_per_node={nproc}", script, *args]
    else:
        command = [*LAUNCH, "--python"] if fork else [sys.executable]
        command = [*command, script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT
    )


def exit_here(code):
    raise SystemExit(code)  # what os._exit would end the process with


def run_in_process(step, args, capsys, monkeypatch):
    """`python step/train.py args` in this process: the exit status and what it printed."""
    train = import_step(step, "train")
    utils = sys.modules["utils"]  # the step's own, imported by train
    monkeypatch.setattr(utils.os, "_exit", exit_here)
    start = time.monotonic()
    try:
        with pytest.raises(SystemExit) as exit_info:
            utils.run_main(lambda: train.main(args))
    finally:
        if dist.is_initialized():  # refused after the group of one was made
            dist.destroy_process_group()
    elapsed = time.monotonic() - start
    printed = capsys.readouterr()
    return exit_info.value.code, printed.out + printed.err, elapsed


def assert_refused(step, args, nproc, message, capsys, monkeypatch):
    """A run that must be refused before its first step: exit status 2, `message` printed, no
    traceback. On one process, in this process (`run_in_process`: no start-up); on several, their
    ranks as torchrun starts them."""
    if nproc == 1:
        code, output, _ = run_in_process(step, args, capsys, monkeypatch)
    else:
        result = run_step(step, args, nproc=nproc)
        code, output = result.returncode, result.stdout + result.stderr
    assert code == 2, output[-2000:]
    assert message in output, output[-2000:]
    assert "Traceback" not in output
    assert "step 1/" not in output


def check(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def read_log(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def assert_matches(actual, expected, what, *, rtol, atol, reference="one device"):
    """torch.testing.assert_close, failing with what a learner looks at first: `what` (the function
    to look at, and the tensor), the first element that differs and both its values, how many
    differ, and the rank that saw it:
    `ColumnParallelLinear.forward: output[0, 3, 17] is 0.1234, one device gives 0.5678 (max |diff|
    0.8 over 12 of 2048 elements, rank 1 of 2)`."""
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as error:
        rank = ""
        if dist.is_initialized() and dist.get_world_size() > 1:
            rank = f", rank {dist.get_rank()} of {dist.get_world_size()}"
        if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
            raise AssertionError(f"{what}{rank}: {error}") from None
        if actual.shape != expected.shape:
            raise AssertionError(
                f"{what} has shape {tuple(actual.shape)}, {reference} gives "
                f"{tuple(expected.shape)}{rank}"
            ) from None
        if actual.dtype != expected.dtype:
            raise AssertionError(
                f"{what} is {actual.dtype}, {reference} gives {expected.dtype}{rank}"
            ) from None
        a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
        wrong = ~torch.isclose(a, e, rtol=rtol, atol=atol)  # assert_close's own criterion
        if not wrong.any():  # another difference (the device): assert_close's words
            raise AssertionError(f"{what}{rank}: {error}") from None
        first = tuple(int(i) for i in wrong.nonzero()[0])
        where = f"[{', '.join(map(str, first))}]" if first else ""
        diff = (a - e).abs()[wrong].max().item()
        raise AssertionError(
            f"{what}{where} is {a[first].item():.6g}, {reference} gives {e[first].item():.6g} "
            f"(max |diff| {diff:.3g} over {int(wrong.sum())} of {a.numel()} elements{rank})"
        ) from None


def assert_weights_readable_as_config(folder):
    """Every weight file in `folder` has config.json's permissions: safetensors alone creates
    its files 0600, which a colleague, or another user serving the model, cannot read."""
    mode = (Path(folder) / "config.json").stat().st_mode
    weights = sorted(Path(folder).glob("*.safetensors"))
    assert weights and all(path.stat().st_mode == mode for path in weights), [
        (path.name, oct(path.stat().st_mode)) for path in weights
    ]


def assert_same_training(records, expected):
    """Step by step, the same loss and gradient norm as the reference run. fp32 on the CPU: only
    the order of sums differs (about 1e-6). A wrong initial slice, a missing all-reduce, a
    gradient summed instead of averaged, a shard offset by one micro-batch or a pipeline loss not
    divided by the micro-batches moves them by far more within a few steps."""
    assert [r["step"] for r in records] == [r["step"] for r in expected]
    for got, want in zip(records, expected, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), got["step"]
        assert got["tokens"] == want["tokens"], got["step"]
        if "val_loss" in want:
            assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5), got["step"]


# spawn's processes start from a server process that imported torch (with its compiler stack,
# which the first initialisation on the meta device imports) and transformers and did nothing
# else: forked from pytest's own process, they would inherit a lock that one of its threads
# (gloo's, the OpenMP pool's, tqdm's monitor, left by the tests run in this process) held at that
# instant, and wait for it forever.
CLEAN_FORK = mp.get_context("forkserver")
CLEAN_FORK.set_forkserver_preload(
    ["torch", "torch._dynamo", "torch.distributed", "transformers"]
    + ["transformers.models.llama.modeling_llama"]
)


def spawn(step, fn, world, tmp_path, *args, timeout=180, tries=2):
    """Run fn(rank, world, *args) in `world` gloo processes that import `step`'s modules.
    A hang fails the test after `timeout` seconds, naming the line where each rank waits,
    instead of blocking the suite. A failed check fails at once; a process killed by a signal
    (gloo rarely aborts at process exit on this 2-core machine) is tried once more."""
    for attempt in range(tries):
        store = str(tmp_path / f"store-{time.monotonic_ns()}")
        context = mp.start_processes(
            _init_and_run,
            (str(step_dir(step)), world, store, fn, args),
            world,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    stacks = []
                    for rank, process in enumerate(context.processes):
                        if process.is_alive():  # it writes where it waits, then goes
                            os.kill(process.pid, signal.SIGUSR1)
                            time.sleep(1)
                            stack = Path(f"{store}-stack{rank}")
                            stack = stack.read_text() if stack.exists() else "(not started)\n"
                            stacks.append(f"rank {rank}:\n{stack}")
                        process.kill()
                    raise TimeoutError(
                        f"{fn.__name__} on {world} ranks took over {timeout} s; where the ranks "
                        "still running waited:\n" + "\n".join(stacks)
                    )
            return
        except mp.ProcessExitedException as error:
            if attempt == tries - 1:
                raise
            print(f"retrying {fn.__name__}: {error}", file=sys.stderr)


def _init_and_run(rank, folder, world, store_path, fn, args):
    stack = open(f"{store_path}-stack{rank}", "w")  # noqa: SIM115 (written until the process ends)
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)  # asked for on a timeout
    for module in STEP_MODULES:  # what fn imports comes from the step's folder
        sys.modules.pop(module, None)
    sys.path.insert(0, folder)
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    fn(rank, world, *args)
    dist.barrier()  # no rank tears its connections down while a peer still uses them
    dist.destroy_process_group()


def check_overlap_trace(trace, collective):
    """--dp_timeline's trace of the last step: a track for the backward (then the wait for the
    buckets) and one per bucket with its collective, launched in backward's order, the first
    during backward (whether it also ends there depends on the other ranks, late when more ranks
    than cores share the machine)."""
    events = trace["traceEvents"]
    names = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    assert names[0] == "backward" and names[1:] == [f"bucket {i}" for i in range(len(names) - 1)]
    assert len(names) > 2, names
    spans = [e for e in events if e["ph"] == "X"]
    backward, wait = (next(e for e in spans if e["cat"] == c) for c in ("backward", "wait"))
    assert backward["ts"] == 0 and backward["dur"] <= wait["ts"]
    buckets = sorted((e for e in spans if e["tid"] > 0), key=lambda e: e["tid"])
    assert [e["tid"] for e in buckets] == list(range(1, len(names)))  # one span each
    assert {e["cat"] for e in buckets} == {collective}
    assert [e["ts"] for e in buckets] == sorted(e["ts"] for e in buckets)
    assert buckets[0]["ts"] < backward["dur"]
    assert max(e["ts"] + e["dur"] for e in buckets) <= wait["ts"] + wait["dur"] + 1
