"""The comparisons of tools/bench.py. Each builds our implementation and PyTorch's (or
transformers') from the same initial weights, runs one training step of each and checks that they
agree, then times their steps in turn (fwd + bwd + AdamW over the same global batch).

Our code comes from the step that introduces it: the model from step 1, naive and bucketed data
parallelism from step 6, tensor parallelism from step 4, both pipeline schedules from step 8.
"""

# B micro-batch, T tokens, V vocab

import importlib
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
STEP_MODULES = ["model", "utils", "process_group_manager", "tensor_parallel", "data_parallel"]
STEP_MODULES += ["pipeline_parallel", "checkpoint", "dataloader", "train"]
OVERRIDES = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
]


def import_step(step, name):
    """Module `name` of step folder `step` (the steps share module names, so drop cached ones)."""
    for module in STEP_MODULES:
        sys.modules.pop(module, None)
    sys.path.insert(0, str(ROOT / step))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / step))


def load_config(args):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ROOT / "assets" / "configs" / args.model_name)
    for key in OVERRIDES:
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
    config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def make_batch(config, args, device):
    """The global batch, (m * B, T) inputs and targets, the same for every side and step."""
    generator = torch.Generator().manual_seed(args.seed)
    rows = args.micro_batches * args.micro_batch_size
    tokens = torch.randint(0, config.vocab_size, (rows, args.seq_len + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def split(inputs, targets, m):
    """The batch as m (inputs, targets) micro-batches of B rows each, in order."""
    return list(zip(inputs.chunk(m), targets.chunk(m), strict=True))


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # (B*T, V)


def adamw(params):
    """The same optimizer on every side: the steps' AdamW (fused on CPU and CUDA)."""
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def accumulate(model, micro_batches, loss_fn=cross_entropy, before=None):
    """Forward and backward over the micro-batches, each loss divided by their number; returns
    the summed loss. `before(i)` runs before micro-batch i (to say when to sync gradients)."""
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        with before(i) if before else nullcontext():
            loss = loss_fn(model(x), y) / len(micro_batches)
            loss.backward()
        total += loss.detach()
    return total


def max_grad_difference(ours, theirs):
    """The largest |Δ| between the gradients of same-named parameters, relative to the largest
    gradient of theirs. `theirs` maps names to gradients (already full tensors)."""
    diff, scale = 0.0, 0.0
    for name, param in ours.named_parameters():
        diff = max(diff, (param.grad - theirs[name]).abs().max().item())
        scale = max(scale, theirs[name].abs().max().item())
    return diff / scale


def alternate(sides, args, device):
    """Run the sides' steps in turn, rotating which goes first, `warmup` times untimed then
    `steps` times timed. In a process group each step starts together on every rank and takes as
    long as its slowest rank. Returns each side's median step time (ms) and its losses."""
    names = list(sides)
    distributed = dist.is_initialized()
    times = torch.zeros(args.steps, len(names), dtype=torch.float64)
    losses = {name: [] for name in names}
    for step in range(args.warmup + args.steps):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            if distributed:
                dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            loss = sides[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= args.warmup:
                times[step - args.warmup, names.index(name)] = time.perf_counter() - start
            losses[name].append(float(loss))
    if distributed:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    medians = {n: 1e3 * statistics.median(times[:, i].tolist()) for i, n in enumerate(names)}
    return medians, losses


def loss_difference(losses, ours, theirs):
    """The largest relative difference of two sides' losses, step by step."""
    pairs = zip(losses[ours], losses[theirs], strict=True)
    return max(abs(a - b) / abs(b) for a, b in pairs)


def row(part, ours, theirs, times, checks):
    """One line of the table; `checks` is a list of (what, measured, tolerance)."""
    return {"part": part, "ours": ours, "theirs": theirs, "ours_ms": times[ours],
            "theirs_ms": times[theirs], "checks": checks}  # fmt: skip


def compare_model(args, device):
    """Our model against transformers' LlamaForCausalLM, one device, the same weights."""
    import transformers

    ours_module = import_step("step1_model", "model")
    config = load_config(args)
    ours = ours_module.LlamaForCausalLM(config).to(device)
    ours.init_weights(args.seed)
    theirs = transformers.LlamaForCausalLM(config).to(device)
    theirs.load_state_dict(ours.state_dict())
    inputs, targets = make_batch(config, args, device)
    micro_batches = split(inputs, targets, args.micro_batches)

    def training_step(model, forward):
        optimizer = adamw(model.parameters())

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = accumulate(forward, micro_batches)
            optimizer.step()
            return loss

        return step

    sides = {
        "ours": training_step(ours, ours),
        "transformers": training_step(theirs, lambda x: theirs(x).logits),
    }
    for step in sides.values():  # one step each; the gradients stay until the next zero_grad
        step()
    grads = {name: p.grad for name, p in theirs.named_parameters()}
    grad_diff = max_grad_difference(ours, grads)
    times, losses = alternate(sides, args, device)
    checks = [("grad", grad_diff, 1e-5), ("loss", loss_difference(losses, *sides), 1e-5)]
    return [row("model, 1 device", "ours", "transformers", times, checks)]


def replica(model_module, config, args, device):
    """A whole model with the seed's weights."""
    model = model_module.LlamaForCausalLM(config).to(device)
    model.init_weights(args.seed)
    return model


def gathered_grads(model):
    """name -> the full gradient (a DTensor's gathered from its shards)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return grads


def all_ranks_max(value):
    value = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def compare_dp(args, device):
    """Naive and bucketed data parallelism (step 6) against DistributedDataParallel: each rank
    takes every dp_size-th micro-batch of the batch and accumulates them."""
    from torch.nn.parallel import DistributedDataParallel

    model_module = import_step("step6_data_parallel_bucket", "model")
    data_parallel = import_step("step6_data_parallel_bucket", "data_parallel")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = load_config(args)
    inputs, targets = make_batch(config, args, device)
    pairs = split(inputs, targets, args.micro_batches)
    mine = pairs[rank::world]
    group = dist.group.WORLD
    new = lambda: replica(model_module, config, args, device)
    models = {
        "bucketed": data_parallel.DataParallelBucket(new(), group),
        "naive": data_parallel.DataParallelNaive(new(), group),
        "DDP": DistributedDataParallel(new()),
    }

    def ours_step(model):
        optimizer = adamw(model.parameters())

        def sync_on_last(i):
            model.require_backward_grad_sync = i == len(mine) - 1  # average once, at the end
            return nullcontext()

        def step():
            model.zero_grad(set_to_none=True)
            loss = accumulate(model, mine, before=sync_on_last)
            model.finish_gradient_synchronization()
            optimizer.step()
            return loss

        return step

    def ddp_step(model):
        optimizer = adamw(model.parameters())

        def step():
            optimizer.zero_grad(set_to_none=True)
            last = len(mine) - 1
            loss = accumulate(
                model, mine, before=lambda i: nullcontext() if i == last else model.no_sync()
            )
            optimizer.step()
            return loss

        return step

    sides = {name: (ddp_step if name == "DDP" else ours_step)(m) for name, m in models.items()}
    for step in sides.values():
        step()
    reference = {name: p.grad for name, p in models["DDP"].module.named_parameters()}
    diffs = {name: all_ranks_max(max_grad_difference(models[name].module, reference))
             for name in ("bucketed", "naive")}  # fmt: skip
    times, _ = alternate(sides, args, device)
    return [
        row(f"data parallel, dp {world}", name, "DDP", times, [("grad", diffs[name], 1e-6)])
        for name in ("bucketed", "naive")
    ]


def compare_tp(args, device):
    """Our tensor parallelism (step 4) against DTensor's ColwiseParallel/RowwiseParallel on the
    same model, both with the vocabulary sharded (embedding, lm_head and the loss)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    model_module = import_step("step4_tensor_parallel", "model")
    tensor_parallel = import_step("step4_tensor_parallel", "tensor_parallel")
    world, group = dist.get_world_size(), dist.group.WORLD
    config = load_config(args)
    inputs, targets = make_batch(config, args, device)
    pairs = split(inputs, targets, args.micro_batches)

    with torch.device("meta"):
        ours = tensor_parallel.apply_tensor_parallel(model_module.LlamaForCausalLM(config), group)
    ours.to_empty(device=device)
    ours.init_weights(args.seed)

    theirs = replica(model_module, config, args, device)
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(config.num_hidden_layers):
        for name, style in tensor_parallel.PLAN.items():
            colwise = style is tensor_parallel.ColumnParallelLinear
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel() if colwise else RowwiseParallel()
    mesh = init_device_mesh(device.type, (world,))
    parallelize_module(theirs, mesh, plan)

    def training_step(model, loss_fn, context):
        # The fused AdamW takes DTensors or plain tensors, not both in one call: DTensor's plan
        # leaves the RMSNorm weights plain, so they get an optimizer of their own.
        params = list(model.parameters())
        kinds = [[p for p in params if isinstance(p, DTensor)]]
        kinds += [[p for p in params if not isinstance(p, DTensor)]]
        optimizers = [adamw(kind) for kind in kinds if kind]

        def step():
            model.zero_grad(set_to_none=True)
            with context():
                loss = accumulate(model, pairs, loss_fn)
            for optimizer in optimizers:
                optimizer.step()
            return loss

        return step

    ours_loss = lambda logits, y: tensor_parallel.vocab_parallel_cross_entropy(logits, y, group)
    sides = {
        "ours": training_step(ours, ours_loss, nullcontext),
        "DTensor": training_step(theirs, cross_entropy, loss_parallel),
    }
    for step in sides.values():
        step()
    times, losses = alternate(sides, args, device)
    diff = all_ranks_max(loss_difference(losses, "ours", "DTensor"))
    return [row(f"tensor parallel, tp {world}", "ours", "DTensor", times, [("loss", diff, 1e-5)])]


def compare_pp(args, device):
    """Our AFAB and 1F1B (step 8) against torch.distributed.pipelining's Schedule1F1B, each stage
    the same slice of the model (keep_stage), all the micro-batches of the batch."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model_module = import_step("step8_pipeline_parallel_1f1b", "model")
    pipeline = import_step("step8_pipeline_parallel_1f1b", "pipeline_parallel")
    pgm_module = import_step("step8_pipeline_parallel_1f1b", "process_group_manager")
    world = dist.get_world_size()
    pgm = pgm_module.ProcessGroupManager(tp_size=1, pp_size=world, dp_size=1)
    config = load_config(args)
    inputs, targets = make_batch(config, args, device)
    m = args.micro_batches
    pairs = split(inputs, targets, m)
    shape = (args.micro_batch_size, args.seq_len, config.hidden_size)  # (B, T, D) between stages

    def stage():
        with torch.device("meta"):
            model = pipeline.keep_stage(model_module.LlamaForCausalLM(config), pgm)
        model.to_empty(device=device)
        model.init_weights(args.seed)
        return pipeline.PipelineParallel(model)

    def ours_step(model, schedule_fn):
        optimizer = adamw(model.parameters())

        def step():
            optimizer.zero_grad(set_to_none=True)
            args_ = (model, pairs, cross_entropy, shape, pgm, device, torch.float32)
            loss = schedule_fn(*args_, pipeline.Schedule())
            optimizer.step()
            return loss

        return step

    theirs = stage()
    # Schedule1F1B cuts the batch into m micro-batches itself (along dim 0, as chunk does),
    # sums the micro-batches' gradients and divides them by m at the end.
    schedule = Schedule1F1B(PipelineStage(theirs, pgm.pp_rank, world, device), m, cross_entropy)
    theirs_optimizer = adamw(theirs.parameters())

    def theirs_step():
        theirs_optimizer.zero_grad(set_to_none=True)
        losses = []
        if pgm.pp_is_first_stage:
            schedule.step(inputs, return_outputs=False)
        else:
            schedule.step(target=targets, losses=losses, return_outputs=False)
        theirs_optimizer.step()
        return (sum(losses) / m).detach() if losses else torch.zeros(())

    models = {"1F1B": stage(), "AFAB": stage()}
    sides = {
        "1F1B": ours_step(models["1F1B"], pipeline.train_step_1f1b),
        "AFAB": ours_step(models["AFAB"], pipeline.train_step_afab),
        "Schedule1F1B": theirs_step,
    }
    for step in sides.values():
        step()
    reference = {name: p.grad for name, p in theirs.named_parameters()}
    diffs = {name: all_ranks_max(max_grad_difference(models[name], reference))
             for name in ("1F1B", "AFAB")}  # fmt: skip
    times, losses = alternate(sides, args, device)
    part = f"pipeline, pp {world}, m {m}"
    return [
        row(part, name, "Schedule1F1B", times, [("grad", diffs[name], 1e-6)])
        for name in ("1F1B", "AFAB")
    ]


PARTS = {"model": compare_model, "dp": compare_dp, "tp": compare_tp, "pp": compare_pp}
