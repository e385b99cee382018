"""Step 14: interleaved 1F1B and ZB-H1. Each rank's order of chunk forwards and backwards is
PyTorch's `ScheduleInterleaved1F1B`'s, and of F, B and W its `ScheduleInterleavedZeroBubble`'s;
what they hold follows the formulas; the layouts train like one process, the gradients going back
on a group of their own, and ZB-H1 exactly like 1F1B; a checkpoint of two chunks per rank resumes
on one process, at 1F1B and at ZB-H1; B then W gives autograd's gradients bit for bit; the
simulator finds the textbook bubbles and reads its costs from a trace; what cannot work is refused
before the first step."""

import itertools
import json
import sys
import types
from contextlib import nullcontext
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import (
    ROOT,
    TINY,
    assert_matches,
    assert_refused,
    check,
    import_step,
    read_log,
    run_step,
)
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

sys.path.insert(0, str(ROOT / "tools"))
import convergence  # noqa: E402
from steps import carriers  # noqa: E402

S14 = "step14_pipeline_schedules"
# The steps that carry step 14's schedules and backward split: their detailed checks run on each.
SCHEDULED = carriers("pipeline_parallel.py", S14)
SPLIT = carriers("zero_bubble.py", S14)
# (pp_size, m, v): m a multiple of pp_size, as both schedules require.
SHAPES = [(2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (2, 8, 4)]
# Four layers: two chunks of one layer on each of two ranks.
FOUR = [*TINY[: TINY.index("--num_hidden_layers")], "--num_hidden_layers", "4"]
FOUR += TINY[TINY.index("--num_hidden_layers") + 2 :]
INTERLEAVED = ["--pp_size", "2", "--pp_engine", "interleaved", "--pp_virtual_stages", "2"]
# (pp_size, m) for ZB-H1: any m, fewer micro-batches than stages included.
ZB_SHAPES = [(2, 1), (2, 4), (3, 4), (3, 6), (4, 2), (4, 6), (4, 8), (4, 12)]


def ours(step, p, m, v):
    """Each rank's actions as torch writes them: the stage's index (chunk x p + rank), F or B,
    the micro-batch from 0."""
    pp = import_step(step, "pipeline_parallel")
    schedules = pp.SCHEDULES["interleaved"](p, m, v)
    return [
        [f"{a.chunk * p + r}{a.kind}{a.micro_batch}" for a in actions]
        for r, actions in enumerate(schedules)
    ]


@pytest.mark.parametrize("p, m, v", SHAPES, ids=[f"pp{p}-m{m}-v{v}" for p, m, v in SHAPES])
@pytest.mark.parametrize("step", SCHEDULED, ids=lambda step: step.split("_")[0])
def test_interleaved_order_is_torchs(step, p, m, v):
    """torch's `pipeline_order`, the list its `_step_microbatches` runs, without idle slots."""
    theirs = get_schedule_ops("Interleaved1F1B", p, m, v)
    assert ours(step, p, m, v) == [[str(a) for a in row if a is not None] for row in theirs]


@pytest.mark.parametrize("p, m, v", SHAPES, ids=[f"pp{p}-m{m}-v{v}" for p, m, v in SHAPES])
@pytest.mark.parametrize("step", SCHEDULED, ids=lambda step: step.split("_")[0])
def test_interleaved_holds_its_warm_up(step, p, m, v):
    """Rank r holds its warm-up's chunk forwards and one more: (v - 1) p + 2 (p - r - 1) + 1,
    at most all m v of them; rank 0 of pp 4, m 8, v 2 holds 11 chunks, 5.5 micro-batches' worth
    of its layers, where 1F1B's stage 0 holds 4."""
    pp = import_step(step, "pipeline_parallel")
    for r, actions in enumerate(pp.SCHEDULES["interleaved"](p, m, v)):
        assert pp.held(actions) == min((v - 1) * p + 2 * (p - r - 1) + 1, m * v), r
    assert [pp.held(a) for a in pp.SCHEDULES["1f1b"](4, 8)] == [4, 3, 2, 1]
    assert pp.held(pp.SCHEDULES["interleaved"](4, 8, 2)[0]) == 11


@pytest.mark.parametrize("p, m", ZB_SHAPES, ids=[f"pp{p}-m{m}" for p, m in ZB_SHAPES])
@pytest.mark.parametrize("step", SCHEDULED, ids=lambda step: step.split("_")[0])
def test_zb1_order_is_torchs(step, p, m):
    """torch's ZB1P order with one stage per rank (ScheduleInterleavedZeroBubble's own rank
    orders, before the idle slots it adds where a rank would wait; its schedule visualiser
    refuses one stage per rank), B written I there."""
    pp = import_step(step, "pipeline_parallel")
    mine = [
        [f"{r}{dict(F='F', B='I', W='W')[a.kind]}{a.micro_batch}" for a in actions]
        for r, actions in enumerate(pp.SCHEDULES["zb1"](p, m))
    ]
    rounds = max(1, m // p)
    schedule = types.SimpleNamespace(
        n_local_stages=1, pp_group_size=p, _n_microbatches=m, microbatches_per_round=m // rounds
    )
    ranks = [
        ScheduleInterleavedZeroBubble._calculate_single_rank_operations(schedule, r)
        for r in range(p)
    ]
    assert mine == [[str(a) for a in ops if a is not None] for ops in ranks]


@pytest.mark.parametrize("p, m", ZB_SHAPES, ids=[f"pp{p}-m{m}" for p, m in ZB_SHAPES])
@pytest.mark.parametrize("step", SCHEDULED, ids=lambda step: step.split("_")[0])
def test_zb1_holds_what_1f1b_holds_on_its_first_rank(step, p, m):
    """A micro-batch is held from its F to its W: rank r holds its 1F1B warm-up and the r W's it
    keeps back, min(p, m) on every rank, 1F1B's peak, which rank 0 holds; every F has its B and
    its W, each after the one before."""
    pp = import_step(step, "pipeline_parallel")
    for r, actions in enumerate(pp.SCHEDULES["zb1"](p, m)):
        assert pp.held(actions) == min(p, m), r
        for k in range(m):
            order = [actions.index(pp.Action(kind, k)) for kind in "FBW"]
            assert order == sorted(order), (r, k)
        assert len(actions) == 3 * m
    assert pp.held(pp.SCHEDULES["1f1b"](p, m)[0]) == min(p, m)


# ---- the backward split: B, then W, against autograd ---------------------------------------------

# Each piece, and the function that computes its output.
SPLIT_PIECES = {
    "linear": "Linear.forward",
    "lookup": "Lookup.forward",
    "norm": "Hold.forward",
    "model": "apply_zero_bubble",
}


def seeded(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def tokens(k, vocab):
    """Micro-batch k's ids and targets, (2, 8) each, the first id the pad token (0)."""
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(k))
    ids[0, 0] = 0
    return ids[:, :-1], ids[:, 1:]


def split_piece(zb, piece, split):
    """Step 14's `piece` with fixed weights, its weight gradients deferred through zero_bubble.py
    (`split`) or autograd's own: its parameters by name, and run(k), micro-batch k's input leaf
    (None for token ids), output and the output's gradient (None: the output is the loss)."""
    if piece == "model":  # tp 1, every layer swapped as train.py swaps them for zb1
        from transformers import LlamaConfig

        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
        )  # fmt: skip
        with torch.device("meta"):
            model = sys.modules["model"].LlamaForCausalLM(config)
            sys.modules["tensor_parallel"].apply_tensor_parallel(model, dist.group.WORLD)
            if split:
                zb.apply_zero_bubble(model)
        model.to_empty(device="cpu")
        model.init_weights(0)

        def run(k):  # the loss divided by the 2 micro-batches, as run_schedule divides it
            ids, targets = tokens(k, config.vocab_size)
            return None, F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()) / 2, None

        return dict(model.named_parameters()), run
    if piece == "lookup":  # 16 rows, the pad row 0
        weight = torch.nn.Parameter(seeded((16, 8), 1))
        lookup = zb.lookup if split else F.embedding

        def run(k):
            y = lookup(tokens(k, 16)[0], weight, 0)  # (2, 8) -> (2, 8, 8)
            return None, y, seeded(y.shape, 20 + k).to(y.dtype)

        return {"weight": weight}, run
    if piece == "linear":
        weight = torch.nn.Parameter(seeded((6, 8), 1))
        forward = (lambda x: zb.linear(x, weight)) if split else (lambda x: F.linear(x, weight))
    else:  # a norm, its weight through Hold
        norm = sys.modules["model"].RMSNorm(8, 1e-5)
        with torch.no_grad():
            norm.weight.copy_(seeded(8, 1))
        weight = norm.weight
        forward = (lambda x: zb.held_norm_forward(norm.forward, norm, x)) if split else norm

    def run(k):
        x = seeded((2, 4, 8), 10 + k).requires_grad_()
        y = forward(x)  # (2, 4, 8) -> (2, 4, 6) or (2, 4, 8)
        return x, y, seeded(y.shape, 20 + k).to(y.dtype)

    return {"weight": weight}, run


