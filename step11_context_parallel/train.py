"""Step 11: context parallelism, every sequence split over cp_size ranks. Each cp rank runs the
model on its two chunks of every row; attention is ring attention, key/value blocks passed around
the cp group. With dp, pp and tp: 4D parallelism. See README.md.

    torchrun --nproc_per_node 2 step11_context_parallel/train.py --cp_size 2
"""

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import AutoConfig

from checkpoint import (
    check_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    local_parameters,
    narrow,
    save_checkpoint,
)
from context_parallel import apply_context_parallel, check_context_parallel, whole_sequence
from dataloader import MicroBatchDataLoader, load_splits, load_tokenizer, tokenize
from model import LlamaForCausalLM
from pipeline_parallel import (
    PipelineParallel,
    Schedule,
    TiedEmbeddings,
    check_pipeline_parallel,
    forward_step,
    keep_stage,
    train_step_1f1b,
    train_step_afab,
)
from process_group_manager import ProcessGroupManager, check_sizes
from tensor_parallel import (
    Gather,
    apply_tensor_parallel,
    check_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from utils import (
    ArgumentParser,
    StopSignal,
    check_output_path,
    flops_per_token,
    log,
    peak_flops,
    resolve_device,
    resolve_dtype,
    run_main,
    set_seed,
    throughput,
)
from zero import DataParallelZero1, optimizer_state_bytes

ASSETS = Path(__file__).resolve().parent.parent / "assets"
OVERRIDES = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
]


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_name",
        default="tiny",
        help="a config in assets/configs (tiny, smollm-135m, ...), a local directory or a hub id",
    )
    for name in OVERRIDES:
        model.add_argument(f"--{name}", type=int, help="override the config's value")
    train = parser.add_argument_group("training")
    train.add_argument("--seq_len", type=int, default=256)
    train.add_argument("--micro_batch_size", type=int, default=4)
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--max_steps", type=int, default=250)
    train.add_argument("--learning_rate", type=float, default=3e-3)
    train.add_argument("--warmup_steps", type=int, default=10)
    train.add_argument("--weight_decay", type=float, default=0.1)
    train.add_argument("--grad_clip", type=float, default=1.0)
    train.add_argument("--seed", type=int, default=42)
    system = parser.add_argument_group("system")
    system.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    system.add_argument("--dtype", default="auto", help="autocast dtype: auto, float32, bfloat16")
    system.add_argument("--compile", action="store_true", help="torch.compile the model")
    system.add_argument("--peak_tflops", type=float, help="the device's peak, for MFU")
    system.add_argument("--log_every", type=int, default=1)
    parallel = parser.add_argument_group(
        "parallelism (tp_size * pp_size * dp_size * cp_size = world size)"
    )
    parallel.add_argument("--tp_size", type=int, default=1, help="tensor-parallel ranks")
    parallel.add_argument("--cp_size", type=int, default=1, help="context-parallel ranks")
    parallel.add_argument("--dp_size", type=int, default=1, help="data-parallel ranks")
    parallel.add_argument("--pp_size", type=int, default=1, help="pipeline stages")
    parallel.add_argument("--pp_engine", choices=["afab", "1f1b"], default="afab")
    parallel.add_argument("--bucket_size_mb", type=float, default=25, help="gradient bucket size")
    parallel.add_argument(
        "--dp_timeline",
        nargs="?",
        const="",
        metavar="TRACE_JSON",
        help="log how the buckets' all-reduces overlapped each step's backward; write the step "
        "as a Chrome trace to TRACE_JSON (the flag alone: to save_dir/dp_timeline.json when "
        "--save_dir is given)",
    )
    parallel.add_argument(
        "--pp_timeline",
        nargs="?",
        const="",
        metavar="TRACE_JSON",
        help="print each stage's schedule; write the step's timeline as a Chrome trace to "
        "TRACE_JSON (the flag alone: to save_dir/pp_timeline.json when --save_dir is given)",
    )
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", default="tinytales", help="assets/datasets/NAME or hub id")
    data.add_argument("--tokenizer_name", default="tinytales", help="assets/tokenizers/NAME or hub")
    data.add_argument("--max_tokens", type=int, help="stop after this many training tokens")
    data.add_argument("--num_proc", type=int, default=2, help="processes for tokenising")
    data.add_argument("--eval_every", type=int, default=50, help="validation every N steps")
    data.add_argument("--eval_steps", type=int, default=4, help="validation micro-batches")
    data.add_argument("--sample_prompt", default="Once upon a time")
    data.add_argument("--sample_tokens", type=int, default=60)
    run = parser.add_argument_group("checkpoints and logging")
    run.add_argument("--save_dir", help="write checkpoints here (none if not given)")
    run.add_argument("--save_every", type=int, help="every N steps (100), and always at the end")
    run.add_argument("--resume", action="store_true", help="continue from save_dir's latest")
    run.add_argument("--log_file", help="one JSON line per optimizer step")
    run.add_argument("--use_wandb", action="store_true", help="log to Weights & Biases")
    run.add_argument("--run_name", default="pico3d")
    run.add_argument("--profile", metavar="DIR", help="trace steps 3-5 with torch.profiler")
    run.add_argument("--init_from_hf", help="start from a transformers Llama folder (safetensors)")
    args = parser.parse_args(argv)
    if args.save_every is not None and not args.save_dir:
        parser.error("--save_every needs --save_dir, the folder to save to")
    args.save_every = 100 if args.save_every is None else args.save_every
    for name in [
        "seq_len",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "max_steps",
        "log_every",
        "eval_steps",
        "save_every",
        "num_proc",
    ]:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in OVERRIDES:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ["learning_rate", "grad_clip"]:
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be above 0, got {getattr(args, name)}")
    for name in ["weight_decay", "warmup_steps"]:
        if not getattr(args, name) >= 0:
            parser.error(f"--{name} must be 0 or more, got {getattr(args, name)}")
    if args.init_from_hf and any(getattr(args, name) is not None for name in OVERRIDES):
        parser.error("--init_from_hf takes the model's shape from its config.json: no overrides")
    if args.init_from_hf:
        folder = Path(args.init_from_hf)
        if not folder.is_dir():
            parser.error(f"--init_from_hf {folder}: no such folder")
        if not (folder / "config.json").is_file():
            parser.error(f"--init_from_hf {folder}: no config.json (save_pretrained writes one)")
        if not list(folder.glob("*.safetensors")):
            parser.error(
                f"--init_from_hf {folder}: no *.safetensors weights (save_pretrained with "
                f"safe_serialization=True writes them)"
            )
    for name in ["eval_every", "sample_tokens"]:
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be 0 or more, got {getattr(args, name)}")
    if args.cp_size > 1:  # below 1: check_sizes refuses it
        check_context_parallel(args.seq_len, args.cp_size)
    if not args.bucket_size_mb > 0:
        parser.error(f"--bucket_size_mb must be above 0, got {args.bucket_size_mb}")
    if args.pp_timeline == "" and args.save_dir:
        args.pp_timeline = str(Path(args.save_dir) / "pp_timeline.json")
    if args.pp_timeline:
        check_output_path("--pp_timeline", args.pp_timeline, folder=False)
    if args.dp_timeline == "" and args.save_dir:
        args.dp_timeline = str(Path(args.save_dir) / "dp_timeline.json")
    if args.dp_timeline:
        check_output_path("--dp_timeline", args.dp_timeline, folder=False)
    if args.profile and args.max_steps < 3:
        parser.error(f"--profile records steps 3 to 5; --max_steps {args.max_steps} stops before")
    if args.resume and not args.save_dir:
        parser.error("--resume needs --save_dir, the folder to resume from")
    if args.save_dir:
        check_output_path("--save_dir", args.save_dir, folder=True)
    if args.log_file:
        check_output_path("--log_file", args.log_file, folder=False)
    if args.max_tokens is not None:
        tokens_per_step = args.micro_batch_size * args.gradient_accumulation_steps * args.seq_len
        tokens_per_step *= args.dp_size
        if args.max_tokens < tokens_per_step:
            parser.error(
                f"--max_tokens {args.max_tokens} is less than one step's {tokens_per_step}"
            )
        # Whole steps of this run's batch; a resume counts the tokens trained before it again.
        args.max_steps_given, args.tokens_per_step = args.max_steps, tokens_per_step
        args.max_steps = min(args.max_steps, args.max_tokens // tokens_per_step)
    return args


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
    if "RANK" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    else:  # plain `python train.py`: a group of one, without a rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return ProcessGroupManager(args.tp_size, args.pp_size, args.dp_size, args.cp_size), device


### end Process groups
def load_config(args):
    """A LlamaConfig from assets/configs/NAME, a local directory or the hub, with overrides."""
    # Its config comes from --init_from_hf's folder when given, else from --model_name.
    flag = "--init_from_hf" if args.init_from_hf else "--model_name"
    given = name = args.init_from_hf or args.model_name
    if (ASSETS / "configs" / name).is_dir():
        name = str(ASSETS / "configs" / name)
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:  # ValueError: a folder without a config.json
        where = (
            "the folder has no valid config.json"
            if Path(name).is_dir()
            else "no such local directory, and the Hugging Face hub could not be reached or "
            "has no such model. The offline default is --model_name tiny; assets/configs holds "
            "the others"
        )
        raise ValueError(
            f"{flag} {given}: could not load the model config: {where}.\n{error}"
        ) from error
    if config.model_type != "llama":
        raise ValueError(f"{flag} {given} is a {config.model_type!r} model, not a Llama one")
    for key in OVERRIDES:
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
            if key in ("hidden_size", "num_attention_heads"):
                config.head_dim = config.hidden_size // config.num_attention_heads
    H, K, D = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    if D % H:
        raise ValueError(f"num_attention_heads={H} does not divide hidden_size={D}")
    if H % K:
        raise ValueError(f"num_key_value_heads={K} does not divide num_attention_heads={H}")
    d = getattr(config, "head_dim", None) or D // H
    if d % 2:
        raise ValueError(
            f"head_dim={d} (hidden_size / num_attention_heads = {D} / {H}) is odd: the rotary "
            f"embedding turns pairs of dimensions, so it must be even"
        )
    if args.seq_len > config.max_position_embeddings:
        raise ValueError(
            f"seq_len={args.seq_len} exceeds "
            f"max_position_embeddings={config.max_position_embeddings}"
        )
    return config


def build_model(config, device, seed, pgm):
    """Build on the meta device (no memory), allocate on `device`, then initialise from the seed."""
    check_tensor_parallel(config, pgm.tp_size)
    check_pipeline_parallel(config, pgm.pp_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        # The swap happens before any weight exists: each rank allocates only its slices.
        apply_tensor_parallel(model, pgm.tp_group)
        if pgm.cp_size > 1:  # attention around the cp ring; the projections stay as they are
            apply_context_parallel(model, pgm.cp_group)
        keep_stage(model, pgm)  # this stage's layers only
    model.to_empty(device=device)
    if pgm.pp_size == 1:  # with stages, the first and last hold a copy each (TiedEmbeddings)
        model.tie_weights()
    model.init_weights(seed)
    return model


def build_optimizer(model, args, device, shard):
    """AdamW, weight decay on matrices only (not norms); linear warm-up, cosine decay to 10 %.
    ZeRO-1: `shard(params)` gives this rank's pieces of them, all that it updates."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": shard([p for p in params if p.ndim >= 2]), "weight_decay": args.weight_decay},
        {"params": shard([p for p in params if p.ndim < 2]), "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), fused=fused)

    def lr_factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


### begin Hugging Face import
def refuse_unused_tensors(config, keys, directory):
    """A checkpoint tensor that no parameter of the whole model (every stage) takes, such as a
    bias, would be dropped without a word: the run would train another model than the one saved."""
    with torch.device("meta"):
        expected = set(LlamaForCausalLM(config).state_dict())  # a tied lm_head is optional
    # Older conversions saved RoPE's frequencies, which the model computes from the config.
    unused = sorted(k for k in set(keys) - expected if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise ValueError(
            f"--init_from_hf {directory}: the model has no parameter for the checkpoint's "
            f"{', '.join(unused[:5])}{more}; was it saved from the model its config.json describes?"
        )


@torch.no_grad()
def load_hf_weights(model, directory):
    """Fill this rank's parameters from a transformers checkpoint, reading from the safetensors
    files only the rows or columns this rank holds (its stage's layers, its tp slices)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"--init_from_hf {directory}: no *.safetensors files there")
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {key: handle for handle in handles for key in handle.keys()}
    refuse_unused_tensors(model.config, where, directory)
    # Each parameter once (tied embeddings: once), with the rows or columns this rank holds.
    for key, param, dim, start, shape in local_parameters(model):
        if key == "lm_head.weight" and key not in where and model.config.tie_word_embeddings:
            key = "model.embed_tokens.weight"  # transformers omits the tied head
        if key not in where:
            raise ValueError(f"--init_from_hf {directory}: no tensor {key}")
        full = where[key].get_slice(key)
        if full.get_shape() != shape:
            raise ValueError(
                f"--init_from_hf {directory}: {key} has shape {tuple(full.get_shape())}, "
                f"this model's is {tuple(shape)}"
            )
        param.copy_(full[:] if dim is None else narrow(full, dim, start, param.shape[dim]))


### end Hugging Face import
### begin Data
def build_data(args, config, device, pgm):
    """The tokenizer and loaders for the training rows (shuffled) and the validation rows."""
    tokenizer = load_tokenizer(args.tokenizer_name)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{config.vocab_size}"
        )
    train, validation = load_splits(args.dataset_name, args.seed)
    train = tokenize(train, tokenizer, args.seq_len, args.num_proc)
    validation = tokenize(validation, tokenizer, args.seq_len, args.num_proc)
    log(f"data {args.dataset_name}: {len(train):,} training rows, {len(validation):,} validation")
    dp = {"dp_rank": pgm.dp_rank, "dp_size": pgm.dp_size}  # each dp rank takes its micro-batches
    dp.update(cp_rank=pgm.cp_rank, cp_size=pgm.cp_size)  # and each cp rank its chunks of them
    train_loader = MicroBatchDataLoader(train, args.micro_batch_size, args.seed, device, **dp)
    val_loader = MicroBatchDataLoader(
        validation, args.micro_batch_size, args.seed, device, shuffle=False, **dp
    )
    return tokenizer, train_loader, val_loader


### end Data


def loss_fn(logits, targets, pgm):
    # The logits are split over the vocabulary, (B, T, V/tp); the loss is reduced across tp.
    return vocab_parallel_cross_entropy(logits, targets, pgm.tp_group)


def train_step(model, micro_batches, optimizer, scheduler, args, device, dtype, pgm, shape, tied):
    """One optimizer step over the micro-batches of a batch; returns the mean loss and grad norm.
    `shape` is that of the activations passed between stages, (B, T, D); `tied`, the embedding's
    copies on the first and last stage."""
    model.zero_grad(set_to_none=True)
    stage_loss = lambda logits, targets: loss_fn(logits, targets, pgm)
    pipeline_step = train_step_1f1b if args.pp_engine == "1f1b" else train_step_afab
    schedule = Schedule()
    total = pipeline_step(model, micro_batches, stage_loss, shape, pgm, device, dtype, schedule)
    if args.pp_timeline is not None:
        report_schedule(schedule, len(micro_batches), args.pp_engine, pgm, args.pp_timeline)
    model.finish_gradient_synchronization()
    if args.dp_timeline is not None:
        report_overlap(model, args.bucket_size_mb, args.dp_timeline)
    # The tied embedding's two copies, one gradient: after dp, before clipping
    model.sum_tied_gradients(tied)
    grad_norm = model.clip_grad_norm(args.grad_clip, pgm, tied)
    optimizer.step()  # this rank's shard only
    model.all_gather_parameters()
    scheduler.step()
    # The loss lives on the last stage: the sum over the pp group brings it to every rank.
    dist.all_reduce(total, group=pgm.pp_group)
    # Each replica saw its own share, each cp rank its chunks (all of the same size): the logged
    # loss is the mean over the whole batch.
    dist.all_reduce(total, group=pgm.dp_cp_group)
    return total.item() / (pgm.dp_size * pgm.cp_size), grad_norm.item()


def report_overlap(model, bucket_size_mb, trace_path=""):
    """How the buckets' collectives overlapped the backward that launched them, on this rank. With
    a trace path, rank 0 also writes the step as a Chrome trace (chrome://tracing and
    ui.perfetto.dev open it; tools/plot_timeline.py draws it)."""
    timeline = model.timeline
    backward, busy, during, waited = timeline.summary()
    n = len(timeline.sizes)
    buckets = f"{n} bucket{'s' if n > 1 else ''} of at most {bucket_size_mb:g} MB"
    figures = (
        f"backward {backward:.1f} ms | {timeline.collective}s in flight {busy:.1f} ms, "
        f"{during:.0%} of that during backward | waited {waited:.1f} ms after it"
    )
    log(f"dp overlap: {buckets}, {model.launched_in_backward} launched in backward | {figures}")
    if trace_path and dist.get_rank() == 0:
        ranks = dist.get_world_size(model.dp_group)
        title = f"{timeline.collective} over {ranks} ranks, {buckets}: {figures}"
        trace = {"traceEvents": timeline.trace_events(), "otherData": {"title": title}}
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        Path(trace_path).write_text(json.dumps(trace))


def report_schedule(schedule, m, engine, pgm, trace_path=""):
    """Each stage's timeline, its peak of held micro-batches and its idle fraction, beside the
    textbook: AFAB holds all m, 1F1B at most pp_size - pp_rank; both idle (p - 1) / (m + p - 1).
    With a trace path, rank 0 also writes its pipeline's step as a Chrome trace, one track per
    stage (chrome://tracing and ui.perfetto.dev open it; tools/plot_timeline.py draws it)."""
    end, p, r = time.time_ns(), pgm.pp_size, pgm.pp_rank
    expected_peak = m if engine == "afab" else min(p - r, m)
    log(
        f"pp stage {r} {engine}: {' '.join(schedule.timeline)} | held at most "
        f"{schedule.peak_in_flight} micro-batches (expected {expected_peak}) | bubble "
        f"{schedule.bubble():.2f} (textbook {(p - 1) / (m + p - 1):.2f})",
        all_ranks=True,
    )
    if trace_path:
        stages = [None] * p
        dist.all_gather_object(stages, schedule.trace_events(r, end), group=pgm.pp_group)
        if dist.get_rank() == 0:
            write_trace(trace_path, stages, {"engine": engine, "pp_size": p, "micro_batches": m})
            log(f"pp timeline of this step: {trace_path}")


def write_trace(path, stages, info):
    """The stages' events as one Chrome trace: a named track per stage, in order, from time 0."""
    events = [event for stage in stages for event in stage]
    origin = min(event["ts"] for event in events)
    for event in events:
        event["ts"] -= origin
    for s in range(len(stages)):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
        )
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": s, "args": {"sort_index": s}}
        )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as file:
        json.dump({"traceEvents": events, "otherData": info}, file)


