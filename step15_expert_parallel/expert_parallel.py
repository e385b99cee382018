"""Expert parallelism: the experts of every layer split over ep ranks, the tokens sent to them.

A mixture-of-experts layer (moe.py) holds E experts; on one device every rank of a data-parallel
group would hold all E, and every expert sees only that rank's tokens. Expert parallelism borrows
ep of the dp ranks (process_group_manager.py): rank r of an ep group holds experts
r E/ep ... (r + 1) E/ep - 1 alone, and each rank keeps its own tokens and its own router. In each
layer, after the router has chosen, the rows (token copies) grouped by expert go to the rank that
holds their expert, and the results come back:

1. the counts: each rank tells every other how many rows it sends for each of its experts (an
   all-to-all of E numbers): the sizes of the next messages, which nobody can know in advance;
2. dispatch: an all-to-all of the rows, rank s's rows for rank r's experts to rank r;
3. each local expert runs on the rows it received from every rank (regrouped by expert);
4. combine: the all-to-all back, each row to the rank it came from, in the order it left.

No row is dropped (no capacity), so the layer computes what one device computes, row for row
(to the rounding of a matmul over another number of rows).
Backward runs the two all-to-alls the other way (`AllToAll`): each row's gradient goes back to
the rank that computed it, then to the rank it came from. PyTorch's plain
dist.all_to_all_single is not known to autograd: with it the graph would end at the rows that
come back, the experts would get no gradient at all, and the layer's input only the part that
passes through the router's weights.

An expert's gradient on rank r holds every ep rank's tokens. The ranks that hold the same expert
(edp x cp, process_group_manager.py) average theirs, and the mean over the whole batch is their
sum divided by dp x cp, as for every other parameter: each rank's loss is the mean over its own
rows, and the batch's is the mean of the dp x cp ranks' losses. Dividing by the edp x cp ranks the
expert's gradient is averaged over would make it ep times too large.
"""

# B batch, T tokens, D hidden, E experts, N k the token slots of this rank

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from moe import run_experts
from placement import Held, place


def check_expert_parallel(parser, args):
    """Refuse, before anything runs, an ep_size these sizes cannot split (moe.check_moe then
    checks it against the model's experts)."""
    ep = args.ep_size
    if ep < 1:
        parser.error(f"--ep_size must be at least 1, got {ep}")
    if args.dp_size % ep:
        parser.error(
            f"--ep_size {ep} borrows its ranks from dp: it must divide --dp_size {args.dp_size}"
        )


def all_to_all(x, receive, send, group):
    """Rank i's rows send[j] (a count) to rank j; rows receive[j] from rank j, in rank order."""
    out = x.new_empty(sum(receive), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """The all-to-all, in autograd: backward sends each row's gradient back where the row came
    from, the same all-to-all with the counts swapped."""

    @staticmethod
    def forward(ctx, x, receive, send, group):
        ctx.receive, ctx.send, ctx.group = receive, send, group
        return all_to_all(x, receive, send, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.send, ctx.receive, ctx.group), None, None, None


def exchange(group, moe, rows, counts):
    """`rows`, grouped by expert (counts[e] for expert e), each through its expert, on the rank
    that holds it; returned in the same order."""
    ep = dist.get_world_size(group)
    local = moe.num_experts // ep
    # The rows this rank sends each rank's experts; the all-to-all gives those it receives.
    send = counts.view(ep, local)  # (ep, E/ep)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # The split sizes, read on the host once (all_to_all_single and split take lists): the one
    # wait on the device that the exchange adds, per layer and micro-batch.
    sizes = torch.cat([send.sum(dim=1), received.sum(dim=1), received.sum(dim=0)]).tolist()
    out_rows, in_rows, per_expert = sizes[:ep], sizes[ep : 2 * ep], sizes[2 * ep :]
    arrived = AllToAll.apply(rows, in_rows, out_rows, group)  # by rank, then by expert
    expert = torch.arange(local, device=rows.device).repeat(ep)  # (ep E/ep,)
    slots = expert.repeat_interleave(received.view(-1), output_size=sum(in_rows))
    by_expert = slots.argsort(stable=True)
    out = run_experts(moe.experts, arrived[by_expert], per_expert)
    out = out[by_expert.argsort()]  # back by rank
    return AllToAll.apply(out, out_rows, in_rows, group)  # (N k, D), in the order they left


def apply_expert_parallel(model, pgm):
    """Keep this ep rank's experts of every layer, recorded as held on it alone, and send the
    rows to them. Call it after moe.apply_moe, on the meta device."""
    E, ep = model.config.num_local_experts, pgm.ep_size
    mine = range(pgm.ep_rank * E // ep, (pgm.ep_rank + 1) * E // ep)
    for layer in model.model.layers:
        moe = layer.mlp
        moe.experts = nn.ModuleDict({str(e): moe.experts[str(e)] for e in mine})
        for expert in moe.experts.values():
            for linear in expert.children():
                place(linear, "weight", Held("ep", pgm.ep_rank))
        moe.exchange = partial(exchange, pgm.ep_group)
    return model
