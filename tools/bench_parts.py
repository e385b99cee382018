"""The comparisons of tools/bench.py. Each builds our implementation and PyTorch's (or
transformers') from the same initial weights, runs one training step of each and checks that they
agree, then times their steps in turn (fwd + bwd + AdamW over the same global batch).

Our code comes from the step that introduces it: the model from step 1, naive and bucketed data
parallelism from step 6, tensor parallelism from step 4, both pipeline schedules from step 8,
ZeRO-1 from step 10, ring attention from step 11 (whose step is one attention's forward and
backward, no optimizer); the KV cache from step 3, whose step is a greedy generation.
"""

# B micro-batch, T tokens, V vocab, H query heads, K key/value heads, d head dim

import argparse
import contextlib
import importlib
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from steps import STEPS, step_modules

ROOT = Path(__file__).resolve().parents[1]
STEP_MODULES = step_modules(ROOT)
OVERRIDES = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
]


def part_step(part):
    """The folder of the step whose technique the bench part measures (tools/steps.py)."""
    return next(step.folder for step in STEPS if part in step.bench)


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
    long as its slowest rank. Returns each side's median step time (ms), wall-clock and this
    process's CPU time (its slowest rank's; on a machine that other jobs share the CPU time
    moves less), and its losses."""
    names = list(sides)
    distributed = dist.is_initialized()
    times = torch.zeros(args.steps, len(names), 2, dtype=torch.float64)  # wall, CPU
    losses = {name: [] for name in names}
    for step in range(args.warmup + args.steps):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            if distributed:
                dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = sides[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= args.warmup:
                spent = [time.perf_counter() - start, time.process_time() - start_cpu]
                times[step - args.warmup, names.index(name)] = torch.tensor(spent)
            losses[name].append(float(loss))
    if distributed:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    medians = {
        n: [1e3 * statistics.median(times[:, i, kind].tolist()) for kind in range(2)]
        for i, n in enumerate(names)
    }
    return medians, losses


def loss_difference(losses, ours, theirs):
    """The largest relative difference of two sides' losses, step by step."""
    pairs = zip(losses[ours], losses[theirs], strict=True)
    return max(abs(a - b) / abs(b) for a, b in pairs)


def row(part, ours, theirs, times, checks):
    """One line of the table; `checks` is a list of (what, measured, tolerance)."""
    return {"part": part, "ours": ours, "theirs": theirs, "ours_ms": times[ours][0],
            "theirs_ms": times[theirs][0], "ours_cpu_ms": times[ours][1],
            "theirs_cpu_ms": times[theirs][1], "checks": checks}  # fmt: skip


def compare_model(args, device):
    """Our model against transformers' LlamaForCausalLM, one device, the same weights."""
    import transformers

    ours_module = import_step(part_step("model"), "model")
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


