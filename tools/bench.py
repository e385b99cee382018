"""Our implementations side by side with PyTorch's own, checked to agree, timed in turn.

Our model, its KV cache, data, tensor and pipeline parallelism, ZeRO-1, ring attention,
sequence parallelism, interleaved 1F1B and ZB-H1 against transformers' Llama (and its generate),
DistributedDataParallel, DTensor, torch.distributed.pipelining (Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble), ZeroRedundancyOptimizer and FSDP2,
PyTorch's ring function and DTensor's SequenceParallel plan.

    python tools/bench.py                       # all but cp, the tiny model
    python tools/bench.py --parts pp --steps 30 --micro_batches 8
    python tools/bench.py --parts cp --seq_len 4096 --micro_batch_size 1 --steps 10

The cp part times one attention's forward and backward (the model's heads and head dim, a batch
of --micro_batch_size sequences of --seq_len tokens split over 2 ranks); it is not in the default
set, whose short sequences say little about it.

Each comparison starts both sides from the same weights, runs one training step of each and checks
that they agree (gradients, or the losses of every step for DTensor), then times their steps in
turn, rotating which goes first, and prints the median of each and the ratio ours / theirs, of
the wall-clock time and of the CPU time (the slowest rank's), which other jobs on the machine move
less. The multi-process parts spawn their own ranks (gloo on the CPU, NCCL when there are enough
GPUs).
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_parts  # noqa: E402
from steps import STEPS  # noqa: E402

WORLD = {part: nproc for step in STEPS for part, nproc in step.bench.items()}  # processes


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parts = "model,kv_cache,dp,tp,pp,zero,zero3,sp,interleaved,zb1,ep"
    parser.add_argument("--parts", default=parts, help="which, in order (or cp)")
    parser.add_argument("--model_name", default="tiny", help="a config in assets/configs")
    for name in bench_parts.OVERRIDES:
        parser.add_argument(f"--{name}", type=int, help="override the config's value")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--micro_batch_size", type=int, default=2)
    parser.add_argument("--micro_batches", type=int, default=8, help="per step, the whole batch")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in WORLD]
    if unknown:
        parser.error(f"--parts: unknown {','.join(unknown)}; choose from {','.join(WORLD)}")
    if "sp" in parts and args.seq_len % WORLD["sp"]:
        parser.error(f"--seq_len must be a multiple of tp = {WORLD['sp']} for sp (each rank its "
                     f"part of the sequence), got {args.seq_len}")  # fmt: skip
    cp = WORLD["cp"]
    if "cp" in parts and args.seq_len % (2 * cp):
        parser.error(f"--seq_len must be a multiple of 2 * cp = {2 * cp} for cp (two chunks per "
                     f"rank), got {args.seq_len}")  # fmt: skip
    if args.micro_batches % 2:
        parser.error(f"--micro_batches must be even (dp 2 splits them), got {args.micro_batches}")
    for name in ["seq_len", "micro_batch_size", "micro_batches", "steps", "threads"]:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    args.parts = parts
    return args


def device_for(args, world):
    """CUDA when asked for (or auto) and there is a GPU per rank; else the CPU."""
    wanted = args.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.device_count() >= world else "cpu"
    return wanted


def worker(rank, world, parts, args, store_path, out_path):
    torch.set_num_threads(args.threads)
    device = torch.device(device_for(args, world))
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, device_id=None)
    rows = {part: bench_parts.PARTS[part](args, device) for part in parts}  # one after the other
    if rank == 0:
        torch.save(rows, out_path)
    dist.barrier()  # no rank tears its connections down while a peer still uses them
    dist.destroy_process_group()


def spawn(parts, args, world, timeout):
    """Run `parts`, one after the other, on `world` new ranks (started once for all of them: each
    start imports torch and transformers again); rank 0's rows, {part: rows}. A hang is killed
    after `timeout` s per part."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "rows.pt")
        context = mp.spawn(worker, (world, parts, args, store, out), nprocs=world, join=False)
        deadline = time.monotonic() + timeout * len(parts)
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(
                    f"bench parts {','.join(parts)} on {world} ranks took over "
                    f"{timeout * len(parts)} s"
                )
        return torch.load(out)


def run_parts(parts, args, timeout=3600):
    """The rows of comparisons that run on the same number of ranks, {part: rows}: in this
    process for one device, else in spawned ranks."""
    world = WORLD[parts[0]]
    if world == 1:
        torch.set_num_threads(args.threads)
        device = torch.device(device_for(args, 1))
        found = {part: bench_parts.PARTS[part](args, device) for part in parts}
    else:
        found = spawn(parts, args, world, timeout)
    for rows in found.values():
        for row in rows:
            row["device"] = device_for(args, world)
            row["ok"] = all(value <= tolerance for _, value, tolerance in row["checks"])
    return found


def machine():
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    text = f"{cpu}, {os.cpu_count()} cores; torch {torch.__version__}"
    text += f", transformers {transformers.__version__}"
    if torch.cuda.is_available():
        text += f"; {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return text


def table(rows):
    lines = [
        "| comparison | ours | theirs | device | ours ms | theirs ms | ours / theirs "
        "| CPU time ours / theirs | agreement |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        checks = ", ".join(f"max rel Δ{what} {value:.1e}" for what, value, _ in r["checks"])
        ratio, cpu = r["ours_ms"] / r["theirs_ms"], r["ours_cpu_ms"] / r["theirs_cpu_ms"]
        lines.append(
            f"| {r['part']} | {r['ours']} | {r['theirs']} | {r['device']} | {r['ours_ms']:.1f} "
            f"| {r['theirs_ms']:.1f} | {ratio:.2f} | {cpu:.2f} "
            f"| {checks}{'' if r['ok'] else ' FAILED'} |"
        )
    return "\n".join(lines)


def measure(args, timeout=3600):
    """Every part's rows, in the order of --parts; consecutive parts on the same number of ranks
    share one start of the ranks."""
    rows, runs = [], []
    for part in args.parts:
        if runs and WORLD[runs[-1][0]] == WORLD[part]:
            runs[-1].append(part)
        else:
            runs.append([part])
    for parts in runs:
        for part, found in run_parts(parts, args, timeout).items():
            rows += found
            print(f"{part}: done", file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    rows = measure(args)
    config = bench_parts.load_config(args)
    batch = f"{args.micro_batch_size} x {args.seq_len} tokens"
    if args.parts != ["cp"]:  # the cp part times one attention of --micro_batch_size sequences
        batch = f"{args.micro_batches} micro-batches x {batch}"
    print(
        f"{args.model_name} model: {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, vocab {config.vocab_size}, fp32; batch {batch}; median of "
        f"{args.steps} steps after {args.warmup} warm-up, sides alternating\n"
        f"on {machine()}, {args.threads} thread(s) per process\n"
    )
    print(table(rows))
    failed = [f"{r['part']} {r['ours']}" for r in rows if not r["ok"]]
    if failed:
        print(f"\nDISAGREEMENT: {', '.join(failed)} (over the tolerance)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
