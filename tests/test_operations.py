"""Runs that survive operations: a SIGTERM stops every rank after the same step with a checkpoint;
torchrun restarts a group after a worker is killed and the run resumes; a crash mid-save leaves
the latest checkpoint whole; two launchers train as two nodes with the Slurm script's commands.
Every finished run has the losses of one uninterrupted run (step 9, 2 processes, dp 2)."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from conftest import (
    ROOT,
    TINY,
    assert_same_training,
    assert_weights_readable_as_config,
    check,
    import_step,
    read_log,
    run_step,
)

STEP = "step9_3d_parallel"
STEPS = 20
SLURM = ROOT / "tools" / "slurm" / "train.sbatch"
# torchrun shares its store with the workers unless told not to, and a restarted group of several
# nodes then reads the addresses of the dead one (the Slurm script sets the same); on one node each
# try keeps its keys apart (test_torchrun_restarts_after_a_killed_worker runs without it).
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A few hundred stories: the runs tokenise them in no time."""
    folder = tmp_path_factory.mktemp("stories")
    for split, lines in [("train", slice(0, 300)), ("validation", slice(0, 20))]:
        source = (ROOT / f"assets/datasets/tinytales/{split}.jsonl").read_text().splitlines()
        (folder / f"{split}.jsonl").write_text("\n".join(source[lines]) + "\n")
    return folder


