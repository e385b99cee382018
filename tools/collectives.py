"""The collectives the course uses, on a few gloo ranks: what each one does, and what it costs.

    torchrun --nproc_per_node 4 tools/collectives.py
    python tools/collectives.py --nproc 4        # the same; it starts its own ranks

Each rank r holds a small int64 tensor x_r with x_r[i] = (i + 1) * 10^r, so that every digit of a
sum is one rank's contribution. Rank 0 prints each collective's tensors before and after, on every
rank, made by torch.distributed's own call: all-reduce, reduce-scatter, all-gather, broadcast,
send/receive. Then it does each one again as a ring of send/receive, the way NCCL and gloo do for
large tensors, counting the bytes each rank sends; checks that the ring gives torch's result; and
prints the bytes per rank beside the ring's formula. An all-reduce is a reduce-scatter followed by
an all-gather (step 10's ZeRO relies on it): the demo shows both the tensors and the bytes.
"""

# n ranks, N the bytes of the whole tensor

import argparse
import os
import sys
import tempfile
import textwrap
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


### begin Ring
class Ring:
    """The ranks in a circle: each sends to the next and receives from the previous, and counts
    the bytes it sends."""

    def __init__(self):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.sent = 0

    def exchange(self, send=None, recv=None):
        """Send `send` to the next rank and receive `recv` from the previous one, together (a
        blocking send facing a blocking send would wait forever)."""
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send.contiguous(), self.next))
            self.sent += send.numel() * send.element_size()
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, self.prev))
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def ring_reduce_scatter(x, ring, steps=None):
    """Rank r ends with chunk r of the sum. At step k it passes on chunk r - k - 1, to which it
    has added what it received, and receives chunk r - k - 2: n - 1 steps of one chunk each,
    (n - 1)/n N sent. `steps`: a list to append (chunk received, its first element) to."""
    n, r = ring.size, ring.rank
    chunks = [c.clone() for c in x.chunk(n)]
    for k in range(n - 1):
        incoming = torch.empty_like(chunks[(r - k - 2) % n])
        ring.exchange(chunks[(r - k - 1) % n], incoming)
        chunks[(r - k - 2) % n] += incoming
        if steps is not None:
            steps.append(((r - k - 2) % n, chunks[(r - k - 2) % n][0].item()))
    return chunks[r]


def ring_all_gather(chunk, ring, steps=None):
    """Every rank ends with every rank's chunk, in rank order. At step k rank r passes on chunk
    r - k, which it holds, and receives chunk r - k - 1: (n - 1)/n N sent, N the output's bytes."""
    n, r = ring.size, ring.rank
    chunks = [torch.empty_like(chunk) for _ in range(n)]
    chunks[r] = chunk.clone()
    for k in range(n - 1):
        ring.exchange(chunks[(r - k) % n], chunks[(r - k - 1) % n])
        if steps is not None:
            steps.append(((r - k - 1) % n, chunks[(r - k - 1) % n][0].item()))
    return torch.cat(chunks)


def ring_all_reduce(x, ring, steps=None):
    """A reduce-scatter, then an all-gather of its chunks: 2 (n - 1)/n N sent, whatever n is."""
    return ring_all_gather(ring_reduce_scatter(x, ring, steps), ring, steps)


def ring_broadcast(x, ring, src=0):
    """Down the ring from `src`: each rank receives the tensor and passes it on, but the last.
    N sent by every rank but the last, (n - 1)/n N a rank on average. NCCL cuts the tensor into
    pieces and pipelines them down the chain, so that it takes about N / bandwidth whatever n."""
    position = (ring.rank - src) % ring.size  # 0: the source
    x = x.clone()
    if position > 0:
        ring.exchange(recv=x)
    if position < ring.size - 1:
        ring.exchange(send=x)
    return x


def ring_shift(x, ring):
    """Send/receive: each rank sends its tensor to the next and receives the previous one's, as
    ring attention passes key/value blocks (a pipeline stage sends to the next stage only): N."""
    received = torch.empty_like(x)
    ring.exchange(x, received)
    return received


