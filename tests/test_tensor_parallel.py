"""Step 4: each tensor-parallel layer against its dense reference, the whole model against the
single-device model, and tp training against step 3's single-process run."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import (
    TINY,
    assert_matches,
    assert_same_training,
    check,
    import_step,
    read_log,
    run_step,
    spawn,
)

STEP = "step4_tensor_parallel"
tp_lib = import_step(STEP, "tensor_parallel")


def close(actual, expected, what):
    assert_matches(actual, expected, what, rtol=1e-5, atol=1e-6)


# Each layer against its dense reference, forward and backward, on every rank, from the same
# inputs: x (.., D), and token ids and targets (..) in a vocabulary of VOCAB. A check names the
# function to look at in what it compares, so that a failure says where the mistake is.
VOCAB = 40


def check_column(tp, rank, world, group, x, ids, targets):
    """Column parallel: rank r holds rows r*F/tp..(r+1)*F/tp of the weight and of the output. Its
    input comes through f (`Copy`), as apply_tensor_parallel places it."""
    D, F_ = x.shape[-1], 24
    dense = torch.nn.Linear(D, F_, bias=False)
    column = tp.ColumnParallelLinear(D, F_, group)
    column.weight.data.copy_(column.init_parameter("weight", lambda s: dense.weight.data))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_dense, y_col = dense(x1), column(tp.Copy.apply(x2, group))
    close(y_col, y_dense.chunk(world, -1)[rank], "ColumnParallelLinear.forward: output")
    upstream = torch.randn_like(y_dense)
    y_dense.backward(upstream)
    y_col.backward(upstream.chunk(world, -1)[rank])
    close(
        column.weight.grad,
        dense.weight.grad.chunk(world, 0)[rank],
        "ColumnParallelLinear.forward: the weight's gradient",
    )
    # The all-reduce of Copy's backward.
    close(x2.grad, x1.grad, "Copy.backward: the gradient of ColumnParallelLinear's input")


def check_row(tp, rank, world, group, x, ids, targets):
    """Row parallel: the input comes split along its last dim; the output is the full sum."""
    D, F_ = x.shape[-1], 24
    dense = torch.nn.Linear(F_, D, bias=False)
    row = tp.RowParallelLinear(F_, D, group)
    row.weight.data.copy_(row.init_parameter("weight", lambda s: dense.weight.data))
    h = torch.randn(*x.shape[:-1], F_)
    h1, h2 = h.clone().requires_grad_(), h.chunk(world, -1)[rank].clone().requires_grad_()
    y_dense, y_row = dense(h1), row(h2)
    close(y_row, y_dense, "RowParallelLinear.forward (with Reduce.forward): output")
    upstream = torch.randn_like(y_dense)
    y_dense.backward(upstream)
    y_row.backward(upstream)
    close(
        row.weight.grad,
        dense.weight.grad.chunk(world, 1)[rank],
        "RowParallelLinear.forward (with Reduce.backward): the weight's gradient",
    )
    close(
        h2.grad,
        h1.grad.chunk(world, -1)[rank],
        "RowParallelLinear.forward (with Reduce.backward): the input's gradient",
    )


def check_embedding(tp, rank, world, group, x, ids, targets):
    """Vocabulary-parallel embedding, with a pad token (its row gets no gradient) in the last
    slice."""
    D, V = x.shape[-1], VOCAB
    pad = V - 3
    ids.view(-1)[0] = pad
    dense = torch.nn.Embedding(V, D, padding_idx=pad)
    embed = tp.VocabParallelEmbedding(V, D, group, padding_idx=pad)
    embed.weight.data.copy_(embed.init_parameter("weight", lambda s: dense.weight.data))
    y_dense, y_emb = dense(ids), embed(ids)
    close(y_emb, y_dense, "VocabParallelEmbedding.forward: output")
    upstream = torch.randn_like(y_dense)
    y_dense.backward(upstream)
    y_emb.backward(upstream)
    close(
        embed.weight.grad,
        dense.weight.grad.chunk(world, 0)[rank],
        "VocabParallelEmbedding.forward: the weight's gradient",
    )


def check_cross_entropy(tp, rank, world, group, x, ids, targets):
    """Vocabulary-parallel cross-entropy, on logits large enough that a missing max would
    overflow, and what its backward keeps."""
    logits = 30 * torch.randn(*targets.shape, VOCAB)
    full = logits.clone().requires_grad_()
    mine = logits.chunk(world, -1)[rank].clone().requires_grad_()
    loss_dense = F.cross_entropy(full.flatten(0, -2), targets.flatten())
    loss_tp = tp.vocab_parallel_cross_entropy(mine, targets, group)
    close(loss_tp, loss_dense, "vocab_parallel_cross_entropy: the loss")
    loss_dense.backward()
    loss_tp.backward()
    close(
        mine.grad,
        full.grad.chunk(world, -1)[rank],
        "vocab_parallel_cross_entropy: the gradient of this rank's logits",
    )
    # What its backward keeps of this rank's logits: one float copy (the exponentials), no more.
    sizes = {}

    def pack(tensor):
        sizes[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    logits = torch.randn(4, 16, 32, requires_grad=True)  # 32 of the vocabulary on this rank
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        tp.vocab_parallel_cross_entropy(logits, torch.randint(0, 32 * world, (4, 16)), group)
    copy = logits.numel() * 4
    assert copy <= sum(sizes.values()) < 2 * copy, (
        f"vocab_parallel_cross_entropy: its backward keeps {sum(sizes.values())} bytes, "
        f"expected one float copy of the logits, {copy} (up to twice that)"
    )


def check_gather(tp, rank, world, group, x, ids, targets):
    """Gather: all slices side by side; backward keeps this rank's slice."""
    part = x.chunk(world, -1)[rank].clone().requires_grad_()
    gathered = tp.Gather.apply(part, group)
    close(gathered, x, "Gather.forward: output")
    gathered.backward(x)
    close(part.grad, x.chunk(world, -1)[rank], "Gather.backward: the gradient of this rank's slice")


