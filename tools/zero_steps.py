"""Step 10's optimizer step as a timeline: what each dp rank holds after each phase of ZeRO-1.

    python tools/zero_steps.py               # 4 ranks (gloo, started here)
    torchrun --nproc_per_node 4 tools/zero_steps.py

A weight of 8 numbers, 0 to 7, is trained for one step by step 10's own `DataParallelZero1` on n
ranks. Rank r's gradient is (r + 1) x (1, 2, ..., 8), so the average over the ranks is easy to
check by eye. Rank 0 prints, after each phase, every rank's bucket (the flat gradient buffer,
cut into n shards by `|`, the rank's own shard in brackets) or its copy of the weight:

1. backward: each rank's own gradient in its bucket;
2. reduce-scatter: a rank's own shard holds the average; the rest of its buffer is its own
   gradient divided by n (the division comes before the sum), which nothing reads;
3. clip: the norm of the whole gradient, from the shards (each rank's squares summed over dp),
   and each shard scaled by the same factor;
4. update: AdamW moves the rank's own shard of the weight (its moments exist for that shard
   only); the rest of its copy is the old weight;
5. all-gather: every rank holds every updated shard.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
NUMEL = 8
LR, GRAD_CLIP = 0.1, 10.0  # a first AdamW step moves each element by about the rate


class Weight(nn.Module):
    """One weight; its "loss" is the sum of weight x g, so the gradient is g itself."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(float(NUMEL)))

    def forward(self, g):
        return (self.weight * g).sum()


def row(values, shards, mine):
    """The values cut into shards, this rank's in brackets: ` 1.0  2.0 |[ 3.0  4.0]| ...`."""
    cells = [" ".join(f"{v:7.3f}" for v in shard) for shard in values.view(shards, -1).tolist()]
    return "|".join(f"[{c}]" if i == mine else f" {c} " for i, c in enumerate(cells)).rstrip()


def timeline():
    """Every rank runs step 10's ZeRO-1 on its weight; rank 0 prints what each rank holds."""
    sys.path.insert(0, str(ROOT / "step10_zero1"))
    from placement import clip_grad_norm
    from process_group_manager import ProcessGroupManager
    from zero import DataParallelZero1

    rank, n = dist.get_rank(), dist.get_world_size()
    pgm = ProcessGroupManager(tp_size=1, pp_size=1, dp_size=n)
    model = Weight()
    zero = DataParallelZero1(model, pgm, ("dp",))
    pieces = zero.shard(list(model.parameters()))  # this rank's run of the weight
    optimizer = torch.optim.AdamW(pieces, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    bucket = zero.bucket_manager.buckets[0]
    lines = []

    def show(title, tensor):
        everyone = [torch.empty_like(tensor) for _ in range(n)]
        dist.all_gather(everyone, tensor.contiguous())
        lines.append(title)
        lines.extend(f"  rank {r}: {row(t, n, r)}" for r, t in enumerate(everyone))

    g = (rank + 1) * torch.arange(1.0, NUMEL + 1)
    zero(g).backward()  # the hook starts the reduce-scatter once the gradient is in the bucket
    local = g.clone()
    show("1. backward: each rank's own gradient, (r + 1) x (1 ... 8)", local)
    zero.finish_gradient_synchronization()
    show(
        "2. reduce-scatter: its own shard holds the average; the rest is unused",
        bucket.grad_data,
    )
    norm = clip_grad_norm(zero.gradients(SimpleNamespace(counted=model)), GRAD_CLIP, pgm)
    factor = min(1.0, GRAD_CLIP / (norm.item() + 1e-6))
    show(
        f"3. clip: the norm {norm.item():.3f}, from the shards' squares summed over dp; "
        f"every shard times {factor:.4f}",
        bucket.grad_data,
    )
    optimizer.step()
    moments = sum(state["exp_avg"].numel() for state in optimizer.state.values())
    show(
        f"4. update: AdamW moves its own shard (moments for {moments} of {NUMEL} numbers); "
        f"the rest is the old weight",
        model.weight.detach(),
    )
    zero.all_gather_parameters()
    show("5. all-gather: every rank holds every updated shard", model.weight.detach())
    if rank == 0:
        print("\n".join(lines))


def _rank(rank, world, store_path):
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    timeline()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks to start (without torchrun)")
    args = parser.parse_args(argv)
    launched = "RANK" in os.environ  # by torchrun
    world = int(os.environ["WORLD_SIZE"]) if launched else args.nproc
    if world < 2 or NUMEL % world:
        print(f"error: {world} ranks: use 2, 4 or 8, which cut the {NUMEL} numbers evenly",
              file=sys.stderr)  # fmt: skip
        return 2
    if launched:
        dist.init_process_group("gloo")
        timeline()
        dist.barrier()
        dist.destroy_process_group()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_rank, (world, store), nprocs=world, start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit(main())