def computes(piece, name):
    """The function that gives parameter `name` of `piece` its gradient (in the model, once the
    pieces pass: apply_zero_bubble, which puts them there)."""
    if piece == "lookup" or "embed_tokens" in name:
        function = "Lookup.backward"
    elif piece == "norm" or "norm" in name:
        function = "Hold.backward"
    else:
        function = "Linear.backward"
    return f"apply_zero_bubble, {function}" if piece == "model" else function


def run_split(zb, piece, dtype, split, deferring):
    """Two micro-batches through `piece`, each forward then backward, within `deferred` where
    `deferring`, then the W's; every check of what B left. Returns the outputs, the inputs'
    gradients, the parameters and their hooks' runs."""
    params, run = split_piece(zb, piece, split)
    hooks = dict.fromkeys(params, 0)  # post-accumulate hooks run: where the buckets launch
    for name, param in params.items():
        param.register_post_accumulate_grad_hook(
            lambda _, name=name: hooks.__setitem__(name, hooks[name] + 1)
        )
    outputs, grads, closures = [], [], []
    for k in range(2):
        with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
            x, y, grad = run(k)
        with zb.deferred([]) if deferring else nullcontext() as deferred:
            torch.autograd.backward(y, grad)
        closures.append(deferred)
        outputs.append(y.detach())
        grads.append(None if x is None else x.grad)
    if deferring:
        for name, param in params.items():
            if param.grad is not None or hooks[name]:  # (pytest would show the whole tensor)
                raise AssertionError(
                    f"{computes(piece, name)} ({dtype}): {name} got its gradient in B (its hook "
                    f"ran {hooks[name]} times): within `deferred`, hand_over gives it a closure "
                    "that W runs"
                )
        for k, deferred in enumerate(closures):
            try:
                zb.weight_gradients(deferred)
            except RuntimeError as error:  # in a closure: say whose
                whose = "apply_zero_bubble" if piece == "model" else computes(piece, "")
                raise AssertionError(f"{whose} ({dtype}, W of micro-batch {k}): {error}") from error
    return outputs, grads, params, hooks


