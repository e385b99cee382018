"""Step 13's activation memory: the bytes autograd keeps for backward on one rank, per decoder
layer and per micro-batch, with and without sequence parallelism and in each --recompute mode,
beside the formula; and the time of one forward and backward in each mode, side by side.

    python tools/activation_memory.py                   # tp 1, 2 and 4, the tiny model
    python tools/activation_memory.py --tp 2 --seq_len 64 --micro_batch_size 2

For each tp size the ranks are started here (gloo, forked); each builds step 13's model the way
its train.py does (`build_model`), once per mode, fp32, and measures with saved-tensor hooks
(tools/memory_table.py's `SavedTensors`: each storage once, parameters left out) what the first
decoder layer's forward keeps, and what a whole micro-batch's forward keeps, the loss included.
Then it measures the peak: the most bytes held at once during a micro-batch's forward and
backward, every tensor counted (the weights, the activations, the temporaries, the gradients):
the parameters' bytes plus the most that the step's allocations held at any moment, from
torch.profiler's memory events, which record each allocation and free on the CPU as on a GPU
(there `torch.cuda.max_memory_allocated` gives the same). Then it times forward and backward
of a micro-batch in each mode, the modes alternating, repeat after repeat, and prints the median.

The formula, per layer and rank, in elements (b rows, s tokens, h hidden, F the MLP's width, a
query heads, k key/value heads, d head dim, t tp ranks; r = t with sequence parallelism, else 1):

    norms (input, 1/rms, output; two)   2 (2bsh + bs) / r
    the column-parallel layers' input   2bsh          (gathered: every token)
    attention                           bsd (2a + 2k) / t + bas / t + 2sd
                                        q, k, v, the output (o_proj's input: the same memory);
                                        log-sum-exp; cos, sin
    MLP                                 4bsF / t      (gate, silu(gate), up, their product)

--recompute selective drops the kernel's log-sum-exp, bas / t: its output is o_proj's input,
kept all the same; --recompute full keeps the layer's input only, bsh / r.

--attention math runs SDPA's unfused kernel (torch.nn.attention.sdpa_kernel), which keeps the
score-sized tensor that the fused one never stores, softmax's output (b, a / t, s, s): what
Megatron's selective recomputation drops. It also keeps its own copies of q and k (scaled by
d^-1/4 each) and of v, k and v repeated to the a / t query heads, in place of q, k, v and the
log-sum-exp; the formula column is then that kernel's:

    attention (math, none)              bsd 4a / t + bas^2 / t + 2sd
                                        the output, q, k, v (a / t heads each); softmax's output

and with selective or full recomputation the fused kernel's (what is kept is the same).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_table import SavedTensors, storage_bytes, use_step  # noqa: E402

STEP = "step13_sequence_parallel"
MODES = ["none", "selective", "full"]
MODEL_FLAGS = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads"]
MODEL_FLAGS += ["num_key_value_heads"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", default="1,2,4", help="tp sizes, comma-separated")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed micro-batches per mode")
    parser.add_argument("--attention", choices=["fused", "math"], default="fused")
    for flag in MODEL_FLAGS:
        parser.add_argument(f"--{flag}", type=int, help="instead of the tiny config's")
    args = parser.parse_args(argv)
    args.tp = [int(size) for size in args.tp.split(",")]
    return args


def step_flags(args, tp, sp, mode):
    flags = ["--tp_size", str(tp), "--recompute", mode, "--seq_len", str(args.seq_len)]
    flags += ["--micro_batch_size", str(args.micro_batch_size)]
    flags += ["--sequence_parallel"] if sp else []
    for flag in MODEL_FLAGS:
        if getattr(args, flag) is not None:
            flags += [f"--{flag}", str(getattr(args, flag))]
    return flags


def formula(config, b, s, t, sp, mode, kernel="fused"):
    """The bytes one decoder layer keeps for backward on one rank (fp32), as the docstring says,
    for SDPA's fused kernel or its math one (`kernel`, --attention)."""
    h, F, a = config.hidden_size, config.intermediate_size, config.num_attention_heads
    k = config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // a
    r = t if sp else 1
    if mode == "full":
        return 4 * b * s * h // r
    norms = 2 * (2 * b * s * h + b * s) // r
    attention = b * s * d * (2 * a + 2 * k) // t + b * a * s // t + 2 * s * d
    if mode == "selective":
        attention -= b * a * s // t
    elif kernel == "math":  # its q, k, v copies at a / t heads and the softmax's output
        attention = b * s * d * 4 * a // t + b * a * s * s // t + 2 * s * d
    return 4 * (norms + 2 * b * s * h + attention + 4 * b * s * F // t)


def measure(rank, world, args, results):
    """On each rank: {(sp, mode): (layer bytes, micro-batch bytes, seconds)}."""
    if args.attention == "math":
        with sdpa_kernel(SDPBackend.MATH):
            return measure_modes(rank, world, args, results)
    return measure_modes(rank, world, args, results)


def measure_modes(rank, world, args, results):
    import train

    from process_group_manager import ProcessGroupManager

    pgm = ProcessGroupManager(world, 1, 1, 1)
    generator = torch.Generator().manual_seed(0)
    built = {}
    for sp in [False, True] if world > 1 else [False]:
        for mode in MODES:
            flags = step_flags(args, world, sp, mode)
            run_args = train.parse_args(flags)
            ctx = train.Context(run_args, torch.device("cpu"), torch.float32, pgm)
            config = train.load_config(run_args)
            model = train.build_model(ctx, config)
            built[sp, mode] = model, train.PipelineParallel(model), config
    b, s = args.micro_batch_size, args.seq_len
    vocab = config.vocab_size
    tokens = torch.randint(0, vocab, (b, s + 1), generator=generator)
    x = torch.randn(b, s, config.hidden_size, generator=generator)
    loss_fn = lambda logits, targets: train.loss_fn(logits, targets, pgm)
    figures = {}
    for (sp, mode), (model, stage, _) in built.items():
        mine = x.chunk(world, dim=1)[rank] if sp else x  # this rank's tokens of the residual
        mine = mine.clone().requires_grad_()
        with SavedTensors(model.parameters()) as saved:
            y = model.model.layers["0"](mine)
            layer = saved.live
            y.square().sum().backward()
            saved.wait_for_release("the layer's backward")
        with SavedTensors(model.parameters()) as saved:
            loss = loss_fn(stage(tokens[:, :-1]), tokens[:, 1:])
            batch = saved.live
            loss.backward()
            saved.wait_for_release("the micro-batch's backward")
        model.zero_grad(set_to_none=True)
        run = lambda: loss_fn(stage(tokens[:, :-1]), tokens[:, 1:]).backward()  # noqa: B023
        figures[sp, mode] = [layer, batch, [], peak_bytes(run, list(model.parameters()))]
        model.zero_grad(set_to_none=True)
    for _ in range(args.repeats):  # the modes alternate: the machine's noise falls on each alike
        for (sp, mode), (model, stage, _) in built.items():
            dist.barrier()
            start = time.perf_counter()
            loss_fn(stage(tokens[:, :-1]), tokens[:, 1:]).backward()
            figures[sp, mode][2].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    median = {key: (lb, mb, statistics.median(ts), pk) for key, (lb, mb, ts, pk) in figures.items()}
    results.put((rank, median))


def peak_bytes(run, params):
    """The most bytes held at once while `run()` runs: the parameters' own, plus the most that
    the allocations made during it (each one's bytes, less those freed, in time order, from
    torch.profiler's memory events) held at any moment."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = prof.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    held = most = 0
    for _, change in changes:
        held += change
        most = max(most, held)
    return storage_bytes(params) + most


def _rank(rank, world, args, store_path, results):
    use_step(STEP)
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    measure(rank, world, args, results)
    dist.barrier()
    dist.destroy_process_group()


def run(tp, args):
    """Rank 0's figures at tp size `tp`, and the config they were measured with."""
    results = mp.get_context("fork").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_rank, (tp, args, store, results), nprocs=tp, start_method="fork")
    figures = dict(results.get() for _ in range(tp))
    return figures


