"""Step 15: a mixture of experts (moe.py) and expert parallelism (expert_parallel.py).

torchrun --nproc_per_node 2 step15_expert_parallel/train.py --model_name tiny-moe --dp_size 2 \
    --ep_size 2
"""

import os
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from bookkeeping import Run, agree, check_restarts, find_checkpoint, restart_store
from checkpoint import check_resume, checkpoint_bytes, resume, save_checkpoint
from context_parallel import apply_context_parallel, check_context_parallel, whole_sequence
from dataloader import MicroBatchDataLoader, load_data
from expert_parallel import apply_expert_parallel, check_expert_parallel
from flags import COUNT, NON_NEGATIVE, POSITIVE, add_trace_flag, load_config, make_parser, parse
from fully_sharded import (
    FullyShardedDataParallel,
    check_zero_stage,
    log_held_bytes,
    shard_parameters,
)
from hf_import import add_init_flag, check_init_flag, config_flag, init_from_hf
from kv_cache import kv_cache
from model import LlamaForCausalLM
from moe import (
    MODEL_TYPES,
    active_flops_per_token,
    add_expert_bias,
    apply_moe,
    check_moe,
    is_moe,
    router_stats,
    router_step,
    set_router_losses,
    with_router,
)
from muon import make_optimizer
from overlap_timeline import NO_TIMELINE, OverlapTimeline
from pipeline_parallel import (
    SCHEDULES,
    SPLIT_BACKWARD,
    PipelineParallel,
    Stage,
    TiedEmbeddings,
    check_pipeline_parallel,
    check_schedule,
    forward_step,
    frees,
    gradient_group,
    keep_stage,
    rank_chunks,
    run_schedule,
)
from pipeline_timeline import NoTimeline, Timeline
from placement import clip_grad_norm
from process_group_manager import ProcessGroupManager, check_sizes
from recipes import loss_scale, unscale, warmup_cosine
from recompute import MODES, apply_recompute, check_recompute
from sequence_parallel import (
    apply_sequence_parallel,
    check_sequence_parallel,
    whole_sequence_per_tp_rank,
)
from tensor_parallel import (
    Gather,
    apply_tensor_parallel,
    check_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from utils import flops_per_token, log, resolve_device, resolve_dtype, run_main, set_seed
from zero import DataParallelZero1
from zero_bubble import apply_zero_bubble


class Context(NamedTuple):
    """What every part of the run reads and nothing changes: the flags (complete once parsed,
    never written after), the device, the autocast dtype and the grid of ranks."""

    args: object
    device: torch.device
    dtype: torch.dtype
    pgm: ProcessGroupManager


@dataclass
class State:
    """What the run trains with: the model as built (its parameters, which checkpoints save), its
    stage's forward (evaluation and sampling call it) and what the step calls (compiled, data
    parallel), the optimizer with its schedule, the loaders, the tokenizer; the tied embedding's
    two copies, the (B, T, D) activations between stages and the group the gradients go back on."""

    model: torch.nn.Module
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    tokenizer: object
    train_loader: MicroBatchDataLoader
    val_loader: MicroBatchDataLoader
    stage: torch.nn.Module
    tied: TiedEmbeddings
    shape: tuple
    gradients: dist.ProcessGroup


def parse_args(argv=None):
    parser, parallel = make_parser(__doc__.split("\n")[0])
    ### begin Bucketed data parallelism
    parallel.add_argument(
        "--bucket_size_mb", type=POSITIVE, default=25, help="gradient bucket, MiB"
    )
    add_trace_flag(
        parallel, "--dp_timeline", "log how the buckets' all-reduces overlapped backward"
    )
    ### end Bucketed data parallelism
    parallel.add_argument("--pp_engine", choices=list(SCHEDULES), default="afab", help="schedule")
    ### begin Interleaved 1F1B
    parallel.add_argument(
        "--pp_virtual_stages", type=COUNT, default=1,
        help="chunks of layers per pipeline rank (--pp_engine interleaved)",
    )  # fmt: skip
    ### end Interleaved 1F1B
    add_trace_flag(parallel, "--pp_timeline", "print each stage's schedule, step by step")
    add_init_flag(parser)
    parallel.add_argument("--cp_size", type=COUNT, default=1, help="context-parallel ranks")
    ### begin ZeRO-2 and ZeRO-3
    parallel.add_argument(
        "--zero_stage", type=int, choices=[1, 2, 3], default=1,
        help="what is sharded over dp x cp: 1 the optimizer state, 2 also the gradients, 3 also "
        "the parameters",
    )  # fmt: skip
    parallel.add_argument(
        "--reshard_after_forward", choices=["always", "never"], default="always",
        help="--zero_stage 3: free a unit's weights after each forward and backward (always), or "
        "keep them gathered until the step's end (never: one all-gather per step)",
    )  # fmt: skip
    ### end ZeRO-2 and ZeRO-3
    ### begin Activation memory
    parallel.add_argument(
        "--sequence_parallel", action="store_true",
        help="between the tensor-parallel regions, each tp rank holds seq_len / tp_size tokens",
    )  # fmt: skip
    parallel.add_argument(
        "--recompute", choices=MODES, default="none",
        help="run again in backward: each decoder layer (full) or its attention kernel "
        "(selective), instead of keeping their activations",
    )  # fmt: skip
    ### end Activation memory
    ### begin Expert parallelism
    parallel.add_argument("--ep_size", type=COUNT, default=1, help="expert-parallel ranks, of dp's")
    parser.add_argument(
        "--aux_loss_coef", type=NON_NEGATIVE, default=None,
        help="load-balancing loss coefficient (default: the config's router_aux_loss_coef)",
    )  # fmt: skip
    parser.add_argument(
        "--z_loss_coef", type=NON_NEGATIVE, default=0.0, help="router z-loss coefficient"
    )
    parser.add_argument(
        "--moe_router", choices=["mixtral", "llama4"], default="mixtral",
        help="Mixtral's softmax router, or Llama 4's: sigmoid scores that scale each expert's "
        "input, and a shared expert for every token",
    )  # fmt: skip
    parser.add_argument(
        "--expert_bias_rate", type=NON_NEGATIVE, default=0.0,
        help="loss-free balancing: how far each expert's routing bias moves per step (0: off)",
    )  # fmt: skip
    ### end Expert parallelism
    args = parse(parser, argv, tokens_per_step)
    if args.cp_size > 1:  # below 1: parse refuses it
        check_context_parallel(args.seq_len, args.cp_size)
    check_init_flag(parser, args)
    check_zero_stage(parser, args)
    check_sequence_parallel(parser, args)
    check_schedule(parser, args)
    check_recompute(parser, args)
    check_expert_parallel(parser, args)
    return args


def tokens_per_step(args):
    """One optimizer step's tokens: its micro-batches of micro_batch_size rows of seq_len, on
    each of the dp replicas."""
    return args.micro_batch_size * args.gradient_accumulation_steps * args.seq_len * args.dp_size


### begin Process groups
def setup_distributed(args):
    """Join the process group that torchrun describes (or a group of one) and build the grid."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # Checked before any collective, on every rank: a bad grid exits at once instead of hanging.
    check_sizes(world_size, args.tp_size, args.pp_size, args.dp_size, args.cp_size)
    device = resolve_device(args.device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=args.dist_timeout_s)  # for every group: a stall stops the job
    if "RANK" in os.environ:  # torchrun's store, each restart's keys apart from the last's
        store = restart_store(os.environ, timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    else:  # plain `python train.py`: a group of one, without a rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    check_restarts(os.environ)  # torchrun --max_restarts: a restarted group must reconnect
    sizes = args.tp_size, args.pp_size, args.dp_size, args.cp_size
    return ProcessGroupManager(*sizes, timeout=timeout, ep_size=args.ep_size), device


### end Process groups
def check_layout(config, tp_size, pp_size):
    """Refuse a layout this model cannot take, what build_model checks first: check_resume asks
    it, to name the sizes that would work."""
    check_tensor_parallel(config, tp_size)
    check_pipeline_parallel(config, pp_size)


def build_model(ctx, config):
    """Build on the meta device (no memory), allocate on `device`, then initialise from the seed."""
    args, device, dtype, pgm = ctx
    ### begin Tensor parallelism
    check_tensor_parallel(config, pgm.tp_size)
    check_pipeline_parallel(config, pgm.pp_size, args.pp_virtual_stages)
    check_moe(config, args)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        # The swap happens before any weight exists: each rank allocates only its slices.
        apply_tensor_parallel(model, pgm.tp_group)
        if args.sequence_parallel:  # Sequence parallelism: a tp rank keeps its tokens between
            apply_sequence_parallel(model)
        if is_moe(config):  # Mixture of experts: in place of each MLP
            apply_moe(model, pgm, args.sequence_parallel)
            if pgm.ep_size > 1:  # Expert parallelism: this ep rank's experts only
                apply_expert_parallel(model, pgm)
        if pgm.cp_size > 1:  # Context parallelism: attention around the cp ring
            apply_context_parallel(model, pgm.cp_group)
        keep_stage(model, pgm, args.pp_virtual_stages)  # Pipeline parallelism: its chunks only
        if args.pp_engine in SPLIT_BACKWARD:  # Zero bubble: weight gradients that can wait
            apply_zero_bubble(model)
        apply_recompute(model, args.recompute)  # Recomputation: what backward computes again
        if args.zero_stage == 3:  # ZeRO-3: this rank's rows of every parameter only
            shard_parameters(model, pgm, ("dp", "cp"))
    ### end Tensor parallelism
    model.to_empty(device=device)
    if pgm.pp_size == 1:  # with stages, the first and last hold a copy each (TiedEmbeddings)
        model.tie_weights()
    model.init_weights(args.seed)
    if is_moe(config):  # the balancing bias, zero until --expert_bias_rate moves it
        add_expert_bias(model, device)
    return model


def activation_shape(ctx, config):
    """The shape of the activations between stages, known in advance: a cp rank holds seq_len /
    cp_size tokens of each row, and with sequence parallelism a tp rank a tp_size-th of those."""
    args, device, dtype, pgm = ctx
    tokens = args.seq_len // pgm.cp_size // (pgm.tp_size if args.sequence_parallel else 1)
    return (args.micro_batch_size, tokens, config.hidden_size)


def data_parallel(ctx, wrapped, model, tied):
    """ZeRO around the stage's forward (`wrapped`): its gradients averaged and the optimizer
    sharded over dp x cp, the ranks with the same weights; stage 1 and 2 on step 6's buckets
    (DataParallelZero1), stage 3 the parameters themselves (FullyShardedDataParallel)."""
    args, device, dtype, pgm = ctx
    axes = ("dp", "cp")
    timeline = NO_TIMELINE if args.dp_timeline is None else OverlapTimeline()
    if args.zero_stage == 3:
        reshard = args.reshard_after_forward == "always"
        split = args.pp_engine in SPLIT_BACKWARD  # zero bubble: W hands each gradient over
        wrapped = FullyShardedDataParallel(wrapped, model, pgm, axes, reshard, split)
    else:
        wrapped = DataParallelZero1(
            wrapped, pgm, axes, args.bucket_size_mb, tied.weight, timeline, args.zero_stage
        )
    return wrapped


def build_optimizer(ctx, model, zero):
    """AdamW, weight decay on matrices only (not norms), or --optimizer muon (muon.py); linear
    warm-up, then the --lr_schedule down to 10 %. ZeRO-1: `zero.shard(params)` gives this
    rank's pieces of them, all that it updates; Muon orthogonalises whole matrices, which
    `zero.on_whole` puts together from the pieces."""
    args, device, dtype, pgm = ctx
    optimizer = make_optimizer(model, args, device, zero.shard, zero.on_whole)
    return optimizer, warmup_cosine(optimizer, args)


### begin Data
def build_data(ctx, config):
    """The tokenizer and loaders for the training rows (shuffled) and the validation rows."""
    args, device, dtype, pgm = ctx
    tokenizer, train, validation = load_data(args, config.vocab_size)
    ### begin Data parallelism
    shard = {"dp_rank": pgm.dp_rank, "dp_size": pgm.dp_size}  # each dp rank its micro-batches
    shard.update(cp_rank=pgm.cp_rank, cp_size=pgm.cp_size)  # and each cp rank its chunks of them
    train_loader = MicroBatchDataLoader(train, args.micro_batch_size, args.seed, device, **shard)
    val_loader = MicroBatchDataLoader(
        validation, args.micro_batch_size, args.seed, device, shuffle=False, **shard
    )
    ### end Data parallelism
    return tokenizer, train_loader, val_loader


### end Data


def loss_fn(logits, targets, pgm):
    ### begin Tensor parallelism
    # The logits are split over the vocabulary, (B, T, V/tp); the loss is reduced across tp.
    return vocab_parallel_cross_entropy(logits, targets, pgm.tp_group)
    ### end Tensor parallelism


def train_step(ctx, state, micro_batches):
    """One optimizer step over the micro-batches of a batch; returns the mean loss and grad norm."""
    args, device, dtype, pgm = ctx
    model, optimizer, scheduler = state.wrapped, state.optimizer, state.scheduler
    shape, tied = state.shape, state.tied
    model.zero_grad(set_to_none=True)
    scale = loss_scale(optimizer)  # --dtype float16: gradients S times larger; else 1
    ### begin Pipeline parallelism
    stage_loss = lambda logits, targets: loss_fn(logits, targets, pgm) * scale
    chunks = args.pp_virtual_stages
    # The router's losses ride on the layers' outputs, scaled like the loss (moe.py).
    set_router_losses(state.model, args, 1 / len(micro_batches), scale)
    actions = SCHEDULES[args.pp_engine](pgm.pp_size, len(micro_batches), chunks)[pgm.pp_rank]
    timeline = Timeline(frees(actions)) if args.pp_timeline is not None else NoTimeline()
    stages = [Stage(model, pgm, chunk, chunks, state.gradients) for chunk in range(chunks)]
    total = run_schedule(actions, stages, micro_batches, stage_loss, shape, device, dtype, timeline)
    total = total / scale  # the loss as logged (exact: S is a power of two)
    if args.pp_timeline is not None:
        # Interleaved: m x chunks chunk-sized forwards, what the textbook bubble counts.
        timeline.report(len(micro_batches) * chunks, args.pp_engine, pgm, args.pp_timeline)
    ### end Pipeline parallelism
    model.finish_gradient_synchronization()
    if args.dp_timeline is not None:
        model.timeline.report(args.bucket_size_mb, args.dp_timeline)
    ### begin ZeRO-1
    model.sum_tied_gradients(tied)  # the tied embedding's two copies, one gradient: before clipping
    grad_norm = clip_grad_norm(model.gradients(tied), args.grad_clip * scale, pgm) / scale
    # The tp ranks' copies of the loss count once; the dp and cp ranks' shares make its mean.
    counted, replicas = pgm.tp_rank == 0, pgm.dp_size * pgm.cp_size
    router = router_stats(state.model, pgm)  # its statistics ride the same collective (moe.py)
    facts = agree(total, grad_norm, counted, replicas, sums=router)
    if facts.finite:  # on every rank alike: a non-finite step changes nothing
        unscale(optimizer, scale)
        optimizer.step()  # this rank's shard only
        model.all_gather_parameters()
        scheduler.step()
    ### end ZeRO-1
    return facts


@torch.no_grad()
def evaluate(ctx, state):
    """The mean loss over the first --eval_steps validation micro-batches, the same every time;
    dp rank r evaluates micro-batches r, r + dp_size, ... of them."""
    args, device, dtype, pgm = ctx
    model, loader, shape = state.stage, state.val_loader, state.shape
    model.eval()
    loader.load_state_dict({"position": 0})
    total = torch.zeros((), device=device)
    # ZeRO-3 gathers in every forward: each dp rank runs as many, one it does not count if the
    # micro-batches do not divide evenly (a rank with one forward fewer would wait forever).
    for first in range(0, args.eval_steps, pgm.dp_size):
        inputs, targets = next(loader)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, logits = forward_step(model, inputs, shape, pgm, device)  # forward only
            if pgm.pp_is_last_stage and first + pgm.dp_rank < args.eval_steps:
                total += loss_fn(logits, targets, pgm)
    model.train()
    dist.all_reduce(total, group=pgm.pp_group)  # from the last stage to all
    dist.all_reduce(total, group=pgm.dp_cp_group)
    return (total / (args.eval_steps * pgm.cp_size)).item()


@torch.no_grad()
def sample(ctx, state, top_k=20, temperature=0.8):
    """Continue --sample_prompt by --sample_tokens tokens, sampling among the top-k next ones.
    Every tp rank gathers the full logits and draws from the same generator, so all pick the same
    token; the last stage then sends it to the other stages."""
    args, device, dtype, pgm = ctx
    model, tokenizer, hidden_size = state.stage, state.tokenizer, state.model.config.hidden_size
    model.eval()
    generator = torch.Generator(device).manual_seed(args.seed)
    prompt = tokenizer.encode(args.sample_prompt, add_special_tokens=False)
    ids = new = torch.tensor([prompt], device=device)  # (1, T)
    with kv_cache(model):  # the model sees each token once: the prompt, then one at a time
        for _ in range(args.sample_tokens):
            ### begin Pipeline parallelism
            shape = (1, new.shape[1], hidden_size)  # each stage caches its own layers
            _, logits = forward_step(model, new, shape, pgm, device)
            new = torch.zeros((1, 1), dtype=ids.dtype, device=device)
            if pgm.pp_is_last_stage:
                logits = Gather.apply(logits[:, -1], pgm.tp_group).float() / temperature  # (1, V)
                top, index = logits.topk(top_k)
                choice = torch.multinomial(top.softmax(-1), 1, generator=generator)  # (1, 1)
                new = index.gather(-1, choice)
            dist.broadcast(new, src=pgm.pp_group_ids[-1], group=pgm.pp_group)
            ids = torch.cat([ids, new], dim=1)
            ### end Pipeline parallelism
    model.train()
    return tokenizer.decode(ids[0])


def main(argv=None):
    args = parse_args(argv)
    pgm, device = setup_distributed(args)
    log(pgm, all_ranks=True)
    dtype = resolve_dtype(args.dtype, device)
    ctx = Context(args, device, dtype, pgm)
    set_seed(args.seed)
    config = with_router(load_config(args, config_flag(args), MODEL_TYPES), args)  # Mixtral too
    # Per device: all world_size devices share the work of the step's tokens.
    flops = active_flops_per_token(config, flops_per_token(config, args.seq_len)) / pgm.world_size
    run = Run(args, device, flops, pgm)
    checkpoint = check_resume(find_checkpoint(args), config, args, check_layout)  # no weight yet
    model = build_model(ctx, config)
    init_from_hf(model, args, resuming=checkpoint is not None)
    run.checkpoints.count = partial(checkpoint_bytes, model, pgm)  # each piece once, experts too
    ### begin Pipeline parallelism
    # This stage's forward, chunk by chunk: evaluation and sampling use it too.
    layers = rank_chunks(config.num_hidden_layers, pgm.pp_rank, pgm.pp_size, args.pp_virtual_stages)
    stage = PipelineParallel(model, layers)
    gradients = gradient_group(pgm)  # the group the gradients travel back on
    tied = TiedEmbeddings(model, pgm)  # with tie_word_embeddings: the last stage's copy made equal
    shape = activation_shape(ctx, config)  # what the stages send each other
    ### end Pipeline parallelism
    wrapped = torch.compile(stage) if args.compile else stage
    ### begin ZeRO-1
    wrapped = data_parallel(ctx, wrapped, model, tied)  # ZeRO-1, 2 or 3 over dp x cp
    optimizer, scheduler = build_optimizer(ctx, model, wrapped)
    ### end ZeRO-1
    params = sum(p.numel() for p in model.parameters())
    log(f"model {args.model_name}: {params:,} parameters per rank on {device}, autocast {dtype}")
    data = build_data(ctx, config)  # the tokenizer and the loaders
    state = State(model, wrapped, optimizer, scheduler, *data, stage, tied, shape, gradients)
    if checkpoint:
        step = resume(ctx, state, checkpoint)
        run.resumed(step, optimizer, scheduler, state.train_loader.position * args.seq_len)
    for step in range(run.start_step + 1, run.max_steps + 1):
        run.begin(step, optimizer)
        batch = [next(state.train_loader) for _ in range(args.gradient_accumulation_steps)]
        with run.communication():  # --comm_stats: what the step sends
            facts = train_step(ctx, state, batch)
        run.end(facts, state.train_loader.position * args.seq_len)
        if is_moe(config):  # the bias moved; the router's losses and loads, when the step logs
            router_step(model, pgm, args, facts, run)
        if run.should_validate():
            run.record["val_loss"] = evaluate(ctx, state)
        if step == run.start_step + 1:  # AdamW creates its moments at the first step
            run.record["held_bytes"] = log_held_bytes(model, optimizer, wrapped)
        run.log_step()
        if run.should_save():
            run.save(save_checkpoint, ctx, state, step)
        if run.should_stop():
            break
    run.close()
    if not run.stopped:  # the seconds before the cluster kills the job go to the checkpoint only
        with whole_sequence(stage), whole_sequence_per_tp_rank(stage):  # one prompt, all of it
            log(f"sample: {sample(ctx, state)!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