@pytest.mark.parametrize("piece", SPLIT_PIECES)
@pytest.mark.parametrize("step", SPLIT, ids=lambda step: step.split("_")[0])
def test_b_then_w_gives_autograds_gradients(step, piece):
    """zero_bubble.py against autograd on one process, in fp32 and under bf16 autocast, two
    micro-batches: a linear layer, the embedding's lookup (its pad row left at 0), a norm's weight
    through Hold, the tiny model with every layer swapped by apply_zero_bubble (tp 1). Within
    `deferred`, B gives the input its gradient and no parameter its own, running none of their
    hooks (the buckets' launch); the W's then give each parameter its gradient, bit for bit
    autograd's, its hook run once a micro-batch. Outside `deferred`, B gives both at once."""
    zb = import_step(step, "zero_bubble")
    if piece == "model":  # the tensor-parallel layers ask their group for its size
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for dtype, deferring in itertools.product((torch.float32, torch.bfloat16), (True, False)):
            outputs, grads, params, _ = run_split(zb, piece, dtype, False, False)
            our_outputs, our_grads, ours, hooks = run_split(zb, piece, dtype, True, deferring)
            when = f"{'after W' if deferring else 'outside deferred'}, {dtype}"
            exact = {"rtol": 0, "atol": 0, "reference": "autograd"}
            for k in range(2):
                what = f"{SPLIT_PIECES[piece]} ({when}, micro-batch {k}): the output"
                assert_matches(our_outputs[k], outputs[k], what, **exact)
                if grads[k] is not None:
                    what = f"{computes(piece, '')} ({when}, B of micro-batch {k}): x.grad"
                    assert_matches(our_grads[k], grads[k], what, **exact)
            for name, param in ours.items():
                function = computes(piece, name)
                if param.grad is None:
                    raise AssertionError(f"{function} ({when}): {name} has no gradient")
                what = f"{function} ({when}): {name}.grad"
                assert_matches(param.grad, params[name].grad, what, **exact)
                assert hooks[name] == 2, (
                    f"{function} ({when}): {name}'s hook ran {hooks[name]} times for 2 "
                    f"micro-batches: hand_over gives autograd each gradient once"
                )
    finally:
        if piece == "model":
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The manifest's step-14 layouts and step 3 on one process, four layers, the same batch of 4
    micro-batches; and each zb1 layout again at 1F1B. {name: records}."""
    out = tmp_path_factory.mktemp("layouts")
    common = [*FOUR, "--max_steps", "6", "--eval_every", "3", "--eval_steps", "2"]
    common += ["--num_proc", "1", "--sample_tokens", "4"]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    runs = {"baseline": convergence.baseline_layout(4)}
    for layout in convergence.step_layouts(14, 4):
        runs[layout.name] = layout
        if "zb1" in layout.flags:
            flags = tuple("1f1b" if flag == "zb1" else flag for flag in layout.flags)
            twin = layout.name.replace("zb1", "1f1b")
            runs[twin] = convergence.Layout(
                twin, layout.step, layout.nproc, flags, layout.accumulation
            )
    return {name: convergence.run(layout, common, out, env=env) for name, layout in runs.items()}


def test_every_layout_trains_like_one_process(trained):
    """The manifest's step-14 layouts (interleaved pp 2 with 2 chunks per rank; with tp 2 and
    sequence parallelism; at dp 2 with ZeRO-3 and full recomputation; ZB-H1 with tp 2 and
    sequence parallelism, and at dp 2, its buckets launched in W) against step 3 on one process."""
    names = [layout.name for layout in convergence.step_layouts(14, 4)]
    results = {name: convergence.compare(trained[name], trained["baseline"]) for name in names}
    print(f"\n{convergence.table(results)}")
    assert sorted(results) == [
        "interleaved_pp2_v2",
        "interleaved_pp2_v2_dp2_zero3_full",
        "interleaved_pp2_v2_tp2_sp",
        "zb1_pp2_dp2",
        "zb1_pp2_tp2_sp",
    ]
    for name, comparison in results.items():
        assert comparison.ok, f"{name}: {comparison.problems}"


@pytest.mark.parametrize("layout", ["zb1_pp2_tp2_sp", "zb1_pp2_dp2"])
def test_zb1_trains_exactly_like_1f1b(trained, layout):
    """The same layout at ZB-H1 and at 1F1B: every loss and gradient norm bit for bit. W computes
    each weight gradient with autograd's own matmul, in the same order of micro-batches, and the
    buckets fill and leave in W as they did in backward: only the time of each changes."""
    twin = layout.replace("zb1", "1f1b")
    keys = ["step", "loss", "grad_norm", "val_loss"]
    mine = [{k: r[k] for k in keys if k in r} for r in trained[layout]]
    assert mine == [{k: r[k] for k in keys if k in r} for r in trained[twin]]
    assert len(mine) == 6


def test_zb1_with_tied_embeddings_trains_exactly_like_1f1b(tmp_path):
    """Tied embeddings at pp 2: the first stage's embedding and the last stage's lm_head are two
    copies whose gradients are summed after the step's last W (the lookup's own, deferred whole,
    and lm_head's). ZB-H1 and 1F1B give every loss and gradient norm bit for bit."""
    config = convergence.tied_config("tiny", tmp_path / "tied")
    common = [*FOUR, "--model_name", str(config), "--max_steps", "3", "--eval_every", "0"]
    common += ["--gradient_accumulation_steps", "4", "--sample_tokens", "0", "--num_proc", "1"]
    records = {}
    for engine in ["zb1", "1f1b"]:
        log = tmp_path / f"{engine}.jsonl"
        flags = [*common, "--pp_size", "2", "--pp_engine", engine, "--log_file", str(log)]
        check(run_step(S14, flags, nproc=2))
        records[engine] = [(r["step"], r["loss"], r["grad_norm"]) for r in read_log(log)]
    assert records["zb1"] == records["1f1b"] and len(records["zb1"]) == 3