@torch.no_grad()
def evaluate(model, loader, steps, device, dtype, pgm, shape):
    """The mean loss over the first `steps` validation micro-batches, the same ones every time;
    dp rank r evaluates micro-batches r, r + dp_size, ... of them."""
    model.eval()
    loader.load_state_dict({"position": 0})
    total = torch.zeros((), device=device)
    for _ in range(pgm.dp_rank, steps, pgm.dp_size):
        inputs, targets = next(loader)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, logits = forward_step(model, inputs, shape, pgm, device)  # forward only
            if pgm.pp_is_last_stage:
                total += loss_fn(logits, targets, pgm)
    model.train()
    dist.all_reduce(total, group=pgm.pp_group)  # from the last stage to all
    dist.all_reduce(total, group=pgm.dp_cp_group)
    return (total / (steps * pgm.cp_size)).item()


@torch.no_grad()
def sample(
    model, tokenizer, prompt, num_tokens, device, seed, pgm, hidden_size, top_k=20, temperature=0.8
):
    """Continue `prompt` token by token, sampling among the top-k next tokens. Every tp rank
    gathers the full logits and draws from the same generator, so all pick the same token; the
    last stage then sends it to the other stages."""
    model.eval()
    generator = torch.Generator(device).manual_seed(seed)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], device=device)
    for _ in range(num_tokens):
        shape = (1, ids.shape[1], hidden_size)
        _, logits = forward_step(model, ids, shape, pgm, device)
        token = torch.zeros((1, 1), dtype=ids.dtype, device=device)
        if pgm.pp_is_last_stage:
            logits = Gather.apply(logits[:, -1], pgm.tp_group).float() / temperature  # (1, V)
            top, index = logits.topk(top_k)
            choice = torch.multinomial(top.softmax(-1), 1, generator=generator)  # (1, 1)
            token = index.gather(-1, choice)
        dist.broadcast(token, src=pgm.pp_group_ids[-1], group=pgm.pp_group)
        ids = torch.cat([ids, token], dim=1)
    model.train()
    return tokenizer.decode(ids[0])


