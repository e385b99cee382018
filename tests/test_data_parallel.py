"""Steps 5 and 6: data-parallel gradients against one process, against PyTorch's DDP, and against
the well-known tensor-hook bug; the naive version's all-reduces counted; one bucket, and the
buckets' sizes; the loader's split; the overlap; training like step 3. Each check names the
function to look at (the exercises' graded tests, tools/steps.py)."""

import json

import pytest
import torch
import torch.distributed as dist
from conftest import (
    TINY,
    assert_matches,
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


def assert_grads(got, want, what, reference):
    """Every gradient of `want`, in `got` too, to 1e-5; `what` names the functions to look at."""
    for name in want:
        assert name in got, f"{what}: {name} has no gradient, {reference} gives it one"
        what_grad = f"{what}: the gradient of {name}"
        assert_matches(got[name], want[name], what_grad, rtol=1e-5, atol=1e-7, reference=reference)


def ddp_grads(rank, world, accumulation):
    """PyTorch's DistributedDataParallel, with no_sync on the accumulation micro-batches."""
    model = tiny_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=dist.group.WORLD)
    batches = micro_batches(world * accumulation)[rank::world]
    for i, (inputs, targets) in enumerate(batches):
        last = i == len(batches) - 1
        with ddp.no_sync() if not last else torch.enable_grad():
            (loss_of(ddp, inputs, targets) / len(batches)).backward()
    return grads(model)


def dp_grads(wrapper, rank, world, accumulation, **kwargs):
    """The gradients that `wrapper` leaves on this rank's replica; and the wrapper."""
    model = tiny_model()
    wrapped = wrapper(model, dist.group.WORLD, **kwargs)
    sync = lambda flag: setattr(wrapped, "require_backward_grad_sync", flag)
    run_dp(wrapped, rank, world, accumulation, sync)
    wrapped.finish_gradient_synchronization()
    return grads(model), wrapped


NAIVE_CODE = "DataParallelNaive (the hooks of __init__, _all_reduce_grad)"
BUCKET_CODE = "DataParallelBucket (_accumulate_grad, finish_gradient_synchronization)"


def naive_grads_worker(rank, world, accumulation):
    from data_parallel import DataParallelNaive

    naive, _ = dp_grads(DataParallelNaive, rank, world, accumulation)
    assert_grads(naive, reference_grads(accumulation, world), NAIVE_CODE, "one process")
    assert_grads(naive, ddp_grads(rank, world, accumulation), NAIVE_CODE, "PyTorch's DDP")


@pytest.mark.parametrize("accumulation", [1, 3])
def test_naive_gradients_equal_one_process_and_ddp(tmp_path, accumulation):
    spawn(NAIVE, naive_grads_worker, 2, tmp_path, accumulation)


def bucket_grads_worker(rank, world, accumulation):
    from data_parallel import DataParallelBucket
    from overlap_timeline import OverlapTimeline

    DataParallelNaive = import_step(NAIVE, "data_parallel").DataParallelNaive  # step 6 replaced it
    timeline = OverlapTimeline()  # counts the buckets launched before backward ended
    kwargs = {"bucket_size_mb": 0.01, "timeline": timeline}
    bucket, wrapped = dp_grads(DataParallelBucket, rank, world, accumulation, **kwargs)
    assert_grads(bucket, reference_grads(accumulation, world), BUCKET_CODE, "one process")
    assert len(wrapped.bucket_manager.buckets) > 1
    # Overlap: buckets started their all-reduce from inside backward, before it ended.
    assert timeline.launched_in_backward >= 1, (
        "Bucket.mark_ready: no bucket started its all-reduce during backward; a bucket launches "
        "as soon as the last of its parameters is ready"
    )
    naive, _ = dp_grads(DataParallelNaive, rank, world, accumulation)
    assert_grads(bucket, naive, BUCKET_CODE, "step 5's DataParallelNaive")
    assert_grads(bucket, ddp_grads(rank, world, accumulation), BUCKET_CODE, "PyTorch's DDP")


@pytest.mark.parametrize("accumulation", [1, 3])
def test_bucket_gradients_equal_one_process_naive_and_ddp(tmp_path, accumulation):
    spawn(BUCKET, bucket_grads_worker, 2, tmp_path, accumulation)


def naive_count_worker(rank, world):
    """Every all-reduce of a step of 3 micro-batches, by micro-batch, as the shape it reduced."""
    from data_parallel import DataParallelNaive

    model = tiny_model()
    wrapped = DataParallelNaive(model, dist.group.WORLD)
    batches = micro_batches(world * 3)[rank::world]
    calls, all_reduce = {i: [] for i in range(len(batches))}, dist.all_reduce
    now = [0]

    def counting_all_reduce(tensor, *args, group=None, **kwargs):
        assert group is dist.group.WORLD, "DataParallelNaive: an all-reduce off its dp_group"
        calls[now[0]].append(tuple(tensor.shape))
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        wrapped.zero_grad(set_to_none=True)
        for i, (inputs, targets) in enumerate(batches):
            now[0] = i
            wrapped.require_backward_grad_sync = i == len(batches) - 1
            (loss_of(wrapped, inputs, targets) / len(batches)).backward()
        wrapped.finish_gradient_synchronization()
    finally:
        dist.all_reduce = all_reduce
    for i in range(len(batches) - 1):
        assert not calls[i], (
            f"DataParallelNaive._all_reduce_grad: micro-batch {i} of {len(batches)} made "
            f"{len(calls[i])} all-reduces, expected none: require_backward_grad_sync is False "
            "until the last micro-batch"
        )
    want = sorted(tuple(p.shape) for p in model.parameters())
    got = calls[len(batches) - 1]
    assert sorted(got) == want, (
        f"DataParallelNaive._all_reduce_grad: the last micro-batch made {len(got)} all-reduces, "
        f"expected one per parameter ({len(want)}), each of its accumulated gradient"
    )