def test_a_checkpoint_of_two_chunks_per_rank_resumes_elsewhere(tmp_path):
    """Saved at step 2 by interleaved pp 2 x 2 chunks; steps 3 and 4 on one process, and at pp 2
    with 1F1B and with ZB-H1 (each rank one chunk of two layers), are the interleaved run's."""
    common = [*FOUR, "--max_steps", "4", "--gradient_accumulation_steps", "4"]
    common += ["--eval_every", "0", "--sample_tokens", "0", "--num_proc", "1"]
    save = tmp_path / "interleaved"
    log = tmp_path / "interleaved.jsonl"
    args = [*common, *INTERLEAVED, "--save_every", "2", "--save_dir", str(save)]
    check(run_step(S14, [*args, "--log_file", str(log)], nproc=2))
    first = read_log(log)
    for name, flags, nproc in [
        ("one", [], 1),
        ("1f1b", ["--pp_size", "2", "--pp_engine", "1f1b"], 2),
        ("zb1", ["--pp_size", "2", "--pp_engine", "zb1"], 2),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "step_000002").symlink_to(save / "step_000002")
        (folder / "latest").write_text("step_000002")
        log = tmp_path / f"{name}.jsonl"
        args = [*common, *flags, "--save_dir", str(folder), "--resume", "--log_file", str(log)]
        check(run_step(S14, args, nproc=nproc))
        records = read_log(log)
        assert [r["step"] for r in records] == [3, 4]
        for got, want in zip(records, first[2:], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), name
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), name


