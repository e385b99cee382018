"""A launcher for the tests that does what `torchrun --standalone --nproc_per_node N` (or plain
`python`) does for a script of this repository, without importing torch, transformers and datasets
again for every run: on a 2-core machine that import takes about 10 s of CPU, most of a two-step
run's.

    python tests/launch.py [--nproc_per_node N] [--python] SCRIPT ARGS...

Each of the N processes gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and runs SCRIPT as `__main__` with ARGS; `--python`
runs one process without that environment, as `python SCRIPT ARGS` does. When one exits with an
error, the others get SIGTERM at once and SIGKILL after a grace period, as torchrun does; the exit
status is the first failure's. The tests that check torchrun's own behaviour (restarts, two
launchers, its banner) use torchrun itself.

With PICO3D_LAUNCH_SERVER naming the socket of a server (`python tests/launch.py --serve PATH`,
which the tests start once), this process only hands its command line, folder, environment,
stdout and stderr to the server and waits: the server has imported the libraries once, and forks
a launcher for the request, which forks the ranks. A launcher whose client has gone (killed on a
timeout) kills its ranks. Without a server, this process imports the libraries itself, then forks.
"""

import contextlib
import json
import os
import runpy
import signal
import socket
import sys
import time

USAGE = "usage: python tests/launch.py [--nproc_per_node N] [--python] SCRIPT ARGS..."
GRACE = 30  # seconds between SIGTERM and SIGKILL for the others after a failure
SERVER = "PICO3D_LAUNCH_SERVER"


def preload():
    """What every step's train.py imports that takes long: imported once, before any fork. Some
    of it a run imports on first use, a second of CPU per rank on the 2-core machine: torch's
    compiler stack (the first initialisation on the meta device goes through it), the profiler,
    and the modules that datasets' streaming patches import when a dataset loads (scipy's, where
    it is installed). Importing starts no thread, so the forks are clean."""
    import datasets  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.profiler  # noqa: F401
    import transformers
    from transformers import AutoTokenizer, LlamaConfig  # noqa: F401  (the lazy modules, loaded)

    with contextlib.suppress(ImportError):
        import scipy.io  # noqa: F401
        import scipy.sparse  # noqa: F401
    transformers.logging.set_verbosity_error()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child(script, args, rank, world):
    if world:  # under torchrun's environment; world 0: plain python
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
        )
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    import torch

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


def usage_error(message):
    print(f"launch.py: {message}\n{USAGE}", file=sys.stderr)
    sys.exit(2)


def parse(argv):
    argv, world = list(argv), 1
    while argv and argv[0].startswith("--"):
        key, _, value = argv.pop(0).lstrip("-").partition("=")
        if key == "python":
            world = 0
            continue
        if key == "standalone":
            continue
        if key not in ("nproc_per_node", "nnodes") or not (value or argv):
            usage_error(f"unknown or incomplete flag --{key}")
        value = value or argv.pop(0)
        if key == "nproc_per_node":
            world = int(value)
        elif key == "nnodes":
            assert int(value) == 1, "launch.py starts one node"
    if not argv:
        usage_error("no script to run")
    return world, argv[0], argv[1:]


def launch(argv, client=None):
    """Fork the ranks of one command and wait for them; `client`: the server's connection, whose
    end (the client killed) kills the ranks. Returns the exit status."""
    world, script, args = parse(argv)
    if world:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(max(world, 1)):
        pid = os.fork()
        if pid == 0:
            if client is not None:
                client.close()
            child(script, args, rank, world)
        pids[pid] = rank
    status, deadline = 0, None
    while pids:
        if deadline is not None and time.monotonic() > deadline:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        if client is not None and client_gone(client):
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code  # killed by a signal: 128 + its number
            if world:  # plain python says nothing of its own
                print(f"launch.py: rank {rank} exited with {code}", file=sys.stderr, flush=True)
            for other in pids:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + GRACE
    return status


def client_gone(connection):
    try:
        return connection.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False


def serve(path):
    """Import the libraries, then fork a launcher for every request on the socket `path`."""
    preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the launchers are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # it exists once it accepts
    while True:
        connection, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
        while not message.endswith(b"\n"):
            message += connection.recv(1 << 20)
        request = json.loads(message)
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # this one waits for its ranks
            os.setsid()
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            for fd in fds:
                os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            code = 1
            try:
                code = launch(request["argv"], connection)
            finally:
                try:
                    connection.sendall(f"{code}\n".encode())
                finally:
                    os._exit(0)
        connection.close()
        for fd in fds:
            os.close(fd)


def request(path, argv):
    """Hand this command to the server and wait for its exit status."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    message = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}) + "\n"
    socket.send_fds(connection, [message.encode()], [1, 2])
    answer = b""
    while not answer.endswith(b"\n"):
        part = connection.recv(64)
        if not part:
            raise SystemExit("launch.py: the server ended without an exit status")
        answer += part
    return int(answer)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    elif os.environ.get(SERVER) and os.path.exists(os.environ[SERVER]):
        sys.exit(request(os.environ[SERVER], sys.argv[1:]))
    else:
        preload()
        sys.exit(launch(sys.argv[1:]))