def config_of(args):
    use_step(STEP)
    import train

    run_args = train.parse_args(step_flags(args, 1, False, "none"))
    return train.load_config(run_args)


def main(argv=None):
    args = parse_args(argv)
    config = config_of(args)
    b, s = args.micro_batch_size, args.seq_len
    heads = f"{config.num_attention_heads} heads ({config.num_key_value_heads} key/value)"
    print(
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, MLP "
        f"{config.intermediate_size}, {heads}, b {b}, s {s}, fp32, {args.attention} attention; "
        "bytes kept for backward on rank 0"
    )
    if args.attention == "math":
        print(
            "the formula: the math kernel's, which keeps softmax's output (b, a/t, s, s) and its "
            "own q, k, v at a/t heads, not the log-sum-exp (none); selective and full: the fused "
            "kernel's"
        )
    print(f"{'tp':>3} {'sp':>3} {'recompute':>10} {'layer':>12} {'formula':>12} "
          f"{'micro-batch':>12} {'peak':>12} {'fwd+bwd ms':>11}")  # fmt: skip
    for tp in args.tp:
        figures = run(tp, args)[0]
        base = {sp: figures[sp, "none"][2] for sp, _ in figures}
        for (sp, mode), (layer, batch, seconds, peak) in figures.items():
            want = formula(config, b, s, tp, sp, mode, args.attention)
            ratio = seconds / base[sp]
            print(
                f"{tp:>3} {'yes' if sp else 'no':>3} {mode:>10} {layer:>12,} {want:>12,} "
                f"{batch:>12,} {peak:>12,} {seconds * 1e3:>7.1f} {ratio:.2f}x"
            )


if __name__ == "__main__":
    main()