class MetricsLog:
    """Where a step's numbers go: the console, a JSON-lines file and Weights & Biases (rank 0)."""

    def __init__(self, args, append):
        self.file, self.wandb = None, None
        if dist.get_rank() != 0:
            return
        if args.log_file:
            Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(args.log_file, "a" if append else "w")
        if args.use_wandb:
            import wandb  # only needed with --use_wandb; WANDB_MODE=offline works without network

            self.wandb = wandb.init(project="pico3d", name=args.run_name, config=vars(args))

    def write(self, record):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.wandb:
            self.wandb.log(record, step=record["step"])

    def close(self):
        if self.file:
            self.file.close()
        if self.wandb:
            self.wandb.finish()


def start_profiler(folder, device):
    """With --profile DIR: torch.profiler skips step 1 (first-call overheads), warms up on step 2,
    records steps 3 to 5 and writes one Chrome trace per rank into DIR (chrome://tracing,
    ui.perfetto.dev or TensorBoard open it). None without the flag."""
    if not folder:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            folder, worker_name=f"rank{dist.get_rank()}"
        ),
        record_shapes=True,
    )
    profiler.start()
    return profiler


def checkpoint_to_resume(args, config):
    """With --resume, save_dir's latest checkpoint and its index, checked against this model
    before any weight exists; None to start from step 0."""
    path = latest_checkpoint(args.save_dir) if args.save_dir else None
    if not args.resume:
        if path:
            log(
                f"warning: {args.save_dir} holds {path.name}; without --resume this run starts over"
            )
        return None
    if path is None:
        log(f"--resume: no checkpoint in {args.save_dir} yet, starting from step 0")
        return None
    index = check_checkpoint(path, config)
    try:  # build_model checks the same, but here the message can say what would work
        check_tensor_parallel(config, args.tp_size)
        check_pipeline_parallel(config, args.pp_size)
    except ValueError as error:
        tp_sizes = [t for t in range(1, config.num_attention_heads + 1) if valid_tp(config, t)]
        raise ValueError(
            f"cannot resume {path} at tp {args.tp_size} x pp {args.pp_size}: {error}. This "
            f"model takes tp_size in {tp_sizes} and pp_size up to {config.num_hidden_layers}"
        ) from error
    return path, index


