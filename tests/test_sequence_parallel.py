"""Step 13: sequence parallelism and recomputation. At tp 2 the model's loss and every gradient
are one process's, with and without sequence parallelism and in each --recompute mode (those
bit-identical to none); PyTorch's DTensor `SequenceParallel` plan gives the same loss and
gradients from the same weights; the ranks send what plain tensor parallelism sends, cut into
reduce-scatters and all-gathers (recomputation sends the layers' forward again); the bytes kept
for backward follow tools/activation_memory.py's formula; the harness layouts train like one
process; what cannot work is refused before the first step."""

import sys

import pytest
import torch
from conftest import ROOT, TINY, run_step, spawn

sys.path.insert(0, str(ROOT / "tools"))
import activation_memory  # noqa: E402
import convergence  # noqa: E402

S13 = "step13_sequence_parallel"
LAYOUTS = [(False, "none"), (True, "none"), (True, "selective"), (True, "full"), (False, "full")]


def build(world, sp, mode, extra=()):
    import train

    from process_group_manager import ProcessGroupManager

    flags = [*TINY, "--tp_size", str(world), "--recompute", mode, *extra]
    args = train.parse_args([*flags, "--sequence_parallel"] if sp else flags)
    pgm = ProcessGroupManager(world, 1, 1, 1)
    ctx = train.Context(args, torch.device("cpu"), torch.float32, pgm)
    config = train.load_config(args)
    return train.build_model(ctx, config), config, pgm


def dense(config, seed):
    """The single-device model, from the same seed."""
    import train

    with torch.device("meta"):
        model = train.LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(seed)
    return model