def compare_kv_cache(args, device):
    """Generation with our KV cache (step 3's kv_cache.py) against our model recomputing the
    prefix at every token, and against transformers' generate with its own cache: --seq_len
    tokens after an 8-token prompt, the likeliest each time, the same weights."""
    import transformers

    model_lib = import_step(part_step("kv_cache"), "model")
    kv_cache = import_step(part_step("kv_cache"), "kv_cache").kv_cache
    config = load_config(args)
    ours = model_lib.LlamaForCausalLM(config).to(device).eval()
    ours.init_weights(args.seed)
    theirs = transformers.LlamaForCausalLM(config).to(device).eval()
    theirs.load_state_dict(ours.state_dict())
    prompt = make_batch(config, args, device)[0][:1, :8]  # (1, 8)
    tokens = {}

    @torch.no_grad()
    def generate(name, cached):
        def run():
            ids = new = prompt
            with kv_cache(ours) if cached else contextlib.nullcontext():
                for _ in range(args.seq_len):
                    new = ours(new if cached else ids)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
                    ids = torch.cat([ids, new], dim=1)
            tokens[name] = ids
            return 0.0

        return run

    @torch.no_grad()
    def transformers_generate():
        mask = torch.ones_like(prompt)
        tokens["transformers"] = theirs.generate(
            prompt, attention_mask=mask, max_new_tokens=args.seq_len, min_new_tokens=args.seq_len,
            do_sample=False, use_cache=True, pad_token_id=0,
        )  # fmt: skip
        return 0.0

    sides = {"cached": generate("cached", True), "recompute": generate("recompute", False)}
    sides["transformers"] = transformers_generate
    times, _ = alternate(sides, args, device)
    differ = {n: (tokens["cached"] != tokens[n]).float().mean().item() for n in sides}
    return [
        row("kv cache, generation", "cached", theirs, times, [("tokens", differ[theirs], 0)])
        for theirs in ("recompute", "transformers")
    ]


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
    """Naive (step 5) and bucketed (step 6) data parallelism against DistributedDataParallel:
    each rank takes every dp_size-th micro-batch of the batch and accumulates them."""
    from torch.nn.parallel import DistributedDataParallel

    naive = import_step("step5_data_parallel_naive", "data_parallel").DataParallelNaive
    model_module = import_step(part_step("dp"), "model")
    data_parallel = import_step(part_step("dp"), "data_parallel")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = load_config(args)
    inputs, targets = make_batch(config, args, device)
    pairs = split(inputs, targets, args.micro_batches)
    mine = pairs[rank::world]
    group = dist.group.WORLD
    new = lambda: replica(model_module, config, args, device)
    models = {
        "bucketed": data_parallel.DataParallelBucket(new(), group),
        "naive": naive(new(), group),
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

    model_module = import_step(part_step("tp"), "model")
    tensor_parallel = import_step(part_step("tp"), "tensor_parallel")
    comm_stats = import_step(part_step("tp"), "comm_stats")
    world, group = dist.get_world_size(), dist.group.WORLD
    config = load_config(args)
    inputs, targets = make_batch(config, args, device)
    pairs = split(inputs, targets, args.micro_batches)

    def build():
        with torch.device("meta"):
            model = model_module.LlamaForCausalLM(config)
            tensor_parallel.apply_tensor_parallel(model, group)
        model.to_empty(device=device)
        model.init_weights(args.seed)
        return model

    ours, before = build(), build()
    # How the column-parallel layers communicated before: each its own f on its input (q, k, v,
    # gate, up and lm_head), instead of one f per sublayer on the norm's output.
    f = tensor_parallel.Copy.apply
    for module in before.modules():
        module._forward_hooks.clear()
        if isinstance(module, tensor_parallel.ColumnParallelLinear):
            module.forward = lambda x, m=module: F.linear(f(x, m.group), m.weight)

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
        "f per layer": training_step(before, ours_loss, nullcontext),
    }
    traffic = {}
    for name, step in sides.items():
        with comm_stats.CommStats() as stats:
            step()
        kinds = [kind for group_kinds in stats.as_dict().values() for kind in group_kinds.values()]
        traffic[name] = sum(k["calls"] for k in kinds), sum(k["bytes"] for k in kinds)
    times, losses = alternate(sides, args, device)
    diff = all_ranks_max(loss_difference(losses, "ours", "DTensor"))
    before_diff = all_ranks_max(loss_difference(losses, "ours", "f per layer"))
    (calls, size), (calls_before, size_before) = traffic["ours"], traffic["f per layer"]
    label = (
        f"tensor parallel traffic, tp {world}: {calls} calls, {size:,} bytes a step against "
        f"{calls_before}, {size_before:,}"
    )
    traffic_row = row(label, "ours", "f per layer", times, [("loss", before_diff, 1e-5)])
    traffic_row["traffic"] = traffic
    return [
        row(f"tensor parallel, tp {world}", "ours", "DTensor", times, [("loss", diff, 1e-5)]),
        traffic_row,
    ]