def valid_tp(config, tp_size):
    try:
        check_tensor_parallel(config, tp_size)
    except ValueError:
        return False
    return True


def resume(checkpoint, args, model, zero, optimizer, scheduler, train_loader, pgm):
    """Load the checkpoint into this layout, whatever layout saved it; returns its step."""
    if checkpoint is None:
        return 0
    path, index = checkpoint
    step, saved = load_checkpoint(path, index, model, optimizer, scheduler, train_loader, zero)
    layouts = [
        # Earlier steps' checkpoints have no cp_size: they were written at cp 1.
        " x ".join(f"{axis} {sizes.get(f'{axis}_size', 1)}" for axis in ["tp", "pp", "dp", "cp"])
        for sizes in [index["layout"], vars(pgm)]
    ]
    log(f"resumed from {path} at step {step}: saved at {layouts[0]}, running at {layouts[1]}")
    batch = global_batch(args, pgm)
    if rows_per_step(batch) != rows_per_step(saved) or batch["seq_len"] != saved["seq_len"]:
        # The data position counts rows, so the run goes on from there with other batches.
        sizes = [
            f"{rows_per_step(b)} rows "
            f"({b['micro_batch_size']} x {b['gradient_accumulation_steps']} x {b['dp_size']}) "
            f"of {b['seq_len']} tokens"
            for b in [saved, batch]
        ]
        log(
            f"the global batch (micro_batch_size x gradient_accumulation_steps x dp_size) "
            f"changes from {sizes[0]} to {sizes[1]}; training goes on from row "
            f"{train_loader.position:,} of the data"
        )
    stop_at_max_tokens(args, step, train_loader.position * args.seq_len)
    if step >= args.max_steps:  # a finished run started again: it only evaluates and samples
        log(f"step {step} is at or past the last step, {args.max_steps}: nothing left to train")
    follow_this_runs_schedule(args, optimizer, scheduler, step)
    return step


