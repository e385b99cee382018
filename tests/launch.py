"""A launcher for the tests that does what `torchrun --standalone --nproc_per_node N` does for a
step's train.py, but imports torch, transformers and datasets once and forks the N processes from
there. On a 2-core machine importing them takes a process about 4 s of CPU, most of a two-step
run's; eight ranks and the launcher pay it nine times under torchrun, once here.

    python tests/launch.py --nproc_per_node N [--nnodes 1] SCRIPT ARGS...

Each process gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and runs SCRIPT as `__main__` with ARGS. When one exits with an error,
the others get SIGTERM at once and SIGKILL after a grace period, as torchrun does; the exit status
is the first failure's. The tests that check torchrun's own behaviour (restarts, two launchers,
its banner) keep torchrun."""

import os
import runpy
import signal
import socket
import sys
import time

import datasets  # noqa: F401  (imported once, here, before the fork)
import safetensors.torch  # noqa: F401
import torch
import torch.distributed  # noqa: F401
import transformers
from transformers import AutoTokenizer, LlamaConfig  # noqa: F401  (the lazy modules, loaded)

GRACE = 30  # seconds between SIGTERM and SIGKILL for the others after a failure


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child(script, args, rank, world):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv):
    world, nnodes = 1, 1
    while argv and argv[0].startswith("--"):
        key, _, value = argv.pop(0).lstrip("-").partition("=")
        value = value or argv.pop(0)
        if key == "nproc_per_node":
            world = int(value)
        elif key == "nnodes":
            nnodes = int(value)
        elif key != "standalone":
            raise SystemExit(f"launch.py: unknown flag --{key}")
    assert nnodes == 1, "launch.py starts one node"
    script, args = argv[0], argv[1:]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    transformers.logging.set_verbosity_error()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            child(script, args, rank, world)
        pids[pid] = rank
    status, deadline = 0, None
    while pids:
        if deadline is not None and time.monotonic() > deadline:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        pid, wait_status = os.waitpid(-1, os.WNOHANG) if deadline else os.waitpid(-1, 0)
        if pid == 0:
            time.sleep(0.1)
            continue
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code  # killed by a signal: 128 + its number
            print(f"launch.py: rank {rank} exited with {code}", file=sys.stderr)
            for other in pids:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + GRACE
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