def compare_sp(args, device):
    """Our sequence parallelism (step 13) against DTensor's plan for it, torchtitan's, on the same
    model: the embedding and the row-parallel layers give Shard(1) (reduce-scatter), the norms are
    `SequenceParallel`, attention and the MLP gather their input (`PrepareModuleInput`), lm_head
    gathers its input and keeps the vocabulary sharded for `loss_parallel`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    sequence_parallel = import_step(part_step("sp"), "sequence_parallel")
    model_module, tensor_parallel = sys.modules["model"], sys.modules["tensor_parallel"]
    world, group = dist.get_world_size(), dist.group.WORLD
    config = load_config(args)
    inputs, targets = make_batch(config, args, device)
    pairs = split(inputs, targets, args.micro_batches)

    with torch.device("meta"):
        ours = model_module.LlamaForCausalLM(config)
        tensor_parallel.apply_tensor_parallel(ours, group)
        sequence_parallel.apply_sequence_parallel(ours)
    ours.to_empty(device=device)
    ours.init_weights(args.seed)

    theirs = replica(model_module, config, args, device)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    to_sequence = dict(output_layouts=Shard(1), use_local_output=False)
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), **to_sequence),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        plan |= {f"{layer}.self_attn": gather, f"{layer}.mlp": gather}
        for norm in ["input_layernorm", "post_attention_layernorm"]:
            plan[f"{layer}.{norm}"] = SequenceParallel()
        for name, style in tensor_parallel.PLAN.items():
            colwise = style is tensor_parallel.ColumnParallelLinear
            style = ColwiseParallel() if colwise else RowwiseParallel(**to_sequence)
            plan[f"{layer}.{name}"] = style
    mesh = init_device_mesh(device.type, (world,))
    parallelize_module(theirs, mesh, plan)

    def training_step(model, loss_fn, context):
        optimizer = adamw(model.parameters())  # DTensor's plan makes every parameter a DTensor

        def step():
            model.zero_grad(set_to_none=True)
            with context():
                loss = accumulate(model, pairs, loss_fn)
            optimizer.step()
            return loss

        return step

    ours_loss = lambda logits, y: tensor_parallel.vocab_parallel_cross_entropy(logits, y, group)
    sides = {
        "ours": training_step(ours, ours_loss, nullcontext),
        "DTensor": training_step(theirs, cross_entropy, loss_parallel),
    }
    times, losses = alternate(sides, args, device)
    diff = all_ranks_max(loss_difference(losses, "ours", "DTensor"))
    return [row(f"sequence parallel, tp {world}", "ours", "DTensor", times, [("loss", diff, 1e-5)])]


def compare_pp(args, device):
    """Our AFAB and 1F1B (step 8) against torch.distributed.pipelining's Schedule1F1B, each stage
    the same slice of the model (keep_stage), all the micro-batches of the batch."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model_module = import_step(part_step("pp"), "model")
    pipeline = import_step(part_step("pp"), "pipeline_parallel")
    pgm_module = import_step(part_step("pp"), "process_group_manager")
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

    def ours_step(model, engine):
        optimizer = adamw(model.parameters())
        actions = pipeline.SCHEDULES[engine](world, m)[pgm.pp_rank]

        def step():
            optimizer.zero_grad(set_to_none=True)
            stages = [pipeline.Stage(model, pgm)]
            args_ = (actions, stages, pairs, cross_entropy, shape, device, torch.float32)
            loss = pipeline.run_schedule(*args_)
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
        "1F1B": ours_step(models["1F1B"], "1f1b"),
        "AFAB": ours_step(models["AFAB"], "afab"),
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