def stop_at_max_tokens(args, step, tokens):
    """With --max_tokens, after a resume: the run stops when the tokens trained so far (in the
    saved run's batches, which may differ from this run's) and whole steps of this run's batch
    reach it."""
    if args.max_tokens is None:
        return
    left = max(0, args.max_tokens - tokens) // args.tokens_per_step
    stop = min(args.max_steps_given, step + left)
    if stop != args.max_steps:
        log(
            f"--max_tokens {args.max_tokens}: {tokens:,} tokens trained by step {step}, then "
            f"{args.tokens_per_step:,} a step: the run stops after step {stop}"
        )
    args.max_steps = stop


def follow_this_runs_schedule(args, optimizer, scheduler, step):
    """The checkpoint brings back the saved run's learning rate; from here the run follows this
    one's --learning_rate, --warmup_steps and --max_steps (unchanged flags: the same rate, to the
    bit). Says so when the rate changes, as when a run is extended."""
    saved = optimizer.param_groups[0]["lr"]
    rate = args.learning_rate * scheduler.lr_lambdas[0](step)
    scheduler.base_lrs = [args.learning_rate for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group.update(initial_lr=args.learning_rate, lr=rate)
    if rate != saved:
        log(
            f"the learning rate of step {step + 1} is {rate:.3e} with this run's "
            f"--learning_rate, --warmup_steps and --max_steps; the saved run's was {saved:.3e}"
        )


def rows_per_step(batch):
    return batch["micro_batch_size"] * batch["gradient_accumulation_steps"] * batch["dp_size"]


def global_batch(args, pgm):
    """The sizes that make one step's batch, saved with every checkpoint."""
    return {
        "micro_batch_size": args.micro_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "dp_size": pgm.dp_size,
        "seq_len": args.seq_len,
    }


def main(argv=None):
    args = parse_args(argv)
    pgm, device = setup_distributed(args)
    log(pgm, all_ranks=True)
    dtype = resolve_dtype(args.dtype, device)
    if args.dp_timeline is not None and device.type == "cuda":
        # NCCL's wait returns when the collective is queued on the GPU, not when it has run.
        raise ValueError("--dp_timeline times gloo's all-reduces on CPU; on CUDA use --profile DIR")
    set_seed(args.seed)
    config = load_config(args)
    checkpoint = checkpoint_to_resume(args, config)
    model = build_model(config, device, args.seed, pgm)
    if args.init_from_hf and checkpoint is None:
        load_hf_weights(model, args.init_from_hf)
        log(f"weights from {args.init_from_hf}")
    elif args.init_from_hf:  # a job that starts from it, started again: the run goes on
        log(f"--init_from_hf {args.init_from_hf}: not loaded, the run resumes from its checkpoint")
    stage = PipelineParallel(model)  # this stage's forward: evaluation and sampling use it too
    tied = TiedEmbeddings(model, pgm)  # with tie_word_embeddings: the last stage's copy made equal
    step_fn = torch.compile(stage) if args.compile else stage
    # The wrapper averages gradients over dp x cp (the ranks with the same weights) and shards the
    # optimizer over them; checkpoints save the model itself, the optimizer state through it.
    timeline = args.dp_timeline is not None
    step_fn = DataParallelZero1(
        step_fn, pgm.dp_cp_group, args.bucket_size_mb, tied.weight, timeline
    )
    optimizer, scheduler = build_optimizer(model, args, device, step_fn.shard)
    num_params = sum(p.numel() for p in model.parameters())
    log(
        f"model {args.model_name}: {num_params:,} parameters per rank on {device}, autocast {dtype}"
    )

    tokenizer, train_loader, val_loader = build_data(args, config, device, pgm)
    start_step = resume(checkpoint, args, model, step_fn, optimizer, scheduler, train_loader, pgm)
    metrics = MetricsLog(args, append=start_step > 0)
    tokens_per_step = args.micro_batch_size * args.gradient_accumulation_steps * args.seq_len
    tokens_per_step *= pgm.dp_size
    flops, peak = flops_per_token(config, args.seq_len), peak_flops(device, args.peak_tflops)
    # Known in advance; a cp rank holds seq_len / cp_size tokens of each row.
    shape = (args.micro_batch_size, args.seq_len // pgm.cp_size, config.hidden_size)
    stop_signal, stopped = StopSignal(), False  # SIGTERM: finish the step, save, exit
    profiler = start_profiler(args.profile, device)
    for step in range(start_step + 1, args.max_steps + 1):
        start, lr = time.perf_counter(), optimizer.param_groups[0]["lr"]
        micro_batches = [next(train_loader) for _ in range(args.gradient_accumulation_steps)]
        loss, grad_norm = train_step(
            step_fn, micro_batches, optimizer, scheduler, args, device, dtype, pgm, shape, tied
        )
        tokens_per_second = tokens_per_step / (time.perf_counter() - start)
        if profiler:
            profiler.step()
        record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr}
        # The rows served so far: right after a resume that changed the batch, too.
        tokens = train_loader.position * args.seq_len
        record.update(tokens=tokens, tokens_per_second=tokens_per_second)
        last = step == args.max_steps
        if (args.eval_every and step % args.eval_every == 0) or last:
            record["val_loss"] = evaluate(
                stage, val_loader, args.eval_steps, device, dtype, pgm, shape
            )
            log(f"step {step}/{args.max_steps} | validation loss {record['val_loss']:.4f}")
        if step % args.log_every == 0 or last:
            # Per device: all world_size devices share the work of the step's tokens.
            achieved = flops * tokens_per_second / pgm.world_size
            log(
                f"step {step}/{args.max_steps} | loss {loss:.4f} | lr {lr:.2e}"
                f" | grad_norm {grad_norm:.3f} | {tokens_per_second:,.0f} tok/s"
                f" | {throughput(achieved, peak)}"
            )
        if step == start_step + 1:  # AdamW creates its moments at the first step
            record["optimizer_state_bytes"] = optimizer_state_bytes(optimizer)
            log(
                f"optimizer state: {record['optimizer_state_bytes']:,} bytes of AdamW moments "
                f"on this rank, 1/{pgm.dp_size * pgm.cp_size} of those of its stage and tp slice",
                all_ranks=True,
            )
        metrics.write(record)
        stopped = stop_signal.requested(device)
        if args.save_dir and (step % args.save_every == 0 or last or stopped):
            batch = global_batch(args, pgm)
            path = save_checkpoint(
                args.save_dir, step, model, optimizer, scheduler, train_loader, pgm, batch, step_fn
            )
            log(f"saved {path}")
        if stopped:
            log(f"stopped by SIGTERM after step {step}; with --save_dir, --resume continues it")
            break
    metrics.close()
    if profiler:
        profiler.stop()  # a run shorter than the schedule writes what it recorded
        log(f"profile: one trace per rank in {args.profile}")
    if stopped:  # the seconds before the cluster kills the job go to the checkpoint only
        dist.destroy_process_group()
        return
    with whole_sequence(stage):  # one prompt, every cp rank all of it
        text = sample(
            stage,
            tokenizer,
            args.sample_prompt,
            args.sample_tokens,
            device,
            args.seed,
            pgm,
            config.hidden_size,
        )
    log(f"sample: {text!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