def test_naive_all_reduces_each_gradient_once_a_step(tmp_path):
    spawn(NAIVE, naive_count_worker, 2, tmp_path)


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
    assert torch.equal(model.model.unused.grad, torch.zeros(5)), (
        "DataParallelBucket.finish_gradient_synchronization: a parameter without gradient gets "
        "its bucket's zeros"
    )
    want = reference_grads(2, world)
    got = {n: p.grad for n, p in model.named_parameters() if n in want}
    assert_grads(got, want, f"{BUCKET_CODE}, with an unused parameter", "one process")


def test_parameter_without_gradient_does_not_hang(tmp_path):
    spawn(BUCKET, unused_param_worker, 2, tmp_path, timeout=60)


def bucket_worker(rank, world):
    """One bucket of two parameters on each rank, its gradients drawn alike on every rank."""
    from data_parallel import Bucket

    group, params = dist.group.WORLD, [torch.nn.Parameter(torch.zeros(n)) for n in (3, 2)]
    torch.manual_seed(0)
    buffers = torch.randn(world, 5)  # rank r's buffer: row r
    mean = buffers.mean(0)
    bucket = Bucket(params, buffers[rank].clone(), group)
    bucket.mark_ready(params[1])
    assert bucket.handle is None, (
        "Bucket.mark_ready: the bucket launched when one of its two parameters was ready; it "
        "launches when the last one is"
    )
    bucket.mark_ready(params[0])
    assert bucket.handle is not None, (
        "Bucket.mark_ready: both parameters are ready and no all-reduce has started (launch it; "
        "Bucket.sync_gradient keeps its handle in self.handle)"
    )
    bucket.wait()
    what = "Bucket.sync_gradient (then wait): grad_data"
    reference = "the mean of the ranks' buffers"
    assert_matches(bucket.grad_data, mean, what, rtol=1e-5, atol=1e-7, reference=reference)
    # A parameter without gradient kept this one from launching: wait launches it.
    unused = Bucket(params, buffers[rank].clone(), group)
    unused.mark_ready(params[0])
    unused.wait()
    what = "Bucket.wait, in a bucket that no hook launched: grad_data"
    assert_matches(unused.grad_data, mean, what, rtol=1e-5, atol=1e-7, reference=reference)


def test_bucket_launches_when_full_and_averages(tmp_path):
    spawn(BUCKET, bucket_worker, 2, tmp_path, timeout=60)


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
        assert all(b.grad_data.dtype == torch.float32 for b in manager.buckets), (
            "BucketManager.__init__: the buffers hold fp32 gradients, whatever the parameters' are"
        )
    finally:
        dist.get_world_size = original
    # 256 fp32 gradients are 1 KiB, so two parameters fill a 2 KiB bucket (bf16 would fit four).
    assert sizes == [2048] * 4, (
        f"BucketManager.__init__: buckets of {sizes} bytes, expected 4 of 2048: a bf16 "
        "parameter of 256 elements has 1 KiB of fp32 gradients, so two fill a bucket of 2 KiB"
    )
    # Backward produces the last parameters' gradients first: they fill the first bucket.
    assert manager.bucket_of[params[-1]] == 0 and manager.bucket_of[params[0]] == 3, (
        f"BucketManager.__init__: bucket_of puts the first and the last parameter in buckets "
        f"{manager.bucket_of[params[0]]} and {manager.bucket_of[params[-1]]}, expected 3 and 0: "
        "backward produces the last parameters' gradients first"
    )
    for i, param in enumerate(params):  # its gradient's place: a view into its bucket's buffer
        buffer = manager.buckets[manager.bucket_of[param]].grad_data
        main_grad = getattr(param, "main_grad", None)
        assert (
            main_grad is not None
            and main_grad.shape == param.shape
            and main_grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        ), f"BucketManager.__init__: parameter {i}'s main_grad is no view into its bucket's buffer"


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
            assert split[r][k] == one_process[3 * k + r], (
                f"MicroBatchDataLoader.__next__: micro-batch {k} of dp rank {r} of 3 holds rows "
                f"{split[r][k]}, expected micro-batch {3 * k + r} of one process, rows "
                f"{one_process[3 * k + r]}"
            )
    seen = [row for rank in split for batch in rank for row in batch]
    assert len(seen) == len(set(seen)) == 24
    positions = [loader.position for loader in ranks]
    assert all(position == single.position for position in positions), (
        f"MicroBatchDataLoader.__next__: after 4 micro-batches the dp ranks are at rows "
        f"{positions}, expected {single.position}: each step moves every rank past all ranks' rows"
    )


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