def compare_interleaved(args, device):
    """Our interleaved 1F1B (step 14) against torch.distributed.pipelining's
    ScheduleInterleaved1F1B: two chunks of layers per rank (keep_stage with 2 chunks), each chunk
    one PipelineStage of theirs, all the micro-batches of the batch."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    return compare_schedule(args, device, "interleaved", 2, ScheduleInterleaved1F1B)


def compare_zb1(args, device):
    """Our ZB-H1 (step 14: the backward split by zero_bubble.py's layers) against
    torch.distributed.pipelining's ScheduleInterleavedZeroBubble with one stage per rank (its
    ZB1P, the same order), which splits the backward with autograd on the plain model."""
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

    return compare_schedule(args, device, "zb1", 1, ScheduleInterleavedZeroBubble)


def compare_schedule(args, device, engine, chunks, schedule_class):
    """Step 14's `engine` with `chunks` chunks of layers per rank against torch's
    `schedule_class` on the same chunks, each one PipelineStage of theirs, all the micro-batches
    of the batch. Where our schedule splits the backward, our model's layers are step 14's
    (tensor-parallel layers of one rank, which defer their weight gradients); theirs is the
    plain model."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    model_module = import_step(part_step(engine), "model")
    pipeline = import_step(part_step(engine), "pipeline_parallel")
    pgm_module = sys.modules["process_group_manager"]  # the one pipeline_parallel imported
    tensor_parallel, zero_bubble = sys.modules["tensor_parallel"], sys.modules["zero_bubble"]
    world = dist.get_world_size()
    pgm = pgm_module.ProcessGroupManager(tp_size=1, pp_size=world, dp_size=1)
    config = load_config(args)
    inputs, targets = make_batch(config, args, device)
    m = args.micro_batches
    pairs = split(inputs, targets, m)
    shape = (args.micro_batch_size, args.seq_len, config.hidden_size)  # (B, T, D) between stages
    pipeline.check_pipeline_parallel(config, world, chunks)  # a layer at least per chunk
    layers = pipeline.rank_chunks(config.num_hidden_layers, pgm.pp_rank, world, chunks)

    def stage(split=False):
        with torch.device("meta"):
            model = model_module.LlamaForCausalLM(config)
            if split:
                tensor_parallel.apply_tensor_parallel(model, pgm.tp_group)
                zero_bubble.apply_zero_bubble(model)
            pipeline.keep_stage(model, pgm, chunks)
        model.to_empty(device=device)
        model.init_weights(args.seed)
        return pipeline.PipelineParallel(model, layers)

    class Chunk(nn.Module):
        """One of the rank's chunks for torch: its own modules only, so that each PipelineStage
        scales (divides by m) its own parameters' gradients once."""

        def __init__(self, stage, chunk):
            super().__init__()
            self.run = lambda x: stage(x, chunk)  # a function, not a submodule
            inner, last = stage.model.model, chunk == len(stage.chunks) - 1
            self.layers = nn.ModuleList(inner.layers[name] for name in stage.chunks[chunk])
            if chunk == 0 and inner.embed_tokens is not None:
                self.embed_tokens = inner.embed_tokens
            if last and stage.model.lm_head is not None:
                self.norm, self.lm_head = inner.norm, stage.model.lm_head

        def forward(self, x):
            return self.run(x)

    ours = stage(split=engine in pipeline.SPLIT_BACKWARD)
    ours_optimizer = adamw(ours.parameters())
    actions = pipeline.SCHEDULES[engine](world, m, chunks)[pgm.pp_rank]
    gradients = pipeline.gradient_group(pgm)

    def ours_step():
        ours_optimizer.zero_grad(set_to_none=True)
        stages = [pipeline.Stage(ours, pgm, c, chunks, gradients) for c in range(chunks)]
        args_ = (actions, stages, pairs, cross_entropy, shape, device, torch.float32)
        loss = pipeline.run_schedule(*args_)
        ours_optimizer.step()
        return loss

    theirs = stage()
    torch_stages = [
        PipelineStage(Chunk(theirs, c), c * world + pgm.pp_rank, world * chunks, device)
        for c in range(chunks)
    ]
    # The schedule cuts the batch into m micro-batches itself, sums the micro-batches' gradients
    # and divides them by m at the end.
    schedule = schedule_class(torch_stages, m, cross_entropy)
    theirs_optimizer = adamw(theirs.parameters())

    def theirs_step():
        theirs_optimizer.zero_grad(set_to_none=True)
        losses = []
        if pgm.pp_is_first_stage:
            schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
        else:
            schedule.step(target=targets, losses=losses, return_outputs=False)
        theirs_optimizer.step()
        return (sum(losses) / m).detach() if losses else torch.zeros(())

    theirs_name = schedule_class.__name__
    sides = {engine: ours_step, theirs_name: theirs_step}
    for step in sides.values():
        step()
    reference = {name: p.grad for name, p in theirs.named_parameters()}
    diff = all_ranks_max(max_grad_difference(ours, reference))
    times, losses = alternate(sides, args, device)
    part = f"{engine} pipeline, pp {world}" + (f" x {chunks} chunks" if chunks > 1 else "")
    return [row(f"{part}, m {m}", engine, theirs_name, times, [("grad", diff, 1e-6)])]


