"""Step 4: tensor parallelism. The tp ranks of a group share one model, each holding a slice
of every weight matrix (see tensor_parallel.py); their loss and gradient norm are those of the
single-device model.

    torchrun --nproc_per_node 2 step4_tensor_parallel/train.py --tp_size 2
"""

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dataloader import MicroBatchDataLoader, load_splits, load_tokenizer, tokenize
from model import LlamaForCausalLM
from process_group_manager import ProcessGroupManager, check_sizes
from tensor_parallel import (
    Gather,
    apply_tensor_parallel,
    check_tensor_parallel,
    clip_grad_norm,
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
    parallel = parser.add_argument_group("parallelism (tp_size * pp_size * dp_size = world size)")
    parallel.add_argument("--tp_size", type=int, default=1, help="tensor-parallel ranks")
    parallel.add_argument("--dp_size", type=int, default=1, help="data-parallel ranks")
    parallel.add_argument("--pp_size", type=int, default=1, help="pipeline stages")
    parallel.add_argument("--pp_engine", choices=["afab", "1f1b"], default="afab")
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
    for name in ["eval_every", "sample_tokens"]:
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be 0 or more, got {getattr(args, name)}")
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
    check_sizes(world_size, args.tp_size, args.pp_size, args.dp_size)
    device = resolve_device(args.device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    else:  # plain `python train.py`: a group of one, without a rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return ProcessGroupManager(args.tp_size, args.pp_size, args.dp_size), device


### end Process groups
def load_config(args):
    """A LlamaConfig from assets/configs/NAME, a local directory or the hub, with overrides."""
    name = args.model_name
    if (ASSETS / "configs" / name).is_dir():
        name = str(ASSETS / "configs" / name)
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:  # ValueError: a folder without a config.json
        where = (
            "the folder has no valid config.json"
            if Path(name).is_dir()
            else "no such local directory, and the Hugging Face hub could not be reached or "
            "has no such model"
        )
        raise ValueError(
            f"could not load the model config {args.model_name!r}: {where}. The offline default "
            f"is --model_name tiny; assets/configs holds the others.\n{error}"
        ) from error
    if config.model_type != "llama":
        raise ValueError(f"{args.model_name!r} is a {config.model_type!r} model, not a Llama one")
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
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        # The swap happens before any weight exists: each rank allocates only its slices.
        apply_tensor_parallel(model, pgm.tp_group)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model


def build_optimizer(model, args, device):
    """AdamW, weight decay on matrices only (not norms); linear warm-up, cosine decay to 10 %."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.95), fused=fused)

    def lr_factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


### begin Data
def build_data(args, config, device):
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
    train_loader = MicroBatchDataLoader(train, args.micro_batch_size, args.seed, device)
    val_loader = MicroBatchDataLoader(validation, args.micro_batch_size, args.seed, device, False)
    return tokenizer, train_loader, val_loader


### end Data


def loss_fn(logits, targets, pgm):
    # The logits are split over the vocabulary, (B, T, V/tp); the loss is reduced across tp.
    return vocab_parallel_cross_entropy(logits, targets, pgm.tp_group)


def train_step(model, micro_batches, optimizer, scheduler, args, device, dtype, pgm):
    """One optimizer step over the micro-batches of a batch; returns the mean loss and grad norm."""
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs)  # (B, T, V)
        # Dividing by the number of micro-batches makes the accumulated gradient the mean over
        # the whole batch, the same as one backward over one large batch.
        loss = loss_fn(logits, targets, pgm) / len(micro_batches)
        loss.backward()
        total += loss.detach()
    grad_norm = clip_grad_norm(model, args.grad_clip, pgm.tp_group)
    optimizer.step()
    scheduler.step()
    return total.item(), grad_norm.item()


@torch.no_grad()
def evaluate(model, loader, steps, device, dtype, pgm):
    """The mean loss over the first `steps` validation micro-batches, the same ones every time."""
    model.eval()
    loader.load_state_dict({"position": 0})
    total = torch.zeros((), device=device)
    for _ in range(steps):
        inputs, targets = next(loader)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            total += loss_fn(model(inputs), targets, pgm)
    model.train()
    return (total / steps).item()


@torch.no_grad()
def sample(model, tokenizer, prompt, num_tokens, device, seed, pgm, top_k=20, temperature=0.8):
    """Continue `prompt` token by token, sampling among the top-k next tokens. Every tp rank
    gathers the full logits and draws from the same generator, so all pick the same token."""
    model.eval()
    generator = torch.Generator(device).manual_seed(seed)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], device=device)
    for _ in range(num_tokens):
        logits = Gather.apply(model(ids)[:, -1], pgm.tp_group).float() / temperature  # (1, V)
        top, index = logits.topk(top_k)
        choice = torch.multinomial(top.softmax(-1), 1, generator=generator)  # (1, 1)
        ids = torch.cat([ids, index.gather(-1, choice)], dim=1)
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


def resume(args, model, optimizer, scheduler, train_loader, device, pgm):
    """With --resume, load save_dir's latest checkpoint; returns the step to continue after."""
    path = latest_checkpoint(args.save_dir) if args.save_dir else None
    if not args.resume:
        if path:
            log(
                f"warning: {args.save_dir} holds {path.name}; without --resume this run starts over"
            )
        return 0
    if path is None:
        log(f"--resume: no checkpoint in {args.save_dir} yet, starting from step 0")
        return 0
    step = load_checkpoint(path, model, optimizer, scheduler, train_loader, device, pgm)
    log(f"resumed from {path} at step {step}")
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


def main(argv=None):
    args = parse_args(argv)
    pgm, device = setup_distributed(args)
    log(pgm, all_ranks=True)
    dtype = resolve_dtype(args.dtype, device)
    set_seed(args.seed)
    config = load_config(args)
    model = build_model(config, device, args.seed, pgm)
    optimizer, scheduler = build_optimizer(model, args, device)
    step_fn = torch.compile(model) if args.compile else model
    num_params = sum(p.numel() for p in model.parameters())
    log(
        f"model {args.model_name}: {num_params:,} parameters per rank on {device}, autocast {dtype}"
    )

    tokenizer, train_loader, val_loader = build_data(args, config, device)
    start_step = resume(args, model, optimizer, scheduler, train_loader, device, pgm)
    metrics = MetricsLog(args, append=start_step > 0)
    tokens_per_step = args.micro_batch_size * args.gradient_accumulation_steps * args.seq_len
    flops, peak = flops_per_token(config, args.seq_len), peak_flops(device, args.peak_tflops)
    stop_signal, stopped = StopSignal(), False  # SIGTERM: finish the step, save, exit
    profiler = start_profiler(args.profile, device)
    for step in range(start_step + 1, args.max_steps + 1):
        start, lr = time.perf_counter(), optimizer.param_groups[0]["lr"]
        micro_batches = [next(train_loader) for _ in range(args.gradient_accumulation_steps)]
        loss, grad_norm = train_step(
            step_fn, micro_batches, optimizer, scheduler, args, device, dtype, pgm
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
            record["val_loss"] = evaluate(model, val_loader, args.eval_steps, device, dtype, pgm)
            log(f"step {step}/{args.max_steps} | validation loss {record['val_loss']:.4f}")
        if step % args.log_every == 0 or last:
            # Per device: all world_size devices share the work of the step's tokens.
            achieved = flops * tokens_per_second / pgm.world_size
            log(
                f"step {step}/{args.max_steps} | loss {loss:.4f} | lr {lr:.2e}"
                f" | grad_norm {grad_norm:.3f} | {tokens_per_second:,.0f} tok/s"
                f" | {throughput(achieved, peak)}"
            )
        metrics.write(record)
        stopped = stop_signal.requested(device)
        if args.save_dir and (step % args.save_every == 0 or last or stopped):
            path = save_checkpoint(
                args.save_dir, step, model, optimizer, scheduler, train_loader, pgm
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
    text = sample(model, tokenizer, args.sample_prompt, args.sample_tokens, device, args.seed, pgm)
    log(f"sample: {text!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