### end Ring
def torch_collectives(x):
    """The collectives by torch.distributed itself: {name: (input, output)}."""
    n, r = dist.get_world_size(), dist.get_rank()
    all_reduced = x.clone()
    dist.all_reduce(all_reduced)
    scattered = torch.empty_like(x.chunk(n)[0])
    dist.reduce_scatter_single(scattered, x.clone())
    gathered = torch.empty_like(x)
    dist.all_gather_single(gathered, scattered)
    broadcast = x.clone()
    dist.broadcast(broadcast, src=0)
    shifted = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, (r + 1) % n),
        dist.P2POp(dist.irecv, shifted, (r - 1) % n),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return {
        "all-reduce": (x, all_reduced),
        "reduce-scatter": (x, scattered),
        "all-gather": (scattered, gathered),  # the reduce-scatter's chunks, gathered
        "broadcast": (x, broadcast),
        "send/recv": (x, shifted),
    }


def ring_collectives(x):
    """The same as rings of send/receive: {name: (output, bytes this rank sent)}, and the
    all-reduce's steps on this rank: (chunk received, its first element) each."""
    results, steps = {}, []
    for name, run in [
        ("all-reduce", partial(ring_all_reduce, steps=steps)),
        ("reduce-scatter", ring_reduce_scatter),
        ("broadcast", ring_broadcast),
        ("send/recv", ring_shift),
    ]:
        ring = Ring()
        results[name] = (run(x, ring), ring.sent)
    ring = Ring()  # the all-gather of the reduce-scatter's chunks, as torch's above
    results["all-gather"] = (ring_all_gather(results["reduce-scatter"][0], ring), ring.sent)
    return results, steps