def compare_zero(args, device):
    """ZeRO-1 (step 10's DataParallelZero1: buckets reduce-scattered during backward, AdamW on
    this rank's shard, the parameters all-gathered after the step) against PyTorch's
    ZeroRedundancyOptimizer over DDP (the optimizer state sharded by whole parameters, each
    rank's updated ones broadcast) and FSDP2 (`fully_shard` on every layer and the model,
    parameters kept whole from forward to backward, gradients reduce-scattered once, on the last
    micro-batch, AdamW on the shards). Each rank takes every dp_size-th micro-batch."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model_module = import_step(part_step("zero"), "model")
    zero = import_step(part_step("zero"), "zero")
    pgm_module = import_step(part_step("zero"), "process_group_manager")
    rank, world = dist.get_rank(), dist.get_world_size()
    pgm = pgm_module.ProcessGroupManager(tp_size=1, pp_size=1, dp_size=world)
    config = load_config(args)
    inputs, targets = make_batch(config, args, device)
    mine = split(inputs, targets, args.micro_batches)[rank::world]
    new = lambda: replica(model_module, config, args, device)
    last = len(mine) - 1

    ours = zero.DataParallelZero1(new(), pgm, ("dp",))
    ours_optimizer = adamw(ours.shard(list(ours.module.parameters())))
    ddp = DistributedDataParallel(new())
    zero_optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
        fused=True,
    )  # fmt: skip
    fsdp = new()
    for layer in fsdp.model.layers:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(fsdp, reshard_after_forward=False)
    fsdp_optimizer = adamw(fsdp.parameters())

    def ours_backward():
        ours.zero_grad(set_to_none=True)

        def sync_on_last(i):
            ours.require_backward_grad_sync = i == last
            return nullcontext()

        loss = accumulate(ours, mine, before=sync_on_last)
        ours.finish_gradient_synchronization()
        return loss

    def ours_step():
        loss = ours_backward()
        ours_optimizer.step()
        ours.all_gather_parameters()
        return loss

    def zero_step():
        zero_optimizer.zero_grad(set_to_none=True)
        loss = accumulate(ddp, mine, before=lambda i: nullcontext() if i == last else ddp.no_sync())
        zero_optimizer.step()
        return loss

    def fsdp_step():
        fsdp_optimizer.zero_grad(set_to_none=True)

        def sync_on_last(i):
            fsdp.set_requires_gradient_sync(i == last)
            return nullcontext()

        loss = accumulate(fsdp, mine, before=sync_on_last)
        fsdp_optimizer.step()
        return loss

    # The first step, checked: our shard of each averaged gradient against DDP's whole one (the
    # all-gather after the update overwrites the buffers, so ours is read before it), FSDP2's
    # gathered gradients against DDP's too; then the parameters after the update.
    ours_backward()
    zero_step()
    fsdp_step()
    reference = dict(ddp.module.named_parameters())
    names = {param: name for name, param in ours.module.named_parameters()}
    scale = max(p.grad.abs().max().item() for p in reference.values())
    ours_grad = 0.0
    for bucket in ours.bucket_manager.buckets:
        for param, first, lo, hi in bucket.in_shard():
            want = reference[names[param]].grad.view(-1)[first : first + hi - lo]
            ours_grad = max(ours_grad, (bucket.grad_data[lo:hi] - want).abs().max().item())
    fsdp_grads = gathered_grads(fsdp)
    fsdp_grad = max((fsdp_grads[n] - p.grad).abs().max().item() for n, p in reference.items())
    ours_optimizer.step()
    ours.all_gather_parameters()

    def param_difference(model):
        diff, size = 0.0, 0.0
        for name, param in model.named_parameters():
            param = param.full_tensor() if hasattr(param, "full_tensor") else param
            diff = max(diff, (param - reference[name]).abs().max().item())
            size = max(size, reference[name].abs().max().item())
        return diff / size

    ours_param = all_ranks_max(param_difference(ours.module))
    fsdp_param = all_ranks_max(param_difference(fsdp))
    ours_grad, fsdp_grad = all_ranks_max(ours_grad / scale), all_ranks_max(fsdp_grad / scale)
    sides = {"ours": ours_step, "ZeroRedundancyOptimizer": zero_step, "FSDP2": fsdp_step}
    times, _ = alternate(sides, args, device)
    part = f"ZeRO-1, dp {world}, m {args.micro_batches}"
    ours_checks = [("grad", ours_grad, 1e-6), ("param", ours_param, 1e-6)]
    return [
        row(part, "ours", "ZeroRedundancyOptimizer", times, ours_checks),
        row(part, "ours", "FSDP2", times, [*ours_checks, ("grad FSDP2", fsdp_grad, 1e-6),
                                           ("param FSDP2", fsdp_param, 1e-6)]),
    ]  # fmt: skip


### begin Ring attention
class GatherKV(torch.autograd.Function):
    """Every rank's keys and values, (B, K, T, d) each, side by side along the tokens, rank by
    rank: one all-gather forward, one reduce-scatter of their gradients backward."""

    @staticmethod
    def forward(ctx, k, v, group):
        world = dist.get_world_size(group)
        mine = torch.stack([k, v])  # (2, B, K, T, d)
        gathered = mine.new_empty(world * 2, *mine.shape[1:])  # rank by rank, k and v
        dist.all_gather_single(gathered, mine, group)
        ctx.group = group
        both = gathered.unflatten(0, (world, 2)).movedim(0, -3).flatten(-3, -2)
        # (2, B, K, world * T, d)
        return both[0], both[1]

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        world = dist.get_world_size(ctx.group)
        grads = torch.stack([grad_k, grad_v]).unflatten(-2, (world, -1)).movedim(-3, 0)
        mine = grads.new_empty(grads.shape[1:])  # (2, B, K, T, d)
        dist.reduce_scatter_single(mine, grads.flatten(0, 1).contiguous(), group=ctx.group)
        return mine[0], mine[1], None


class TorchRing(torch.autograd.Function):
    """PyTorch's own ring attention, `_templated_ring_attention` and its backward (what its
    `context_parallel` dispatches SDPA to), on the CPU flash kernel or CUDA's efficient one,
    with its load balancing: each rank holds chunks r and 2 cp - 1 - r, as ours."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        from torch.distributed.tensor.experimental._context_parallel import _attention

        aten = torch.ops.aten
        kwargs = {"is_causal": True}
        if q.device.type == "cuda":
            op = aten._scaled_dot_product_efficient_attention
            kwargs |= {"attn_bias": None, "compute_log_sumexp": True}
        else:
            op = aten._scaled_dot_product_flash_attention_for_cpu
        out, lse, *rest = _attention._templated_ring_attention(group, 2, op, q, k, v, **kwargs)
        ctx.save_for_backward(q, k, v, out, lse, *rest)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from torch.distributed.tensor.experimental._context_parallel import _attention

        aten = torch.ops.aten
        q, k, v, out, lse, *rest = ctx.saved_tensors
        kwargs = {"is_causal": True, "dropout_p": 0.0}
        if q.device.type == "cuda":
            op, name = aten._scaled_dot_product_efficient_attention_backward.default, "grad_out_"
            seed, offset = rest
            kwargs |= {"attn_bias": None, "philox_seed": seed, "philox_offset": offset}
            kwargs |= {"grad_input_mask": (True, True, True, False)}
        else:
            op, name = aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "grad_out"
        grads = _attention._templated_ring_attention_backward(
            ctx.group, 2, op, grad_out, name, q, k, v, out, lse, **kwargs
        )
        return *grads[:3], None


