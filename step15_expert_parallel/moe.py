"""A mixture of experts in place of each layer's MLP (Mixtral's), put in from outside the model.

A dense layer runs every token through one MLP. A mixture-of-experts layer holds E MLPs, the
experts, and a router, a linear layer that scores each token against each expert: the token goes
through its k best experts only, and their outputs are summed, weighted by the router. The layer
then has E times the MLP's parameters but computes with k of them per token: more to learn from
for the same compute per token.

Mixtral's routing, as transformers' MixtralForCausalLM computes it: the router's logits in fp32,
softmax over the E experts, the top k, their probabilities divided by their sum (the weights);
each expert is our LlamaMLP (transformers' w1, w3, w2 are its gate_proj, up_proj, down_proj).
With k = 1 the one weight is always 1.0: the loss of the predictions would send the router no
gradient (only the balancing and z-losses would train it): refused.

Llama 4's routing (`--moe_router llama4`, as transformers' Llama4TextMoe computes it): each
expert's score is the sigmoid of its logit, not a share of a softmax, so a token's k weights are
not divided by their sum (and k = 1 still teaches the router); the weight scales the token
before its expert, not the expert's output; and a shared expert, one more LlamaMLP, runs on every
token and is added to the sum.

The computation groups the token copies by expert (a stable sort of the N k (token, slot) pairs
by their expert), runs each expert once on its rows, and puts the rows back in slot order. The
step in the middle, `exchange`, is where expert parallelism (expert_parallel.py) sends the rows
to the rank that holds their expert and back.

Two losses keep the router healthy, both added to the training loss:
- load balancing (Switch Transformer's): E sum_e f_e P_e, f_e the share of the sequence's token
  slots sent to expert e (summing to k) and P_e the mean router probability of e over the
  sequence; smallest when the load is even. Computed per sequence and layer, then averaged: a
  mean of per-sequence terms is linear in the sequences, so the dp ranks, micro-batches and
  pipeline stages each add their share and the sum is one device's. (transformers pools the
  whole batch and every layer into one f and one P: not a sum over sequences, so no rank could
  compute its share of it.)
- the router z-loss (ST-MoE's): the mean of logsumexp(router logits)^2 over the tokens, which
  keeps the logits small.

The losses leave the layer without a new output: each is attached to the layer's output by
`AttachLoss`, identity forward, whose backward also gives the loss its gradient. Whatever stage
the layer runs on, the backward that reaches its output starts the losses' own.
"""

# B batch, T tokens, D hidden, E experts, k experts per token, N = B T token rows

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model import LlamaMLP
from tensor_parallel import Copy, Reduce, all_reduce
from utils import log

MODEL_TYPES = ("llama", "mixtral")  # the configs this step trains: Mixtral, a Llama with experts


def is_moe(config):
    return getattr(config, "num_local_experts", 0) > 0


def check_moe(config, args):
    """Refuse, naming the field or flag, a mixture of experts this step would not compute as
    Mixtral does, or cannot split as asked."""
    ep = args.ep_size
    if not is_moe(config):
        given = [f"--ep_size {ep}"] if ep > 1 else []
        given += ["--aux_loss_coef"] if args.aux_loss_coef is not None else []
        given += ["--z_loss_coef"] if args.z_loss_coef else []
        given += ["--expert_bias_rate"] if args.expert_bias_rate else []
        given += ["--moe_router llama4"] if args.moe_router == "llama4" else []
        if given:
            raise ValueError(
                f"{' and '.join(given)} apply to a mixture-of-experts model; this one is dense "
                f"(no num_local_experts): drop them, or use --model_name tiny-moe"
            )
        return
    E, k = config.num_local_experts, config.num_experts_per_tok
    least = 1 if args.moe_router == "llama4" else 2  # sigmoid scores: one weight still learns
    if not least <= k <= E:
        why = "too many" if k > E else "too few"
        if k == 1:  # only the router's own losses would reach it
            why = "its one weight is 1.0: the predictions' loss sends the router no gradient"
        raise ValueError(
            f"num_experts_per_tok={k} is not supported ({why}): use {least} to "
            f"num_local_experts={E}"
        )
    if args.moe_router == "llama4":
        # Its shared expert and sigmoid router have no place in a Mixtral checkpoint.
        given = [f for f in ("init_from_hf", "save_dynamics") if getattr(args, f)]
        if given:
            raise ValueError(
                f"--moe_router llama4 with --{given[0]}: that reads or writes the model as "
                f"transformers' Mixtral, which has no Llama 4 router nor shared expert"
            )
    if getattr(config, "router_jitter_noise", 0.0):
        raise ValueError(
            f"router_jitter_noise={config.router_jitter_noise} is not supported: the router "
            f"draws no random numbers here; set it to 0.0"
        )
    if E % ep:
        raise ValueError(f"--ep_size {ep} does not divide num_local_experts={E}")


