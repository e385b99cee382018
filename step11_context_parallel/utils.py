"""Small helpers shared by the training scripts: user errors, output paths, stopping on SIGTERM,
devices, logging, seeds and throughput."""

import argparse
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
# Seconds a rank other than 0 waits before it reports a user error (see `run_main`).
REPORT_DELAY = 10
# Dense bf16 peak FLOP/s of common accelerators, matched against the device name.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, a value of the wrong type, our own checks) are
    ValueErrors, which `run_main` reports once, like every other user error."""

    def error(self, message):
        raise ValueError(f"{message} (--help lists the flags)")


def run_main(main):
    """Run `main()`; a user error prints one line, `error: ...`, and exits with status 2.

    A user error (a bad flag, size, path, config, dataset or checkpoint) is a ValueError raised by
    this folder's own code. Every rank that meets it exits with status 2, but only rank 0 prints
    it, and torchrun stops the others as soon as one rank exits. The checks see the same values on
    every rank, so rank 0 meets the same error; for one that only some ranks see (a GPU missing on
    one node), such a rank prints it after REPORT_DELAY seconds in which rank 0 has not stopped
    the group. A collective that fails because its peer is gone (it stopped on its own error)
    says so in one line, late enough for that peer's own line to come first. A ValueError raised
    inside a library, and any other exception, is a bug and keeps its traceback.
    """
    try:
        main()
    except ValueError as error:
        if Path(traceback.extract_tb(error.__traceback__)[-1].filename).resolve().parent != HERE:
            raise
        report_and_exit(f"error: {error}", 2)
    except RuntimeError as error:  # gloo's collective timeout (NCCL's watchdog reports its own)
        if "Timed out waiting" in str(error):
            report_and_exit(timed_out(error), 3)
        if not any(sign in str(error) for sign in PEER_GONE):
            raise
        # The peer that stopped first says why: this line only if it has not, after its delay.
        world = int(os.environ.get("WORLD_SIZE", 1))
        report_and_exit(lost_peer(error), 1, after=REPORT_DELAY + world)


# What gloo says when the other end of a collective went away (its process exited).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def report_and_exit(message, status, after=0):
    """Print `message` once for the job (rank 0 at once, another rank only if rank 0 has not
    stopped the job within REPORT_DELAY seconds, the lowest first; every rank `after` seconds
    later still) and exit with `status`."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's stop ends this process at once
    rank = int(os.environ.get("RANK", 0))
    time.sleep(after)
    if rank != 0:
        time.sleep(REPORT_DELAY + rank)
    print_line(message, sys.stderr)
    sys.stdout.flush()
    # At once, without the interpreter's teardown: with torch loaded it takes seconds on a
    # busy machine, and torchrun stops the other ranks only when this one has exited.
    os._exit(status)


def timed_out(error):
    """Which rank waited, and on what line of the steps' code: a collective that a stalled, dead
    or diverging rank never joined."""
    ours = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if Path(f.filename).resolve().parent == HERE
    ]
    code = ours[-1].line.split("  #")[0] if ours else ""  # the call, without its comment
    where = f" at {Path(ours[-1].filename).name}:{ours[-1].lineno}, `{code}`" if ours else ""
    rank = os.environ.get("RANK", 0)
    return (
        f"error: rank {rank} waited --dist_timeout_s for a collective that did not complete"
        f"{where}: another rank stalled, died, or is waiting in a different collective. Every "
        f"rank stops. ({str(error).splitlines()[0]})"
    )


def lost_peer(error):
    """Which rank lost its peer, and where: the other process exited (its own error, printed
    first, says why), so this collective cannot complete."""
    ours = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if Path(f.filename).resolve().parent == HERE
    ]
    where = f" at {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""
    rank = os.environ.get("RANK", 0)
    return (
        f"error: rank {rank} lost a peer in a collective{where}: another rank stopped first "
        f"(its own message says why). ({str(error).splitlines()[0]})"
    )