def compare_cp(args, device):
    """Ring attention (step 11) against two others, the same causal attention of a whole
    sequence split over cp ranks (2 chunks each, balanced): an all-gather of the keys and values
    and one fused SDPA call (what a rank does without a ring: it holds every key and value, and
    its mask makes the kernel compute the blocks that the causal mask hides), and PyTorch's
    private `_templated_ring_attention`. A step is the attention's forward and backward."""
    context_parallel = import_step(part_step("cp"), "context_parallel")
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    config = load_config(args)
    B, T, d = args.micro_batch_size, args.seq_len, config.head_dim
    H, K = config.num_attention_heads, config.num_key_value_heads
    assert T % (2 * world) == 0, "bench.parse_args checks --seq_len"
    generator = torch.Generator().manual_seed(args.seed)
    whole = [torch.randn(B, n, T, d, generator=generator) for n in (H, K, K, H)]  # q, k, v, dO
    mine = lambda x: context_parallel.split_sequence(x, rank, world, dim=2)
    q, k, v, grad_out = (mine(x).to(device) for x in whole)

    # The reference: float64 SDPA over the whole sequence, this rank's part of its results.
    exact = [x.double().requires_grad_() for x in whole[:3]]
    want = F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=True)
    want.backward(whole[3].double())
    want = [mine(x).to(device) for x in (want, *(x.grad for x in exact))]

    positions = torch.arange(T, device=device)
    query_positions = context_parallel.split_sequence(positions, rank, world, dim=0)
    key_positions = torch.cat(
        [context_parallel.split_sequence(positions, r, world, dim=0) for r in range(world)]
    )  # the gathered keys' positions, rank by rank
    visible = key_positions <= query_positions.unsqueeze(1)  # (T/cp, T)

    def all_gather_kv(q, k, v):
        keys, values = GatherKV.apply(k, v, group)  # (B, K, T, d)
        return F.scaled_dot_product_attention(q, keys, values, visible, enable_gqa=True)

    def ring(q, k, v):
        return context_parallel.RingAttention.apply(q, k, v, group)

    def torch_ring(q, k, v):
        return TorchRing.apply(q, k, v, group)

    functions = {"ours": ring, "all-gather KV": all_gather_kv}
    functions["_templated_ring_attention"] = torch_ring
    leaves = {name: [x.clone().requires_grad_() for x in (q, k, v)] for name in functions}

    def attention_step(name):
        def step():
            for x in leaves[name]:
                x.grad = None
            out = functions[name](*leaves[name])
            out.backward(grad_out)
            return out.detach()[(0,) * out.dim()]  # a number: no pass over the output

        return step

    def difference(name, label):
        """The largest |Δ| of the output and of the q, k and v gradients, each relative to the
        reference's largest entry, over the ranks."""
        with torch.no_grad():
            got = [functions[name](*leaves[name]), *(x.grad for x in leaves[name])]
        pairs = zip(got, want, strict=True)
        diffs = [(a.double() - b).abs().max() / b.abs().max() for a, b in pairs]
        return (label, all_ranks_max(max(diffs)), 1e-5)

    sides = {name: attention_step(name) for name in functions}
    for step in sides.values():  # one step each; the gradients stay until the next step
        step()
    ours = difference("ours", " ours")  # out, dq, dk, dv against float64
    times, _ = alternate(sides, args, device)
    part = f"ring attention, cp {world}, {T:,} tokens, {H}/{K} heads x {d}"
    return [
        row(part, "ours", theirs, times, [ours, difference(theirs, " theirs")])
        for theirs in ["_templated_ring_attention", "all-gather KV"]
    ]