class AttachLoss(torch.autograd.Function):
    """y, with `loss` riding on it: forward returns y; backward passes y's gradient on and gives
    `loss` the gradient `seed` (1, or fp16's loss scale, which multiplies the main loss too), so
    that it is minimised with whatever loss y leads to. Backward also
    adds (the loss, `counts`) to the list `record`, for the log: once per micro-batch, where a
    forward run again by recomputation would count twice."""

    @staticmethod
    def forward(ctx, y, loss, counts, record, seed=1.0):
        ctx.facts, ctx.record, ctx.seed = (loss.detach(), counts.detach()), record, seed
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.record.append(ctx.facts)
        return grad, torch.full_like(ctx.facts[0], ctx.seed), None, None, None


class Linear(nn.Linear):
    """nn.Linear (no bias) whose matmul is `self.linear`: a zero-bubble schedule swaps in one
    whose weight gradient waits (zero_bubble.py), as in the tensor-parallel layers."""

    linear = staticmethod(F.linear)

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return self.linear(x, self.weight)


def expert(config):
    """Our LlamaMLP, its three linear layers `Linear`s."""
    mlp = LlamaMLP(config)
    for name, dense in list(mlp.named_children()):
        setattr(mlp, name, Linear(dense.in_features, dense.out_features))
    return mlp


def run_experts(experts, rows, counts):
    """Each expert on its own rows: `rows` grouped by expert, counts[i] of them for the i-th of
    `experts` (a ModuleDict, in expert order)."""
    parts = rows.split(counts)
    outputs = [expert(part) for expert, part in zip(experts.values(), parts, strict=True)]
    return torch.cat(outputs)  # (rows, D)


def exchange_locally(moe, rows, counts):
    """One rank holds every expert: nothing to send."""
    return run_experts(moe.experts, rows, counts.tolist())


