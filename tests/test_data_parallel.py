"""Steps 5 and 6: data-parallel gradients against one process, against PyTorch's DDP, and against
the well-known tensor-hook bug; the loader's split; the overlap; training like step 3."""

import json

import pytest
import torch
import torch.distributed as dist
from conftest import (
    TINY,
    assert_same_training,
    check,
    check_overlap_trace,
    import_step,
    read_log,
    run_step,
    spawn,
)

NAIVE, BUCKET = "step5_data_parallel_naive", "step6_data_parallel_bucket"


def tiny_model(seed=0, unused=False):
    from transformers import LlamaConfig

    from model import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.init_weights(seed)
    if unused:  # a parameter that never gets a gradient
        model.model.unused = torch.nn.Parameter(torch.zeros(5))
    return model


def micro_batches(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (count, 2, 9), generator=generator)  # (micro-batch, B, T+1)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def loss_of(model, inputs, targets):
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def reference_grads(accumulation, world):
    """One process over the whole global batch: world * accumulation micro-batches."""
    model = tiny_model()
    batches = micro_batches(world * accumulation)
    for inputs, targets in batches:
        (loss_of(model, inputs, targets) / len(batches)).backward()
    return grads(model)


def run_dp(wrapped, rank, world, accumulation, set_sync):
    """This rank's micro-batches: k * world + rank, as the data loader hands them out."""
    batches = micro_batches(world * accumulation)[rank::world]
    wrapped.zero_grad(set_to_none=True)
    for i, (inputs, targets) in enumerate(batches):
        set_sync(i == len(batches) - 1)
        (loss_of(wrapped, inputs, targets) / len(batches)).backward()


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads(got, want, what):
    for name in want:
        torch.testing.assert_close(
            got[name],
            want[name],
            rtol=1e-5,
            atol=1e-7,
            msg=lambda m, name=name: f"{what} {name}: {m}",
        )


def grads_worker(rank, world, accumulation):
    from data_parallel import DataParallelBucket
    from overlap_timeline import OverlapTimeline

    DataParallelNaive = import_step(NAIVE, "data_parallel").DataParallelNaive  # step 6 replaced it
    group = dist.group.WORLD
    want = reference_grads(accumulation, world)
    results = {}
    for name, wrapper in [("naive", DataParallelNaive), ("bucket", DataParallelBucket)]:
        model = tiny_model()
        timeline = OverlapTimeline()  # counts the buckets launched before backward ended
        kwargs = {"bucket_size_mb": 0.01, "timeline": timeline} if name == "bucket" else {}
        wrapped = wrapper(model, group, **kwargs)
        sync = lambda flag, w=wrapped: setattr(w, "require_backward_grad_sync", flag)
        run_dp(wrapped, rank, world, accumulation, sync)
        wrapped.finish_gradient_synchronization()
        results[name] = grads(model)
        assert_grads(results[name], want, name)
        if name == "bucket":
            assert len(wrapped.bucket_manager.buckets) > 1
            # Overlap: buckets started their all-reduce from inside backward, before it ended.
            assert timeline.launched_in_backward >= 1
    assert_grads(results["bucket"], results["naive"], "bucket vs naive")

    # PyTorch's DistributedDataParallel, with no_sync on the accumulation micro-batches.
    model = tiny_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    batches = micro_batches(world * accumulation)[rank::world]
    for i, (inputs, targets) in enumerate(batches):
        last = i == len(batches) - 1
        with ddp.no_sync() if not last else torch.enable_grad():
            (loss_of(ddp, inputs, targets) / len(batches)).backward()
    assert_grads(results["bucket"], grads(model), "bucket vs DDP")
    assert_grads(results["naive"], grads(model), "naive vs DDP")


@pytest.mark.parametrize("accumulation", [1, 3])
def test_dp_gradients_equal_one_process_and_ddp(tmp_path, accumulation):
    spawn(BUCKET, grads_worker, 2, tmp_path, accumulation)


def tensor_hook_worker(rank, world):
    """The public tutorial's hook: averages the *incoming* gradient on the last micro-batch."""
    group, state = dist.group.WORLD, {"sync": False}
    model = tiny_model()

    def average(grad):
        if state["sync"]:
            grad = grad / world
            dist.all_reduce(grad, group=group)
        return grad

    for param in model.parameters():
        param.register_hook(average)
    run_dp(model, rank, world, 3, lambda flag: state.update(sync=flag))
    got = grads(model)
    want = reference_grads(3, world)
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst > 1e-3, "the tensor-hook version should be wrong with accumulation"
    # And the replicas no longer agree: each kept its own first micro-batches.
    mine = got["model.layers.0.mlp.up_proj.weight"]
    theirs = mine.clone()
    dist.broadcast(theirs, src=0, group=group)
    if rank == 1:
        assert (mine - theirs).abs().max().item() > 1e-4


def test_tensor_hook_version_is_wrong_with_accumulation(tmp_path):
    spawn(BUCKET, tensor_hook_worker, 2, tmp_path)