def formula(name, n, N):
    """The bytes a rank sends in the ring: (the formula, what it gives)."""
    return {
        "all-reduce": ("2(n-1)/n N", 2 * (n - 1) * N // n),
        "reduce-scatter": ("(n-1)/n N", (n - 1) * N // n),
        "all-gather": ("(n-1)/n N", (n - 1) * N // n),
        "broadcast": ("N (0 on the last rank of the chain)", N),
        "send/recv": ("N", N),
    }[name]


SHOWN = 16  # elements: larger tensors are not printed
ORDER = ["all-reduce", "reduce-scatter", "all-gather", "broadcast", "send/recv"]
WHAT = {
    "all-reduce": "every rank gets the sum of all the tensors",
    "reduce-scatter": "rank r gets chunk r of the sum, 1/n of it",
    "all-gather": "every rank gets every rank's chunk, in rank order (here: the chunks of the "
    "reduce-scatter, so the result is the all-reduce's)",
    "broadcast": "every rank gets rank 0's tensor",
    "send/recv": "rank r sends its tensor to rank r + 1 and receives rank r - 1's (a ring shift)",
}


def demo_tensor(rank, numel):
    """x[i] = (i + 1) * 10^rank: each digit of a sum says what one rank gave."""
    return torch.arange(1, numel + 1, dtype=torch.int64) * 10**rank


def show(t, width):
    return "[" + " ".join(f"{v:>{width}}" for v in t.tolist()) + "]"


def demo(numel):
    """Run every collective both ways on this rank; rank 0 prints and returns the report."""
    n, rank = dist.get_world_size(), dist.get_rank()
    x = demo_tensor(rank, numel)
    theirs, (ours, steps) = torch_collectives(x), ring_collectives(x)
    for name in ORDER:  # an internal invariant: the ring is the collective
        assert torch.equal(ours[name][0], theirs[name][1]), (name, rank)
    identity = torch.equal(theirs["all-gather"][1], theirs["all-reduce"][1])
    mine = {name: (theirs[name][0], theirs[name][1], ours[name][1]) for name in ORDER}
    everyone = [None] * n
    dist.all_gather_object(everyone, (mine, identity, steps))
    if rank == 0:
        print(report(everyone, numel))
    return everyone


def ring_steps(everyone, numel):
    """The ring all-reduce step by step: at each step, the chunk each rank received and its
    first element after it (each digit one rank's share). Not for tensors too large to show."""
    n = len(everyone)
    if numel > SHOWN:
        return []
    lines = [
        "",
        *textwrap.wrap(
            f"The ring all-reduce, step by step: at each step rank r receives one of the {n} "
            f"chunks (c0 to c{n - 1}) from rank r - 1; the reduce-scatter (RS) adds it to its "
            "own copy, the all-gather (AG) keeps it. A cell: the chunk received and its first "
            "element after the step, each digit one rank's share. After RS, rank r holds chunk "
            "r of the sum; after AG, every chunk.",
            96,
        ),
        "  step " + "".join(f"{f'rank {r}':>12}" for r in range(n)),
    ]
    for k in range(2 * (n - 1)):
        phase = f"RS {k + 1}" if k < n - 1 else f"AG {k - n + 2}"
        cells = [f"c{steps[k][0]}: {steps[k][1]}" for _, _, steps in everyone]
        lines.append(f"  {phase:<5}" + "".join(f"{cell:>12}" for cell in cells))
    return lines


def report(everyone, numel):
    n = len(everyone)
    N = numel * 8
    width = len(str(numel * int("1" * n)))
    wrap = lambda text: textwrap.wrap(text, 96, break_on_hyphens=False)
    lines = wrap(
        f"{n} ranks (gloo), int64 tensors of {numel} elements (N = {N} bytes); rank r holds "
        f"x[i] = (i + 1) * 10^r, so each digit of a sum is one rank's."
    )
    for name in ORDER:
        lines += ["", *wrap(f"{name}: {WHAT[name]}")]
        if numel > SHOWN:
            lines.append(f"  (tensors of over {SHOWN} elements are not printed)")
            continue
        for rank, (mine, _, _) in enumerate(everyone):
            before, after, _ = mine[name]
            lines.append(f"  rank {rank}: {show(before, width)} -> {show(after, width)}")
    same = all(identity for _, identity, _ in everyone)
    lines += [
        "",
        f"all-reduce = reduce-scatter then all-gather: {'equal' if same else 'DIFFERENT'} on "
        "every rank",
        *ring_steps(everyone, numel),
        "",
        *wrap(
            f"Bytes each rank sends, each collective done again as a ring of send/recv (n = {n} "
            f"ranks, N = {N} bytes; all-gather: N the output's), its result checked equal to "
            "torch.distributed's:"
        ),
        "",
        "| collective | " + " | ".join(f"rank {r}" for r in range(n)) + " | ring formula |",
        "| --- |" + " ---: |" * n + " --- |",
    ]
    for name in [*ORDER, "reduce-scatter + all-gather"]:
        if name in ORDER:
            sent = [mine[name][2] for mine, _, _ in everyone]
            text, value = formula(name, n, N)
        else:
            sent = [mine["reduce-scatter"][2] + mine["all-gather"][2] for mine, _, _ in everyone]
            text, value = "2(n-1)/n N: the all-reduce's", formula("all-reduce", n, N)[1]
        lines.append(f"| {name} | " + " | ".join(map(str, sent)) + f" | {text} = {value} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks to start (without torchrun)")
    parser.add_argument(
        "--numel", type=int, help="elements per tensor, a multiple of the ranks (default 2 n)"
    )
    return parser.parse_args(argv)


def _rank(rank, world, numel, store_path):
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    demo(numel)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    launched = "RANK" in os.environ  # by torchrun
    world = int(os.environ["WORLD_SIZE"]) if launched else args.nproc
    numel = args.numel or 2 * world
    if world < 2:
        print(f"error: the collectives need at least 2 ranks, got {world}", file=sys.stderr)
        return 2
    if numel < 1 or numel % world:
        print(
            f"error: --numel {numel} must be a positive multiple of the {world} ranks "
            f"(reduce-scatter cuts the tensor into {world} equal chunks)",
            file=sys.stderr,
        )
        return 2
    if numel * int("1" * world) >= 2**63:
        print(
            f"error: {world} ranks and {numel} elements: the sums of (i + 1) * 10^r would "
            f"overflow int64; use fewer ranks or elements",
            file=sys.stderr,
        )
        return 2
    if launched:
        dist.init_process_group("gloo")
        demo(numel)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_rank, (world, numel, store), nprocs=world, start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit(main())