class MixtureOfExperts(nn.Module):
    """The router (`gate`, as Mixtral names it) and the experts this rank holds, keyed by their
    index in the layer (`experts`: all E on one rank), so that their names are the single-device
    model's."""

    def __init__(self, config, experts):
        super().__init__()
        D, E = config.hidden_size, config.num_local_experts
        self.num_experts, self.top_k = E, config.num_experts_per_tok
        self.llama4 = getattr(config, "moe_router", "mixtral") == "llama4"
        self.gate = Linear(D, E)
        self.experts = nn.ModuleDict({str(e): expert(config) for e in experts})
        if self.llama4:  # on every rank, like the router: not one of the E
            self.shared_expert = expert(config)
        self.exchange = exchange_locally  # expert parallelism: across the ep ranks
        # Set by the run: the losses' coefficients, and the scale of their gradient (one over the
        # micro-batches of a step, like the loss's).
        self.aux_loss_coef, self.z_loss_coef, self.scale, self.loss_scale = 0.0, 0.0, 1.0, 1.0
        self.record = []  # (router losses, rows per expert) of each micro-batch, for the log
        # The groups a sequence's tokens are cut over, each with whether the losses of its ranks
        # are averaged (cp's, like dp's) or each rank's counts whole (sequence parallelism's tp).
        self.sequence_groups = ()
        self.tp_group = None  # sequence parallelism: each tp rank routes its own tokens
        # The balancing bias: its row of the model's (add_expert_bias); not a weight to save.
        self.register_buffer("bias", torch.zeros(E), persistent=False)

    def forward(self, x):
        with gradients_summed(self, self.tp_group):
            return self.route(x)

    def route(self, x):
        B, T, D = x.shape
        logits = self.gate(x).float()  # (B, T, E)
        probs = logits.softmax(dim=-1)  # (B, T, E)
        scores = logits.sigmoid() if self.llama4 else probs  # (B, T, E)
        # The experts chosen with the balancing bias (zero unless --expert_bias_rate), weighed
        # without it: the bias steers the load, not the sum.
        index = (scores + self.bias).topk(self.top_k, dim=-1).indices  # (B, T, k)
        top = scores.gather(-1, index)  # (B, T, k)
        weights = top if self.llama4 else top / top.sum(dim=-1, keepdim=True)  # (B, T, k)
        # The N k slots (slot j of token n at n k + j) grouped by expert, each slot's token a row.
        experts = index.view(-1)  # (N k,)
        order = experts.argsort(stable=True)
        counts = torch.bincount(experts, minlength=self.num_experts)  # (E,)
        rows = x.reshape(-1, D)[order // self.top_k]  # (N k, D)
        if self.llama4:  # the weight scales the expert's input
            rows = rows * weights.view(-1)[order].to(x.dtype).unsqueeze(-1)
        out = self.exchange(self, rows, counts)  # each row through its expert
        # Back in slot order, weighed (Mixtral: the outputs), summed slot by slot.
        out = out[order.argsort()].view(B * T, self.top_k, D)  # (N, k, D)
        if self.llama4:
            y = self.shared_expert(x).reshape(-1, D) + out.sum(dim=1)  # (N, D)
        else:
            y = (out * weights.view(B * T, self.top_k, 1)).sum(dim=1)  # (N, D)
        y = y.to(x.dtype).view(B, T, D)
        if torch.is_grad_enabled():
            losses = self.scale * self.router_losses(logits, probs, index)
            if self.tp_group is not None:  # for the log: the rows of every tp rank's tokens
                counts = all_reduce(counts.clone(), self.tp_group)
            y = AttachLoss.apply(y, losses, counts, self.record, self.loss_scale)
        return y

    def router_losses(self, logits, probs, index):
        """aux_loss_coef x the load-balancing loss + z_loss_coef x the z-loss, each a mean over
        the sequences of a per-sequence term."""
        B, T, E = probs.shape
        slots = torch.zeros(B, E, device=probs.device)  # (B, E), token slots per expert
        slots.scatter_add_(1, index.view(B, -1), torch.ones(B, T * self.top_k, device=slots.device))
        summed = probs.sum(dim=1)  # (B, E)
        squares = torch.logsumexp(logits, dim=-1).pow(2).sum(dim=1)  # (B,)
        for group, averaged in self.sequence_groups:  # the sequence's other tokens are elsewhere
            all_reduce(slots, group)
            # Summed forward. Backward: where the ranks' losses are averaged (cp), each rank's
            # copy of the loss sends its gradient to all; else each rank's own is the gradient.
            summed, squares = (
                Reduce.apply(Copy.apply(t, group) if averaged else t, group)
                for t in (summed, squares)
            )
            T *= dist.get_world_size(group)
        balance = E * (slots / T * summed / T).sum(dim=-1)  # (B,)
        z = squares / T  # (B,)
        return (self.aux_loss_coef * balance + self.z_loss_coef * z).mean()


def apply_moe(model, pgm=None, sequence_parallel=False):
    """Put a MixtureOfExperts with every expert in place of every layer's MLP (expert
    parallelism then keeps a rank's own). Call it on the meta device, after sequence
    parallelism, before the weights exist. Under tensor parallelism the experts are not split:
    every tp rank runs the whole layer on the same tokens, or under sequence parallelism on its
    own T/tp of them (the router's and experts' gradients then summed over tp, as the norms'
    are); either way the norm before it must not touch its input over tp (its f,
    tensor_parallel.py). Under context parallelism a rank holds chunks of each sequence. `pgm`:
    the grid, None on one process."""
    config = model.config
    groups = [(pgm.cp_group, True)] if pgm and pgm.cp_size > 1 else []
    groups += [(pgm.tp_group, False)] if sequence_parallel else []
    for layer in model.model.layers:
        layer.mlp = MixtureOfExperts(config, range(config.num_local_experts))
        layer.mlp.sequence_groups = tuple(groups)
        layer.mlp.tp_group = pgm.tp_group if sequence_parallel else None
        if hasattr(layer.post_attention_layernorm, "f"):
            layer.post_attention_layernorm.f = Whole
    return model


@contextmanager
def gradients_summed(module, group):
    """Within: each of `module`'s parameters enters through Copy (identity forward, all-reduce
    backward over `group`): each rank's gradient is then the sum of every rank's. Nothing with
    `group` None."""
    if group is None:
        yield
        return
    saved = []
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):  # ZeRO-3's whole weights, if there
            saved.append((owner, name, param))
            owner._parameters[name] = Copy.apply(param, group)
    try:
        yield
    finally:
        for owner, name, param in saved:
            owner._parameters[name] = param