def train_args(data, log_file, *extra):
    args = [*TINY, "--max_steps", str(STEPS), "--num_proc", "1", "--sample_tokens", "4"]
    args += ["--eval_every", "10", "--eval_steps", "2", "--dataset_name", str(data)]
    return [*args, "--log_file", str(log_file), *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """The uninterrupted run: one launcher, two processes, dp 2."""
    log_file = tmp_path_factory.mktemp("reference") / "log.jsonl"
    check(run_step(STEP, train_args(data, log_file, "--dp_size", "2"), nproc=2, env=ENV))
    return read_log(log_file)


def launch(args, nproc=2, launcher_flags=(), unset=()):
    """torchrun in the background, its output in a pipe; `unset`: variables taken out of its
    environment."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *launcher_flags]
    command += [f"--nproc_per_node={nproc}", str(ROOT / STEP / "train.py"), *args]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in {**os.environ, **ENV}.items() if k not in unset},
        cwd=ROOT,
    )


def wait_for_steps(log_file, count, process, timeout=300):
    deadline = time.monotonic() + timeout
    while not (log_file.exists() and len(log_file.read_text().splitlines()) >= count):
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, f"no {count} steps in {timeout} s"
        time.sleep(0.05)


def workers(launcher):
    return open(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read().split()


def worker(launcher, rank):
    """The pid of the launcher's worker process of global rank `rank`."""
    children = workers(launcher)
    for pid in children:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return int(pid)
    raise AssertionError(f"no worker of rank {rank} among {children}")


def finish(process, timeout=300):
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a hang: end the workers, then their launcher
        for pid in workers(process):
            os.kill(int(pid), signal.SIGKILL)
        process.kill()
        raise
    assert process.returncode == 0, output
    return output


def test_sigterm_stops_every_rank_after_one_step_and_resumes(tmp_path, data, reference):
    """Only rank 1 gets the signal (as if the cluster reached it first): rank 0 learns it from the
    agreement after the step, both stop after the same step, save it and exit with status 0."""
    save, first, second = tmp_path / "ckpt", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    extra = ["--dp_size", "2", "--save_dir", str(save), "--save_every", "100"]
    process = launch(train_args(data, first, *extra))
    wait_for_steps(first, 3, process)
    os.kill(worker(process, 1), signal.SIGTERM)
    output = finish(process)
    stopped = read_log(first)[-1]["step"]
    assert stopped < STEPS, "the run ended before the signal arrived"
    assert f"stopped by SIGTERM after step {stopped}" in output
    assert "sample:" not in output
    assert (save / "latest").read_text() == f"step_{stopped:06d}"
    result = check(run_step(STEP, train_args(data, second, *extra, "--resume"), nproc=2, env=ENV))
    assert f"resumed from {save / f'step_{stopped:06d}'} at step {stopped}" in result.stdout
    assert_same_training(read_log(first) + read_log(second), reference)


def test_torchrun_restarts_after_a_killed_worker(tmp_path, data, reference):
    """kill -9 of rank 1 mid-run: torchrun stops rank 0, starts both again, and --resume continues
    from the latest checkpoint (every 3 steps); the steps the first try logged after that
    checkpoint (none if the kill came right after a save) are trained and logged again, with the
    same numbers. torchrun shares its store with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    unset): the second try must not read the first one's addresses from it."""
    save, log_file = tmp_path / "ckpt", tmp_path / "log.jsonl"
    extra = ["--dp_size", "2", "--save_dir", str(save), "--save_every", "3", "--resume"]
    process = launch(
        train_args(data, log_file, *extra),
        launcher_flags=["--max_restarts", "2"],
        unset=["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"],
    )
    wait_for_steps(log_file, 5, process)
    os.kill(worker(process, 1), signal.SIGKILL)
    output = finish(process)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in output  # no warning on one node
    resumed = re.findall(r"resumed from \S+ at step (\d+)", output)
    assert len(resumed) == 1 and int(resumed[0]) % 3 == 0, output
    records = read_log(log_file)
    resumed_at = int(resumed[0])
    first_try, second_try = records[: resumed_at - STEPS], records[resumed_at - STEPS :]
    assert [r["step"] for r in second_try] == list(range(resumed_at + 1, STEPS + 1))
    assert [r["step"] for r in first_try] == list(range(1, len(first_try) + 1))
    assert len(first_try) >= resumed_at  # the checkpoint it resumed was the first try's
    last_of_each = {r["step"]: r for r in records}
    assert_same_training(list(last_of_each.values()), reference)
    for record in records:  # the first try of a step logged what the second logged
        assert record["loss"] == pytest.approx(last_of_each[record["step"]]["loss"], rel=1e-6)


# One rank of a try: setup_distributed as torchrun's worker, then an all-reduce over the world.
TRY = """import sys, time
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import train
time.sleep(float(sys.argv[2]))
args = train.parse_args(["--dp_size", "2", "--dist_timeout_s", "15"])
pgm, device = train.setup_distributed(args)
total = torch.ones(1)
dist.all_reduce(total)
print("sum", total.item())
dist.destroy_process_group()
"""


def test_a_restarted_try_does_not_read_the_last_ones_addresses(tmp_path):
    """The store held by the test, as torchrun's agent holds it, shared by two tries of two ranks:
    the second try's rank 1 comes 3 s late, and its rank 0 must wait for it, not connect to the
    address that the first try's rank 1 left in the store (which of two gloo ranks connects to
    the other depends on their ports: half the time the stale address goes unread)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WORLD_SIZE": "2"}
    env |= {"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    env |= {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}
    before = set()
    for count, delays in [(0, [0, 0]), (1, [0, 3])]:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", TRY, str(ROOT / STEP), str(delay)],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}
                | {"TORCHELASTIC_RESTART_COUNT": str(count)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r, delay in enumerate(delays)
        ]
        for process in ranks:
            output = process.communicate(timeout=120)[0]
            assert process.returncode == 0 and "sum 2.0" in output, (count, output)
        # What a race may hide, the keys show: this try wrote its own, under its own prefix.
        written = set(store.list_keys()) - before
        assert written and all(key.startswith(f"try{count}/") for key in written), written
        before |= written


def test_a_crash_mid_save_leaves_the_latest_checkpoint_whole(tmp_path, monkeypatch):
    train = import_step("step3_dataloader", "train")
    checkpoint, data = sys.modules["checkpoint"], sys.modules["dataloader"]
    args = train.parse_args([*TINY, "--save_dir", str(tmp_path)])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    umask = os.umask(0o027)  # a group may read: every file of a checkpoint is then 0640
    try:
        ctx = train.Context(args, torch.device("cpu"), torch.float32, pgm=None)
        model = train.build_model(ctx, train.load_config(args))
        optimizer, scheduler = train.build_optimizer(ctx, model)
        loader = data.MicroBatchDataLoader(list(range(8)), 2, 0, "cpu")
        state = train.State(model, model, optimizer, scheduler, None, loader, None)
        checkpoint.save_checkpoint(ctx, state, 1)
        write_state = checkpoint.write_state

        def dies_after_the_weights(folder, *rest):
            write_state(folder, *rest)
            raise RuntimeError("killed while saving")

        monkeypatch.setattr(checkpoint, "write_state", dies_after_the_weights)
        with pytest.raises(RuntimeError, match="killed while saving"):
            checkpoint.save_checkpoint(ctx, state, 2)
        assert (tmp_path / "latest").read_text() == "step_000001"
        assert not (tmp_path / "step_000002").exists()
        assert (tmp_path / ".step_000002.tmp" / "model.safetensors").exists()  # the half save
        assert checkpoint.load_checkpoint(ctx, state, checkpoint.latest_checkpoint(tmp_path)) == 1
        monkeypatch.undo()
        checkpoint.save_checkpoint(ctx, state, 2)  # the next save replaces the half one
        assert (tmp_path / "latest").read_text() == "step_000002"
        assert not (tmp_path / ".step_000002.tmp").exists()
        assert_weights_readable_as_config(tmp_path / "step_000002")
        modes = {path.stat().st_mode & 0o777 for path in (tmp_path / "step_000002").iterdir()}
        assert modes == {0o640}
    finally:
        os.umask(umask)
        dist.destroy_process_group()


def slurm(*args, **env):
    return subprocess.run(
        ["bash", str(SLURM), *args],
        env={**os.environ, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_slurm_script_dry_run():
    assert subprocess.run(["bash", "-n", str(SLURM)]).returncode == 0
    env = {"SLURM_JOB_NODELIST": "gpu1,gpu2,gpu3", "SLURM_JOB_ID": "77", "GPUS_PER_NODE": "8"}
    result = slurm("--max_steps", "100", TP_SIZE="8", PP_SIZE="3", **env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "node 0 (gpu1)",
        "node 1 (gpu2)",
        "node 2 (gpu3)",
    ]
    command = lines[0].split(": ", 1)[1]
    assert lines[2].split(": ", 1)[1] == command  # the same on every node
    for part in [
        "--nnodes 3 --nproc_per_node 8",
        "--rdzv_backend c10d --rdzv_endpoint gpu1:29500 --rdzv_id 77",
        "--max_restarts 3",
        f"{ROOT}/step9_3d_parallel/train.py --tp_size 8 --pp_size 3 --dp_size 1",
        "--save_dir checkpoints/pico3d --resume --max_steps 100",
    ]:
        assert part in command
    refused = slurm(TP_SIZE="5", **env)
    assert refused.returncode == 2
    assert refused.stderr == (
        "error: TP_SIZE * PP_SIZE = 5 * 1 does not divide the 3 nodes x 8 GPUs = 24 processes\n"
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_train_as_two_nodes(tmp_path, data, reference):
    """The Slurm script's two commands, run here as two nodes of two processes: tp 2 inside each
    node, dp 2 across them, a c10d rendezvous on 127.0.0.1. They train like one launcher."""
    log_file = tmp_path / "log.jsonl"
    env = {"SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1", "GPUS_PER_NODE": "2", "TP_SIZE": "2"}
    env.update(PORT=str(free_port()), SAVE_DIR=str(tmp_path / "ckpt"), SLURM_JOB_ID="two-nodes")
    env.update(TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    dry_run = slurm(*train_args(data, log_file), **env)
    assert dry_run.returncode == 0, dry_run.stderr
    commands = [shlex.split(line.split(": ", 1)[1]) for line in dry_run.stdout.splitlines()]
    assert len(commands) == 2 and "--dp_size" in commands[0]
    for i, command in enumerate(commands):  # c10d needs no node rank; the test gives one anyway
        command.insert(command.index("--nnodes"), f"--node_rank={i}")
    nodes = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
            cwd=ROOT,
        )
        for command in commands
    ]
    outputs = [finish(node) for node in nodes]
    assert_same_training(read_log(log_file), reference)
    # Each node ran one tensor-parallel group, ranks 0 and 1 or 2 and 3.
    placed = [sorted({int(r) for r in re.findall(r"rank (\d)/4: dp", out)}) for out in outputs]
    assert sorted(placed) == [[0, 1], [2, 3]], placed
    assert json.loads(log_file.read_text().splitlines()[-1])["step"] == STEPS