### end Ring attention
def compare_zero3(args, device):
    """ZeRO-3 (step 12's FullyShardedDataParallel: each parameter's rows cut over dp, each layer
    gathered around its forward and again for its backward, its gradient reduce-scattered as soon
    as backward completes it, the next layer's gather in flight meanwhile) against FSDP2
    (`fully_shard` on every layer and the model, resharded after forward: the same stage 3).
    Both reduce-scatter every micro-batch's gradients (FSDP2 told to sync on each) and run AdamW
    on their shards. Each rank takes every dp_size-th micro-batch."""
    from torch.distributed.fsdp import fully_shard

    step = part_step("zero3")
    model_module = import_step(step, "model")
    fully_sharded = import_step(step, "fully_sharded")
    pipeline = import_step(step, "pipeline_parallel")
    pgm_module = import_step(step, "process_group_manager")
    rank, world = dist.get_rank(), dist.get_world_size()
    pgm = pgm_module.ProcessGroupManager(tp_size=1, pp_size=1, dp_size=world)
    config = load_config(args)
    inputs, targets = make_batch(config, args, device)
    mine = split(inputs, targets, args.micro_batches)[rank::world]

    with torch.device("meta"):  # as step 12's build_model: the pieces only, then the seed's
        sharded = model_module.LlamaForCausalLM(config)
        pipeline.keep_stage(sharded, pgm)
        fully_sharded.shard_parameters(sharded, pgm, ("dp",))
    sharded.to_empty(device=device)
    sharded.tie_weights()
    sharded.init_weights(args.seed)
    ours = fully_sharded.FullyShardedDataParallel(
        pipeline.PipelineParallel(sharded), sharded, pgm, ("dp",)
    )
    ours_optimizer = adamw(ours.shard(list(sharded.parameters())))
    fsdp = replica(model_module, config, args, device)
    for layer in fsdp.model.layers:
        fully_shard(layer)
    fully_shard(fsdp)
    fsdp_optimizer = adamw(fsdp.parameters())

    def ours_backward():
        ours_optimizer.zero_grad(set_to_none=True)
        loss = accumulate(ours, mine)
        ours.finish_gradient_synchronization()
        return loss

    def fsdp_backward():
        fsdp_optimizer.zero_grad(set_to_none=True)
        return accumulate(fsdp, mine)

    def ours_step():
        loss = ours_backward()
        ours_optimizer.step()
        return loss

    def fsdp_step():
        loss = fsdp_backward()
        fsdp_optimizer.step()
        return loss

    def difference(what):
        """The largest |Δ| between this rank's rows of every parameter's `what` (its gradient or
        itself), ours against FSDP2's, relative to FSDP2's largest, over the ranks."""
        get = (lambda p: p.grad) if what == "grad" else (lambda p: p.detach())
        theirs = {name: get(p).full_tensor() for name, p in fsdp.named_parameters()}
        diff, size = 0.0, max(t.abs().max().item() for t in theirs.values())
        for placed in fully_sharded.placed_parameters(sharded):
            full = theirs[placed.name]
            rows = full.shape[0] // world
            piece = full[rank * rows : (rank + 1) * rows]
            diff = max(diff, (get(placed.param) - piece).abs().max().item())
        return (f" {what}", all_ranks_max(diff / size), 1e-6)

    # The first step, checked: each rank's rows of every averaged gradient, then of every
    # parameter after the update, ours against FSDP2's.
    ours_backward()
    fsdp_backward()
    check = [difference("grad")]
    ours_optimizer.step()
    fsdp_optimizer.step()
    check.append(difference("param"))
    sides = {"ours": ours_step, "FSDP2": fsdp_step}
    times, losses = alternate(sides, args, device)
    check.append((" loss", loss_difference(losses, "ours", "FSDP2"), 1e-5))
    part = f"ZeRO-3, dp {world}, {args.micro_batches} micro-batches"
    return [row(part, "ours", "FSDP2", times, check)]