class Whole:
    """f for an input that no tp rank splits: nothing to do either way."""

    @staticmethod
    def apply(x, group):
        return x


def moe_layers(model):
    return [m for m in model.modules() if isinstance(m, MixtureOfExperts)]


def set_router_losses(model, args, scale, loss_scale=1.0):
    """The losses' coefficients (the config's router_aux_loss_coef unless --aux_loss_coef says
    otherwise), the scale of the losses (1 / micro-batches) and fp16's loss scale, which
    multiplies their gradients, in every MoE layer of `model`."""
    aux = args.aux_loss_coef
    if aux is None:
        aux = getattr(model.config, "router_aux_loss_coef", 0.0)
    for moe in moe_layers(model):
        moe.aux_loss_coef, moe.z_loss_coef, moe.scale = aux, args.z_loss_coef, scale
        moe.loss_scale = loss_scale


CAPACITY_FACTOR = 1.25  # for the log only: what a layer with a capacity would have dropped


def router_stats(model, pgm):
    """The step's router statistics, from what each MoE layer recorded in the step's backwards,
    as one tensor on the device: [the router's losses, the rows over capacity, all the rows,
    each layer's rows per expert (L x E)]. Each rank holds its stage's layers and its share of
    the batch; train_step adds them up over the world in the step's one collective (`agree`'s
    `sums`), each counted once: on tp rank 0 (the tp ranks route the same tokens, or under
    sequence parallelism record every tp rank's rows). The capacity: Switch Transformer's,
    GShard's, each expert taking at most CAPACITY_FACTOR x its even share of a micro-batch's
    rows, the rest dropped; here none is, the share that would be is for the log. None for a
    model without experts."""
    if not is_moe(model.config):
        return None
    config = model.config
    E, device = config.num_local_experts, model.expert_bias.device
    loads = torch.zeros(config.num_hidden_layers, E, device=device)
    totals = torch.zeros(3, device=device)  # the losses, the rows over capacity, all the rows
    for name, moe in model.named_modules():
        if isinstance(moe, MixtureOfExperts):
            layer = int(name.split(".")[2])  # model.layers.3.mlp
            for loss, counts in moe.record:
                counts = counts.float()
                capacity = torch.floor(CAPACITY_FACTOR * counts.double().sum() / E)
                over = (counts - capacity.float()).clamp(min=0).sum()
                totals += torch.stack([loss.float(), over, counts.sum()])
                loads[layer] += counts
            moe.record.clear()
    return torch.cat([totals, loads.view(-1)]) * float(pgm.tp_rank == 0)