def unused_param_worker(rank, world):
    from data_parallel import DataParallelBucket

    model = tiny_model(unused=True)
    wrapped = DataParallelBucket(model, dist.group.WORLD, bucket_size_mb=0.0001)
    run_dp(wrapped, rank, world, 2, lambda f: setattr(wrapped, "require_backward_grad_sync", f))
    wrapped.finish_gradient_synchronization()  # must not wait forever for the unused bucket
    assert torch.equal(model.model.unused.grad, torch.zeros(5))
    want = reference_grads(2, world)
    got = {n: p.grad for n, p in model.named_parameters() if n in want}
    assert_grads(got, want, "with an unused parameter")


def test_parameter_without_gradient_does_not_hang(tmp_path):
    spawn(BUCKET, unused_param_worker, 2, tmp_path, timeout=60)


def test_bucket_sizes_count_real_bytes():
    data_parallel = import_step(BUCKET, "data_parallel")
    params = [torch.nn.Parameter(torch.zeros(256, dtype=torch.bfloat16)) for _ in range(8)]

    class OneRank:  # BucketManager only asks the group's size
        pass

    sizes = []
    original = dist.get_world_size
    dist.get_world_size = lambda group=None: 1
    try:
        manager = data_parallel.BucketManager(params, OneRank(), bucket_size=2048)
        sizes = [b.grad_data.numel() * b.grad_data.element_size() for b in manager.buckets]
        assert all(b.grad_data.dtype == torch.float32 for b in manager.buckets)
    finally:
        dist.get_world_size = original
    # 256 fp32 gradients are 1 KiB, so two parameters fill a 2 KiB bucket (bf16 would fit four).
    assert sizes == [2048] * 4
    # Backward produces the last parameters' gradients first: they fill the first bucket.
    assert manager.bucket_of[params[-1]] == 0 and manager.bucket_of[params[0]] == 3


def test_loader_split_is_disjoint_and_covers_one_process():
    data = import_step(NAIVE, "dataloader")
    from datasets import Dataset

    rows = Dataset.from_dict({"tokens": [[i, i] for i in range(50)]}).with_format("torch")
    single = data.MicroBatchDataLoader(rows, 2, seed=3, device="cpu")
    one_process = [next(single)[0][:, 0].tolist() for _ in range(12)]  # 12 micro-batches
    ranks = [
        data.MicroBatchDataLoader(rows, 2, seed=3, device="cpu", dp_rank=r, dp_size=3)
        for r in range(3)
    ]
    split = [[next(loader)[0][:, 0].tolist() for _ in range(4)] for loader in ranks]
    for k in range(4):  # micro-batch k of rank r is micro-batch 3k + r of the single stream
        for r in range(3):
            assert split[r][k] == one_process[3 * k + r]
    seen = [row for rank in split for batch in rank for row in batch]
    assert len(seen) == len(set(seen)) == 24
    assert all(loader.position == single.position for loader in ranks)


def train(step, tmp_path, name, nproc=1, accumulation=4, extra=()):
    log_file = tmp_path / f"{name}.jsonl"
    args = [*TINY, "--max_steps", "20", "--gradient_accumulation_steps", str(accumulation)]
    args += ["--eval_every", "10", "--eval_steps", "4", "--num_proc", "1", "--sample_tokens", "8"]
    args += ["--log_file", str(log_file), *extra]
    check(run_step(step, args, nproc=nproc))
    return read_log(log_file)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Step 3, one process, accumulation 4: the global batch of dp 2 x accumulation 2."""
    return train("step3_dataloader", tmp_path_factory.mktemp("base"), "base")


@pytest.mark.parametrize("step", [NAIVE, BUCKET])
def test_dp2_trains_like_one_process(tmp_path, baseline, step):
    extra = ["--dp_size", "2"]
    if step == BUCKET:  # several buckets; the timeline must not change a thing
        extra += ["--bucket_size_mb", "0.05", "--dp_timeline", str(tmp_path / "dp.json")]
    records = train(step, tmp_path, "dp2", nproc=2, accumulation=2, extra=extra)
    assert_same_training(records, baseline)
    if step == BUCKET:
        check_overlap_trace(json.loads((tmp_path / "dp.json").read_text()), "all-reduce")


def test_dp2_tp2_trains_like_one_process(tmp_path, baseline):
    extra = ["--dp_size", "2", "--tp_size", "2", "--bucket_size_mb", "0.05"]
    records = train(BUCKET, tmp_path, "dp2tp2", nproc=4, accumulation=2, extra=extra)
    assert_same_training(records, baseline)


def test_dp2_checkpoint_written_once_and_resumed(tmp_path, baseline):
    save = tmp_path / "ckpt"
    extra = ["--dp_size", "2", "--save_dir", str(save), "--save_every", "10"]
    train(BUCKET, tmp_path, "first", nproc=2, accumulation=2, extra=extra)
    files = sorted(p.name for p in (save / "step_000010").iterdir())
    assert files == ["config.json", "model-tp0-of-1.safetensors", "trainer_state-tp0-of-1.pt"]
    (save / "latest").write_text("step_000010")
    records = train(
        BUCKET, tmp_path, "resumed", nproc=2, accumulation=2, extra=[*extra, "--resume"]
    )
    assert_same_training(records, baseline[10:])