def batch(config):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 33), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def against_one_process(rank, world, results):
    """Each layout's loss, the worst gradient off one process's (its largest difference over the
    largest value of that parameter's gradient) and the tp group's communication, per kind."""
    import train

    from comm_stats import CommStats
    from placement import piece, placed_parameters

    grads = {}
    for sp, mode in LAYOUTS:
        model, config, pgm = build(world, sp, mode)
        if not grads:  # the reference: one process, the whole model
            reference = dense(config, train.parse_args(TINY).seed)
            inputs, targets = batch(config)
            logits = reference(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            want_loss = loss.item()
            want = {name: p.grad for name, p in reference.named_parameters()}
        with CommStats(pgm) as stats:
            loss = train.loss_fn(train.PipelineParallel(model)(inputs), targets, pgm)
            loss.backward()
        worst, ours = 0.0, {}
        for placed in placed_parameters(model):
            expected = piece(want[placed.name], placed.record)
            off = (placed.param.grad - expected).abs().max() / expected.abs().max()
            worst = max(worst, off.item())
            ours[placed.name] = placed.param.grad
        grads[sp, mode] = ours
        same = {name: torch.equal(g, grads[sp, "none"][name]) for name, g in ours.items()}
        comm = {kind: row["bytes"] for kind, row in stats.as_dict().get("tp", {}).items()}
        results.put((rank, sp, mode, loss.item() - want_loss, worst, all(same.values()), comm))
    results.put((rank, "shape", config.num_hidden_layers, config.hidden_size))


def test_every_layout_computes_one_process_gradients(tmp_path):
    """tp 2, fp32, one micro-batch: the loss to 1e-6 and each parameter's gradient to 1e-5 of its
    largest element (the norms' weights, summed over tp, are half off if the sum is left out);
    recomputation gives the bits of no recomputation. Communication over tp, in bytes, X = one
    (B, T, D) fp32 activation: plain tp all-reduces X at each of the 4L + 2 places (g forward
    after o_proj, down_proj and the embedding; f backward at the 2L + 1 norms); sequence
    parallelism reduce-scatters and all-gathers X at each instead, and all-reduces the 2L + 1
    norms' weight gradients, D floats each; the loss's all-reduces are the same. Full
    recomputation runs each layer's forward again, its 2 f's (all-gathers with sequence
    parallelism) and its first g: torch's checkpoint stops the forward once it has every tensor
    backward needs, and nothing keeps down_proj's output (the residual add saves nothing)."""
    import torch.multiprocessing as mp

    results = mp.get_context("forkserver").Manager().Queue()
    spawn(S13, against_one_process, 2, tmp_path, results)
    found, shape = {}, {}
    while not results.empty():
        item = results.get()
        if item[1] == "shape":
            shape[item[0]] = item[2:]
            continue
        rank, sp, mode, loss_off, worst, same, comm = item
        found[rank, sp, mode] = loss_off, worst, same, comm
    print(found)
    assert len(found) == 2 * len(LAYOUTS)
    L, D = shape[0]
    X = 2 * 32 * D * 4
    for (rank, sp, mode), (loss_off, worst, same, _) in found.items():
        assert abs(loss_off) < 1e-6 and worst < 1e-5, (rank, sp, mode, loss_off, worst)
        assert same, (rank, sp, mode)
    for rank in [0, 1]:
        plain, sp = found[rank, False, "none"][3], found[rank, True, "none"][3]
        norms = (2 * L + 1) * D * 4
        loss_bytes = sp["all-reduce"] - norms
        assert plain["all-reduce"] - loss_bytes == (4 * L + 2) * X
        assert sp["reduce-scatter"] == sp["all-gather"] == (4 * L + 2) * X
        assert found[rank, True, "selective"][3] == sp
        full = found[rank, True, "full"][3]
        assert full["all-reduce"] == sp["all-reduce"]
        assert full["reduce-scatter"] - sp["reduce-scatter"] == L * X
        assert full["all-gather"] - sp["all-gather"] == 2 * L * X
        plain_full = found[rank, False, "full"][3]
        assert plain_full["all-reduce"] - plain["all-reduce"] == L * X


def against_dtensor(rank, world, results):
    """Step 13 at tp 2 with sequence parallelism, and the same model.py model parallelised by
    PyTorch's own plan (torchtitan's): the embedding and the row-parallel layers give Shard(1),
    the norms are `SequenceParallel`, attention and the MLP gather their input
    (`PrepareModuleInput`), q/k/v and gate/up are `ColwiseParallel`, lm_head gathers the logits."""
    import train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from placement import piece, placed_parameters

    model, config, pgm = build(world, True, "none")
    theirs = dense(config, train.parse_args(TINY).seed)
    mesh = init_device_mesh("cpu", (world,))
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    to_sequence = dict(output_layouts=Shard(1), use_local_output=False)
    parallelize_module(
        theirs,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), **to_sequence),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for layer in theirs.model.layers:
        plan = {
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
        }
        plan.update({"self_attn": gather, "mlp": gather})
        for name in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]:
            plan[name] = ColwiseParallel()
        plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()})
        plan["self_attn.o_proj"] = RowwiseParallel(**to_sequence)
        plan["mlp.down_proj"] = RowwiseParallel(**to_sequence)
        parallelize_module(layer, mesh, plan)
    inputs, targets = batch(config)
    logits = theirs(inputs)
    their_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    their_loss.backward()
    loss = train.loss_fn(train.PipelineParallel(model)(inputs), targets, pgm)
    loss.backward()
    want = {name: p.grad.full_tensor() for name, p in theirs.named_parameters()}
    worst = 0.0
    for placed in placed_parameters(model):
        expected = piece(want[placed.name], placed.record)
        off = (placed.param.grad - expected).abs().max() / expected.abs().max()
        worst = max(worst, off.item())
    results.put((rank, loss.item(), their_loss.item(), worst))


def test_sequence_parallel_equals_dtensor(tmp_path):
    """The loss to rounding (1e-6) and every gradient to 1e-5 of its largest element."""
    import torch.multiprocessing as mp

    results = mp.get_context("forkserver").Manager().Queue()
    spawn(S13, against_dtensor, 2, tmp_path, results)
    found = [results.get() for _ in range(2)]
    print(found)  # (rank, our loss, DTensor's, the worst gradient off)
    for rank, ours, theirs, worst in found:
        assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-6), rank
        assert worst < 1e-5, (rank, worst)


class Tagged:
    """A queue whose items go into `queue` behind `tag`."""

    def __init__(self, queue, tag):
        self.queue, self.tag = queue, tag

    def put(self, item):
        self.queue.put((self.tag, *item))