@pytest.mark.parametrize(
    "flags, nproc, message",
    [
        (["--pp_virtual_stages", "2"], 1, "--pp_virtual_stages 2 is for --pp_engine interleaved"),
        (
            ["--pp_size", "2", "--pp_engine", "interleaved"],
            2,
            "--pp_engine interleaved needs --pp_size 2 or more and --pp_virtual_stages 2 or more",
        ),
        (
            [*INTERLEAVED, "--gradient_accumulation_steps", "3"],
            2,
            "--gradient_accumulation_steps 3 is not a multiple of --pp_size 2",
        ),
        (
            [*INTERLEAVED, "--gradient_accumulation_steps", "2"],
            2,
            "pp_size x pp_virtual_stages = 2 x 2 = 4 chunks of layers is more",
        ),
        (
            ["--pp_size", "2", "--pp_engine", "zb1", "--compile"],
            2,
            "torch.compile does not trace: drop --compile",
        ),
    ],
    ids=["engine", "one-chunk", "micro-batches", "layers", "zb1-compile"],
)
def test_what_cannot_work_is_refused_before_the_first_step(
    flags, nproc, message, capsys, monkeypatch
):
    assert_refused(S14, [*TINY, "--max_steps", "2", *flags], nproc, message, capsys, monkeypatch)


@pytest.mark.parametrize("p, m, v", SHAPES, ids=[f"pp{p}-m{m}-v{v}" for p, m, v in SHAPES])
def test_the_simulator_finds_the_textbook_bubble(p, m, v):
    """tools/simulate_pipeline.py runs the trainer's schedules with forwards of 1 unit and
    backwards of 2 (a chunk's: a v-th of that): each schedule's idle share of the step is
    (p - 1) / (v m + p - 1) exactly, v = 1 for AFAB and 1F1B; ZB-H1's, its backward split into B
    and W of 1 unit each, (p - 1) / (3 m + p - 1)."""
    import simulate_pipeline

    for engine in ["afab", "1f1b", "interleaved", "zb1"]:
        args = simulate_pipeline.parse_args(
            ["--engine", engine, "--pp_size", str(p), "--micro_batches", str(m)]
            + ["--virtual_stages", str(v), "--weight", "1"]
        )
        text, bubble = simulate_pipeline.report(engine, args)
        if engine == "zb1":  # F, B and W of one unit: the W's fill two thirds of 1F1B's
            assert bubble == Fraction(p - 1, 3 * m + p - 1), text
            continue
        chunks = v if engine == "interleaved" else 1
        assert bubble == Fraction(p - 1, chunks * m + p - 1), (engine, text)