def check_output_path(flag, path, folder):
    """Refuse, before training rather than at the first save, an output path that cannot be
    written: `folder` says whether it must be a folder (--save_dir) or a file (--log_file)."""
    path, kind = Path(path), "folder" if folder else "file"
    if path.exists() and path.is_dir() != folder:
        other = "file" if folder else "folder"
        raise ValueError(f"{flag} {path} is an existing {other}; give a {kind} path")
    existing = next(p for p in [path, *path.parents] if p.exists())
    if existing != path and not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, so it cannot hold a {kind}")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"{flag} {path}: {existing} is not writable")


class StopSignal:
    """SIGTERM, which Slurm and Kubernetes send some seconds before they kill a job, asks the run
    to stop: the step in progress finishes, a checkpoint is saved, and the ranks exit with status 0;
    --resume continues the run exactly. The ranks may get the signal at different steps, or only
    some of them get it, so every step they agree (bookkeeping's `agree`, in the step's one
    collective) and all stop after the same step. A signal handler belongs to the process, and so
    does the flag: `StopSignal.received`."""

    received = False

    def __init__(self):
        StopSignal.received = False
        signal.signal(signal.SIGTERM, self.receive)

    @staticmethod
    def receive(signum, frame):
        StopSignal.received = True


def log(*args, all_ranks=False):
    """Print one line from rank 0 (from every rank with `all_ranks`), tagged with the rank."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        if rank != 0 and not all_ranks:
            return
        if dist.get_world_size() > 1:
            args = (f"[rank {rank}]", *args)
    print_line(" ".join(str(a) for a in args), sys.stdout)


def print_line(text, file):
    """`text` and its newline in one write, so that ranks' lines do not mix: print() writes them
    apart, and under PYTHONUNBUFFERED each write reaches the shared pipe on its own."""
    file.write(text + "\n")
    file.flush()


def resolve_device(name, local_rank=0):
    """'auto' picks CUDA when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N; got {name!r}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: PyTorch sees no GPU here; --device cpu or auto")
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: this process needs GPU {device.index}, but this machine has "
                f"{torch.cuda.device_count()} (torchrun: one per process, so --nproc_per_node at "
                f"most {torch.cuda.device_count()})"
            )
        torch.cuda.set_device(device)
    return device


def resolve_dtype(name, device):
    """The autocast dtype: bf16 on CUDA and fp32 on the CPU unless asked otherwise."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"--dtype must be one of auto, {', '.join(dtypes)}; got {name!r}")
    return dtypes[name]


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def flops_per_token(config, seq_len):
    """Training FLOPs per token: 6 N for the weights plus the attention score and value matmuls.

    N counts every weight that takes part in a matmul (the input embedding is a lookup, so it is
    left out). Each layer's attention adds 6 * 2 * T * H * d; we count the full T x T matrix, as is
    usual, although the causal mask skips half of it.
    """
    D, L, F = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    d = getattr(config, "head_dim", None) or D // config.num_attention_heads
    H, K = config.num_attention_heads, config.num_key_value_heads
    per_layer = D * H * d * 2 + D * K * d * 2 + 3 * D * F  # q, o, k, v and the MLP
    n = L * per_layer + D * config.vocab_size  # + lm_head
    return 6 * n + 12 * L * H * d * seq_len


def throughput(flops_per_second, peak):
    """One device's achieved FLOP/s, and its MFU (the fraction of its peak) when the peak is known:
    from the table above on a known GPU, or from --peak_tflops."""
    unit, scale = ("TFLOP/s", 1e12) if flops_per_second >= 1e12 else ("GFLOP/s", 1e9)
    text = f"{flops_per_second / scale:,.1f} {unit}"
    return f"{text} | mfu {100 * flops_per_second / peak:.1f}%" if peak else text


def peak_flops(device, peak_tflops=None):
    """The device's peak FLOP/s for MFU: from the flag, or known from the device's name, or None."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_FLOPS.items():
            if key in name:
                return flops
    return None