def activation_bytes(rank, world, results):
    """tools/activation_memory.py's figures on this rank, for the fused and the math kernel, and
    its formula for the first."""
    import train

    config = train.load_config(train.parse_args(TINY))
    b, s = int(TINY[TINY.index("--micro_batch_size") + 1]), int(TINY[TINY.index("--seq_len") + 1])
    modes = [(sp, mode) for sp in [False, True] for mode in activation_memory.MODES]
    formula = {key: activation_memory.formula(config, b, s, world, *key) for key in modes}
    for attention in ["fused", "math"]:
        args = activation_memory.parse_args([*TINY, "--repeats", "1", "--attention", attention])
        activation_memory.measure(rank, world, args, Tagged(results, attention))
    results.put(("formula", rank, formula))


def test_activation_bytes_follow_the_formula(tmp_path):
    """tp 2, each rank, the fused kernel: one layer's bytes kept for backward are the formula's
    in every mode, with and without sequence parallelism; a micro-batch keeps less with sequence
    parallelism and with each recompute mode. The unfused kernel keeps more (the scores), and
    selective recomputation drops them: it keeps what it keeps with the fused one."""
    import torch.multiprocessing as mp

    results = mp.get_context("forkserver").Manager().Queue()
    spawn(S13, activation_bytes, 2, tmp_path, results)
    found = {}
    while not results.empty():
        attention, rank, figures = results.get()
        found[attention, rank] = figures
    print(found)
    assert len(found) == 6
    for rank in [0, 1]:
        fused, math, formula = (found[kind, rank] for kind in ["fused", "math", "formula"])
        assert sorted(fused) == sorted(formula)
        for key, (layer, _, _) in fused.items():
            assert layer == formula[key], key
        for sp in [False, True]:
            batch = [fused[sp, mode][1] for mode in ["none", "selective", "full"]]
            assert batch[0] > batch[1] > batch[2], (sp, batch)
            assert math[sp, "none"][0] > fused[sp, "none"][0]
            assert math[sp, "selective"][:2] == fused[sp, "selective"][:2]
        assert fused[True, "none"][1] < fused[False, "none"][1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sequence_parallel"], "--sequence_parallel cuts the sequence over the tp ranks, here"),
        (
            ["--tp_size", "2", "--sequence_parallel", "--seq_len", "33"],
            "--seq_len 33 into tp_size x cp_size = 2 x 1 = 2 equal pieces",
        ),
        (["--recompute", "some"], "argument --recompute: invalid choice: 'some'"),
        (["--recompute", "selective", "--cp_size", "2"], "with --cp_size 2 attention is the ring"),
    ],
    ids=["no-tp", "seq-len", "mode", "selective-cp"],
)
def test_what_cannot_work_is_refused_before_the_first_step(flags, message):
    result = run_step(S13, [*TINY, "--max_steps", "2", *flags], nproc=1)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_every_layout_trains_like_one_process(tmp_path):
    """The manifest's step-13 layouts (sequence parallelism at tp 2 with selective recomputation;
    tp 2 x pp 2 with 1F1B and full; tp 2 x cp 2; dp 2 x tp 2 at ZeRO-3 with full) against step 3
    on one process, accumulating the same batch."""
    common = [*TINY, "--max_steps", "8", "--eval_every", "4", "--eval_steps", "2"]
    common += ["--num_proc", "1", "--sample_tokens", "4"]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    baseline = convergence.run(convergence.baseline_layout(2), common, tmp_path, env=env)
    results = {}
    for layout in convergence.step_layouts(13, 2):
        records = convergence.run(layout, common, tmp_path, env=env)
        results[layout.name] = convergence.compare(records, baseline)
    print(f"\n{convergence.table(results)}")
    assert sorted(results) == ["sp_cp2_tp2", "sp_dp2_tp2_zero3_full", "sp_pp2_tp2_full",
                               "sp_tp2_selective"]  # fmt: skip
    for name, comparison in results.items():
        assert comparison.ok, f"{name}: {comparison.problems}"