def test_the_simulator_takes_its_costs_from_a_trace(tmp_path, capsys):
    """--trace: the medians of a --pp_timeline trace's spans, in quarters of a chunk's forward.
    F, B and W of 1 ms each give ZB-H1's textbook bubble; without W's, a backward twice the
    forward gives 1F1B's; a file that is no trace is refused in one line."""
    import simulate_pipeline

    def trace(name, spans):
        events = [
            {"name": f"{kind}{k}", "cat": kind, "ph": "X", "ts": 0, "dur": dur, "pid": 0, "tid": 0}
            for kind, dur in spans
            for k in range(8)
        ]
        events.append({"name": "other", "cat": "other", "ph": "X", "ts": 0, "dur": 9, "tid": 0})
        path = tmp_path / name
        path.write_text(json.dumps({"traceEvents": events}))
        return str(path)

    zb1 = trace("zb1.json", [("forward", 1000), ("backward", 1000), ("weight gradients", 1000)])
    args = simulate_pipeline.parse_args(["--engine", "zb1", "--trace", zb1])
    assert (args.forward, args.backward, args.weight) == (4, 8, 4)
    assert simulate_pipeline.report("zb1", args)[1] == Fraction(3, 3 * 8 + 3)
    plain = trace("1f1b.json", [("forward", 1000), ("backward", 2000)])
    args = simulate_pipeline.parse_args(["--engine", "1f1b", "--trace", plain])
    assert (args.forward, args.backward) == (4, 8)
    assert simulate_pipeline.report("1f1b", args)[1] == Fraction(3, 8 + 3)
    with pytest.raises(SystemExit) as error:
        simulate_pipeline.parse_args(["--trace", trace("none.json", [])])
    assert error.value.code == 2
    assert "no forward or backward spans" in capsys.readouterr().err
    # --weight splits zb1's backward only: a backward of one unit is fine for the others.
    args = simulate_pipeline.parse_args(["--engine", "1f1b", "--backward", "1"])
    assert simulate_pipeline.report("1f1b", args)[1] == Fraction(3, 8 + 3)
    with pytest.raises(SystemExit):
        simulate_pipeline.parse_args(["--engine", "zb1", "--backward", "1"])
    assert "--weight 1 must be less than --backward 1" in capsys.readouterr().err


def test_zb1_with_zero3_trains_exactly_like_1f1b_with_zero3(tmp_path):
    """dp 2 x pp 2, 4 micro-batches, ZeRO-3: under ZB-H1 each weight hands its gradient over in W,
    one at a time, and a unit reduce-scatters once all of its weights' are in: every loss and
    gradient norm is 1F1B's, and so are the reduce-scatters, one per unit and micro-batch."""
    flags = [*TINY, "--max_steps", "3", "--eval_every", "0", "--sample_tokens", "0"]
    flags += ["--num_hidden_layers", "4", "--dp_size", "2", "--pp_size", "2", "--zero_stage", "3"]
    flags += ["--gradient_accumulation_steps", "4", "--num_proc", "1", "--comm_stats"]
    records = {}
    for engine in ["1f1b", "zb1"]:
        log = tmp_path / f"{engine}.jsonl"
        check(run_step(S14, [*flags, "--pp_engine", engine, "--log_file", str(log)], nproc=4))
        records[engine] = read_log(log)
    pairs = {e: [(r["loss"], r["grad_norm"]) for r in records[e]] for e in records}
    assert pairs["zb1"] == pairs["1f1b"]
    sent = {e: records[e][0]["comm"]["dp_cp"]["reduce-scatter"] for e in records}
    assert sent["zb1"] == sent["1f1b"], sent