LAYERS = {
    "column": check_column,
    "row": check_row,
    "embedding": check_embedding,
    "cross_entropy": check_cross_entropy,
    "gather": check_gather,
}


def layers_worker(rank, world, batch_shape, layers):
    import tensor_parallel as tp

    torch.manual_seed(0)  # the same dense weights and inputs on every rank
    x = torch.randn(*batch_shape, 16)
    ids = torch.randint(0, VOCAB, batch_shape)
    targets = torch.randint(0, VOCAB, batch_shape)
    for name in layers:
        LAYERS[name](tp, rank, world, dist.group.WORLD, x, ids, targets)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("batch_shape", [(3, 5), (1, 7), (2, 1)], ids=str)
def test_layers_match_dense(tmp_path, world, batch_shape):
    spawn(STEP, layers_worker, world, tmp_path, batch_shape, list(LAYERS))


@pytest.mark.parametrize("layer", list(LAYERS))
def test_layer_matches_dense(tmp_path, layer):
    """One layer at a time, on two ranks: the graded steps of the exercise (tools/steps.py)."""
    spawn(STEP, layers_worker, 2, tmp_path, (3, 5), [layer])


def model_worker(rank, world, tied):
    from transformers import LlamaConfig

    from model import LlamaForCausalLM
    from placement import clip_grad_norm, model_gradients
    from process_group_manager import ProcessGroupManager
    from tensor_parallel import (
        Gather,
        apply_tensor_parallel,
        vocab_parallel_cross_entropy,
    )

    pgm = ProcessGroupManager(tp_size=world, pp_size=1, dp_size=1)
    group = pgm.tp_group
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    reference = LlamaForCausalLM(config)
    reference.init_weights(seed=3)
    with torch.device("meta"):
        model = apply_tensor_parallel(LlamaForCausalLM(config), group)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(seed=3)
    # Never the whole model: every weight matrix is a slice.
    assert model.lm_head.weight.shape == (64 // world, 32)

    torch.manual_seed(1)
    ids, targets = torch.randint(0, 64, (2, 9)), torch.randint(0, 64, (2, 9))
    expected = reference(ids)
    loss_ref = F.cross_entropy(expected.flatten(0, 1), targets.flatten())
    logits = model(ids)
    close(Gather.apply(logits, group), expected, "apply_tensor_parallel's model: logits")
    loss = vocab_parallel_cross_entropy(logits, targets, group)
    close(loss, loss_ref, "apply_tensor_parallel's model: the loss")
    loss_ref.backward()
    loss.backward()
    for name, param in model.named_parameters():
        full = reference.get_parameter(name).grad
        if param.shape != full.shape:
            dim = [a != b for a, b in zip(param.shape, full.shape, strict=True)].index(True)
            full = full.chunk(world, dim)[rank]
        close(param.grad, full, f"apply_tensor_parallel's model: the gradient of {name}")
    norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    close(
        clip_grad_norm(model_gradients(model, ["tp"]), 1e9, pgm),
        norm_ref,
        "clip_grad_norm: the gradient norm",
    )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_matches_single_device(tmp_path, tied):
    spawn(STEP, model_worker, 2, tmp_path, tied)


def count_worker(rank, world, tied):
    from transformers import LlamaConfig

    from model import LlamaForCausalLM
    from tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy

    group = dist.group.WORLD
    B, T, D, L = 2, 9, 32, 2
    config = LlamaConfig(
        vocab_size=64, hidden_size=D, intermediate_size=48, num_hidden_layers=L,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    with torch.device("meta"):
        model = apply_tensor_parallel(LlamaForCausalLM(config), group)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(seed=3)
    ids, targets = torch.randint(0, 64, (B, T)), torch.randint(0, 64, (B, T))

    # Every all-reduce of one forward and backward, by phase, as the shape it reduced.
    calls, phase, all_reduce = {"forward": [], "loss": [], "backward": []}, ["forward"], None

    def counting_all_reduce(tensor, *args, group=None, **kwargs):
        assert group is dist.group.WORLD, "an all-reduce off the tp group"
        calls[phase[0]].append(tuple(tensor.shape))
        return all_reduce(tensor, *args, group=group, **kwargs)

    all_reduce, dist.all_reduce = dist.all_reduce, counting_all_reduce
    try:
        logits = model(ids)
        phase[0] = "loss"
        loss = vocab_parallel_cross_entropy(logits, targets, group)
        phase[0] = "backward"
        loss.backward()
    finally:
        dist.all_reduce = all_reduce
    # Forward: the embedding's, then per block g after o_proj and g after down_proj: 1 + 2 * 2.
    expected = [(B, T, D)] * (1 + 2 * L)
    assert calls["forward"] == expected, (
        f"the forward pass made the all-reduces {calls['forward']}, expected {expected}: one in "
        "VocabParallelEmbedding.forward, one in each RowParallelLinear.forward (its Reduce), "
        "none elsewhere (apply_tensor_parallel places the layers)"
    )
    # The loss: the max, the sum of exponentials and the target's logit of every token.
    expected = [(B, T, 1), (B, T), (B, T)]
    assert calls["loss"] == expected, (
        f"vocab_parallel_cross_entropy made the all-reduces {calls['loss']}, expected {expected}: "
        "the max, the sum of exponentials and the target's logit"
    )
    # Backward: f before lm_head, then per block f before the MLP and f before attention:
    # 1 + 2 * 2. The embedding's Reduce and the loss's have an identity backward.
    expected = [(B, T, D)] * (1 + 2 * L)
    assert calls["backward"] == expected, (
        f"the backward pass made the all-reduces {calls['backward']}, expected {expected}: one in "
        "Copy.backward per norm that feeds column-parallel layers (apply_tensor_parallel's "
        "hooks), none in Reduce.backward"
    )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_two_all_reduces_forward_and_two_backward_per_block(tmp_path, tied):
    spawn(STEP, count_worker, 2, tmp_path, tied)


def test_refuses_bad_tp_sizes():
    class Config:
        num_attention_heads, num_key_value_heads, intermediate_size, vocab_size = 8, 4, 96, 2048

    tp_lib.check_tensor_parallel(Config, 4)
    with pytest.raises(ValueError, match="tp_size=8 does not divide num_key_value_heads=4"):
        tp_lib.check_tensor_parallel(Config, 8)
    with pytest.raises(ValueError, match="tp_size=3 does not divide num_attention_heads=8"):
        tp_lib.check_tensor_parallel(Config, 3)


def test_bad_tp_size_exits_on_every_rank():
    result = run_step(STEP, [*TINY, "--tp_size", "3"], nproc=3, timeout=120)
    assert result.returncode != 0
    assert "tp_size=3 does not divide num_attention_heads=4" in result.stdout + result.stderr


def train(step, tmp_path, name, nproc=1, extra=()):
    log_file = tmp_path / f"{name}.jsonl"
    args = [*TINY, "--max_steps", "20", "--gradient_accumulation_steps", "2"]
    args += ["--eval_every", "10", "--eval_steps", "2", "--num_proc", "1", "--sample_tokens", "8"]
    args += ["--log_file", str(log_file), *extra]
    result = check(run_step(step, args, nproc=nproc))
    return read_log(log_file), result


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Step 3 on one process: the reference every layout must reproduce."""
    records, result = train("step3_dataloader", tmp_path_factory.mktemp("base"), "base")
    return records, result


def test_tp2_trains_like_one_process(tmp_path, baseline):
    records, result = train(STEP, tmp_path, "tp2", nproc=2, extra=["--tp_size", "2"])
    assert_same_training(records, baseline[0])
    sample = [line for line in result.stdout.splitlines() if "sample:" in line]
    assert sample[0].split("sample:")[1] == baseline[1].stdout.split("sample:")[1].splitlines()[0]


def test_tp4_trains_like_one_process(tmp_path_factory):
    extra = ["--num_key_value_heads", "4"]
    base, _ = train("step3_dataloader", tmp_path_factory.mktemp("b4"), "base", extra=extra)
    tmp = tmp_path_factory.mktemp("tp4")
    records, _ = train(STEP, tmp, "tp4", nproc=4, extra=[*extra, "--tp_size", "4"])
    assert_same_training(records, base)


def test_tp2_resume_in_same_layout(tmp_path, baseline):
    save = tmp_path / "ckpt"
    extra = ["--tp_size", "2", "--save_dir", str(save), "--save_every", "10"]
    train(STEP, tmp_path, "first", nproc=2, extra=extra)
    files = sorted(p.name for p in (save / "step_000010").iterdir())
    assert files == [
        "config.json",
        "model-tp0-of-2.safetensors",
        "model-tp1-of-2.safetensors",
        "trainer_state-tp0-of-2.pt",
        "trainer_state-tp1-of-2.pt",
    ]
    (save / "latest").write_text("step_000010")
    records, _ = train(STEP, tmp_path, "resumed", nproc=2, extra=[*extra, "--resume"])
    assert_same_training(records, baseline[0][10:])
    # Another layout is refused with a message, not a crash deep inside safetensors.
    result = run_step(STEP, [*TINY, "--save_dir", str(save), "--resume"], nproc=1)
    assert result.returncode != 0
    assert "has no shard tp0-of-1" in result.stdout + result.stderr