def router_step(model, pgm, args, facts, run):
    """Once per optimizer step, after it: the balancing bias moved on the device from the whole
    batch's loads (`facts.sums`, `router_stats`) when --expert_bias_rate is set and the step was
    applied (`update_expert_bias`); on a step that logs or validates, the router's record in
    `run.record`, read on the host once: the losses' mean over the micro-batches and the dp x cp
    ranks, each layer's rows per expert with the busiest expert's load over the mean (1.0:
    even), the capacity's share; and with each validation, the loads' table."""
    L, E = model.expert_bias.shape
    if args.expert_bias_rate and facts.finite:
        update_expert_bias(model, facts.sums[3:].view(L, E), args.expert_bias_rate)
    if not (run.should_log() or run.should_validate()):
        return
    both = facts.sums.tolist()  # the statistics' one read on the host, on a step that logs
    loss, dropped = both[0] / (pgm.dp_size * pgm.cp_size), both[1] / both[2]
    loads = [both[3 + layer * E : 3 + (layer + 1) * E] for layer in range(L)]
    balance = [max(row) / (sum(row) / E) for row in loads]
    record = {"router_loss": loss, "expert_load": loads, "load_max_over_mean": balance}
    run.record.update({**record, f"dropped_at_capacity_{CAPACITY_FACTOR}": dropped})
    if run.should_validate():  # how evenly the experts were loaded
        log(load_table(run.record))


def load_table(record):
    """The step's expert loads (`router_stats`), one line per layer: each expert's share of the
    token slots as a bar of tenths, and the busiest over the mean."""
    dropped = record[f"dropped_at_capacity_{CAPACITY_FACTOR}"]
    lines = [
        f"expert load, each expert's share of the layer's token slots (with a capacity of "
        f"{CAPACITY_FACTOR} x the even share, {100 * dropped:.1f} % of them would be dropped):"
    ]
    for layer, (loads, ratio) in enumerate(
        zip(record["expert_load"], record["load_max_over_mean"], strict=True)
    ):
        total = sum(loads) or 1.0
        shares = "  ".join(f"{e} {'#' * round(10 * n / total):<10}" for e, n in enumerate(loads))
        lines.append(f"  layer {layer:<3} {shares}  max/mean {ratio:.2f}")
    return "\n".join(lines)


def with_router(config, args):
    """The config, with --moe_router written into it for a mixture of experts, so that a
    checkpoint's config.json says it too (and the FLOPs count the shared expert)."""
    if is_moe(config):
        config.moe_router = args.moe_router
    return config


def add_expert_bias(model, device):
    """Loss-free balancing (DeepSeek-V3's): a bias per layer and expert, added to the router's
    probabilities where the experts are chosen (not where they are weighed), raised for the
    experts below their even share of the step's rows and lowered for those above
    (`update_expert_bias`). The whole table lives on every rank, one row per layer, each MoE layer
    routing with its own; the checkpoint keeps it. Call it once the model is on `device`."""
    config = model.config
    model.expert_bias = torch.zeros(
        config.num_hidden_layers, config.num_local_experts, device=device
    )
    for name, moe in model.named_modules():
        if isinstance(moe, MixtureOfExperts):
            moe.bias = model.expert_bias[int(name.split(".")[2])]  # model.layers.3.mlp


@torch.no_grad()
def update_expert_bias(model, loads, rate):
    """Once per optimizer step, after every micro-batch: each bias moves by `rate` towards the
    even load, from the rows every expert got over the whole batch (`router_stats`, summed over
    every rank that shares it), so that every rank moves alike. Per micro-batch, or from one
    rank's rows, the bias would follow how the batch is cut. `loads`: (L, E), on its device."""
    model.expert_bias += rate * torch.sign(loads.mean(dim=1, keepdim=True) - loads)


def active_flops_per_token(config, dense_flops):
    """`dense_flops` (utils.flops_per_token, one MLP per layer) with each layer's MLP counted k
    times (k + 1 with Llama 4's shared expert) and its router once: the FLOPs a token costs."""
    if not is_moe(config):
        return dense_flops
    D, F, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    k, E = config.num_experts_per_tok, config.num_local_experts
    k += getattr(config, "moe_router", "mixtral") == "llama4"
    return dense_flops + 6 * L * ((k - 1) * 3 * D * F + D * E)