def compare_ep(args, device):
    """Expert parallelism's exchange (step 15) against the same exchange through PyTorch's
    all-to-all with autograd (`all_to_all_single_autograd`, torch.distributed's functional
    collectives, which torchtitan's expert parallelism uses): one MoE layer, E/ep experts per
    rank, each rank its own tokens. A step is the layer's forward and backward. Both are held to
    the layer with every expert on one rank (its experts' gradients summed over the ranks)."""
    from functools import partial

    from torch.distributed._functional_collectives import all_to_all_single_autograd

    step = part_step("ep")
    moe, expert_parallel = import_step(step, "moe"), import_step(step, "expert_parallel")
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    config = load_config(args)
    if not getattr(config, "num_local_experts", 0):  # a dense --model_name: tiny's MoE
        config = load_config(argparse.Namespace(**{**vars(args), "model_name": "tiny-moe"}))
    E, D = config.num_local_experts, config.hidden_size
    torch.manual_seed(args.seed)  # the same layer on every rank
    whole = moe.MixtureOfExperts(config, range(E)).to(device)
    for param in whole.parameters():
        torch.nn.init.normal_(param, std=config.initializer_range)
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its tokens
    x = torch.randn(args.micro_batch_size, args.seq_len, D, generator=generator).to(device)
    grad_out = torch.randn(x.shape, generator=generator).to(device)

    # The reference: every expert on this rank, each expert's gradient over every rank's tokens.
    x_ref = x.clone().requires_grad_()
    whole(x_ref).backward(grad_out)
    want = {name: param.grad.clone() for name, param in whole.named_parameters()}
    for name, grad in want.items():
        if name.startswith("experts."):
            dist.all_reduce(grad)
    want["input"] = x_ref.grad

    def torch_all_to_all(rows, receive, send, group):
        return all_to_all_single_autograd(rows, receive, send, group)

    def exchange_theirs(group, layer, rows, counts):
        saved = expert_parallel.AllToAll.apply
        expert_parallel.AllToAll.apply = torch_all_to_all
        try:
            return expert_parallel.exchange(group, layer, rows, counts)
        finally:
            expert_parallel.AllToAll.apply = saved

    mine = range(rank * E // world, (rank + 1) * E // world)
    layers, leaves = {}, {}
    for name, exchange in [("ours", expert_parallel.exchange), ("theirs", exchange_theirs)]:
        layer = moe.MixtureOfExperts(config, mine).to(device)
        kept = layer.state_dict().keys()
        layer.load_state_dict({k: v for k, v in whole.state_dict().items() if k in kept})
        layer.exchange = partial(exchange, group)
        layers[name], leaves[name] = layer, x.clone().requires_grad_()
    names = {"ours": "ours", "theirs": "all_to_all_single_autograd"}

    def layer_step(name):
        def run():
            leaves[name].grad = None
            layers[name].zero_grad(set_to_none=True)
            out = layers[name](leaves[name])
            out.backward(grad_out)
            return out.detach()[0, 0, 0]

        return run

    def difference(name):
        """The largest |Δ| of the input's and every parameter's gradient, each relative to the
        reference's largest entry, over the ranks."""
        got = {n: p.grad for n, p in layers[name].named_parameters()}
        got["input"] = leaves[name].grad
        diffs = [(got[n] - want[n]).abs().max() / want[n].abs().max() for n in got]
        return (f" {names[name]}", all_ranks_max(max(diffs)), 1e-5)

    sides = {names[name]: layer_step(name) for name in layers}
    for run in sides.values():
        run()
    checks = [difference("ours"), difference("theirs")]
    times, _ = alternate(sides, args, device)
    tokens = args.micro_batch_size * args.seq_len
    k = config.num_experts_per_tok
    part = f"expert exchange, ep {world}, {E} experts top-{k}, {tokens:,} tokens per rank"
    return [row(part, "ours", names["theirs"], times, checks)]


PARTS = {"model": compare_model, "dp": compare_dp, "tp": compare_tp, "pp": compare_pp}
PARTS |= {"zero": compare_zero, "cp": compare_cp, "sp": compare_sp}
PARTS |= {"interleaved": compare_interleaved, "zb1": compare_zb1, "ep": compare_ep}
PARTS |= {"zero3": compare_zero3, "kv_cache": compare_kv_cache}
