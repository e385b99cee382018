"""Steps 7 and 8: step 7's pieces one at a time (the stages' layers and forward, the messages, a
stage's backward), pipeline gradients against one process for AFAB and 1F1B, no deadlock across a
matrix of stages and micro-batches, the in-flight peaks, and training like step 3."""

import json
from itertools import pairwise
from types import SimpleNamespace

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

AFAB, ONE_F_ONE_B = "step7_pipeline_parallel_afab", "step8_pipeline_parallel_1f1b"
FUNCTION = {"afab": "afab", "1f1b": "one_f_one_b"}  # the function that lists each schedule
ONE = "one process"  # what the pipeline is compared with


def config(layers):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def micro_batches(m):
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (m, 2, 9), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def schedule_worker(rank, world, cases, engines):
    from process_group_manager import ProcessGroupManager

    pgm = ProcessGroupManager(tp_size=1, pp_size=world, dp_size=1)
    for engine in engines:
        for layers, m in cases:
            check_schedule(rank, world, pgm, engine, layers, m)


def check_schedule(rank, world, pgm, engine, layers, m):
    import pipeline_parallel as pp
    from model import LlamaForCausalLM
    from pipeline_timeline import Timeline

    reference = LlamaForCausalLM(config(layers))
    reference.init_weights(seed=9)
    batches = micro_batches(m)
    loss_ref = sum(F.cross_entropy(reference(x).flatten(0, 1), y.flatten()) / m for x, y in batches)
    loss_ref.backward()

    with torch.device("meta"):
        model = pp.keep_stage(LlamaForCausalLM(config(layers)), pgm)
    model.to_empty(device="cpu")
    model.init_weights(seed=9)
    expected_layers = [str(i) for i in pp.stage_layers(layers, rank, world)]
    assert list(model.model.layers.keys()) == expected_layers
    stages = [pp.Stage(pp.PipelineParallel(model), pgm)]
    actions = pp.SCHEDULES[engine](world, m)[rank]
    loss_fn = lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    schedule = Timeline()
    total = pp.run_schedule(actions, stages, batches, loss_fn, (2, 8, 32), torch.device("cpu"),
                            torch.float32, schedule)  # fmt: skip
    where = f"run_schedule ({engine}, {layers} layers, m={m})"
    if pgm.pp_is_last_stage:
        loss = loss_ref.detach()
        assert_matches(total, loss, f"{where}: the loss", rtol=1e-6, atol=1e-6, reference=ONE)
    for name, param in model.named_parameters():
        grad, what = reference.get_parameter(name).grad, f"{where}: the gradient of {name}"
        assert_matches(param.grad, grad, what, rtol=1e-5, atol=1e-7, reference=ONE)
    # Every micro-batch went forward and backward once, in the schedule's order.
    forwards = [f"F{k}" for k in range(1, m + 1)]
    ran = " ".join(schedule.timeline)
    assert sorted(schedule.timeline) == sorted(forwards + [f"B{k}" for k in range(1, m + 1)]), (
        f"{where}, stage {rank} ran {ran}: each micro-batch forward once and backward once, "
        "each in timeline.run"
    )
    expected_peak = m if engine == "afab" else min(world - rank, m)
    assert schedule.peak_in_flight == expected_peak, (
        f"{FUNCTION[engine]}, as run_schedule ran it ({layers} layers, m={m}), stage {rank}: "
        f"{ran}: held at most {schedule.peak_in_flight} (expected {expected_peak})"
    )
    # AFAB runs every forward first; 1F1B its warm-up forwards and one more, then a backward.
    first_backward = m if engine == "afab" else min(world - rank, m)
    assert schedule.timeline[:first_backward] == forwards[:first_backward], (rank, ran)
    assert schedule.timeline[first_backward] == "B1", (rank, ran)


# (layers, micro-batches) per number of stages: uneven layer counts, and accumulation of 1,
# below, equal to and above pp_size.
CASES = {
    2: [(2, 4), (3, 1), (5, 3), (2, 2)],
    3: [(4, 3), (3, 2), (5, 7)],
    4: [(4, 8), (5, 2), (4, 1), (4, 4)],
}


# The engines each step runs: step 7's AFAB, which its exercise grades, and both in step 8.
ENGINES = {"step7": (AFAB, ["afab"]), "step8": (ONE_F_ONE_B, ["afab", "1f1b"])}


@pytest.mark.parametrize("pp", sorted(CASES))
@pytest.mark.parametrize("step", list(ENGINES))
def test_pipeline_gradients_equal_one_process(tmp_path, step, pp):
    """Loss and every gradient, AFAB and 1F1B, against one process with the same accumulation;
    a deadlock fails the test after two minutes."""
    folder, engines = ENGINES[step]
    spawn(folder, schedule_worker, pp, tmp_path, CASES[pp], engines, timeout=120)


def test_stage_layers_are_balanced_and_cover_the_model():
    pp = import_step(AFAB, "pipeline_parallel")
    for layers in range(1, 9):
        for size in range(1, layers + 1):
            stages = [list(pp.stage_layers(layers, r, size)) for r in range(size)]
            where = f"stage_layers({layers} layers, pp_size={size}) gives the stages {stages}"
            assert [i for stage in stages for i in stage] == list(range(layers)), (
                f"{where}: every layer once, in order"
            )
            assert max(map(len, stages)) - min(map(len, stages)) <= 1, (
                f"{where}: no stage more than one layer longer than another"
            )
    got = [list(pp.stage_layers(5, r, 2)) for r in range(2)]
    assert got == [[0, 1, 2], [3, 4]], f"stage_layers: 5 layers over 2 stages are 0-2, 3-4: {got}"


def test_stages_one_after_the_other_are_the_model():
    """PipelineParallel.forward, on one process: each stage's model as keep_stage leaves it, with
    the weights of the single-device model; the stages run one after the other give the model's
    activations where it is cut, and at the end its logits."""
    pp = import_step(AFAB, "pipeline_parallel")
    LlamaForCausalLM = import_step(AFAB, "model").LlamaForCausalLM

    layers = 5
    reference = LlamaForCausalLM(config(layers))
    reference.init_weights(seed=9)
    ids = micro_batches(1)[0][0]  # (B, T)
    for size in (2, 3):
        x, expected = ids, reference.model.embed_tokens(ids)
        for rank in range(size):
            pgm = SimpleNamespace(
                pp_rank=rank, pp_size=size, pp_is_first_stage=rank == 0,
                pp_is_last_stage=rank == size - 1,
            )  # fmt: skip
            with torch.device("meta"):
                model = pp.keep_stage(LlamaForCausalLM(config(layers)), pgm)
            model.to_empty(device="cpu")
            model.init_weights(seed=9)
            kept = pp.stage_layers(layers, rank, size)
            for i in kept:
                expected = reference.model.layers[i](expected)
            if pgm.pp_is_last_stage:
                expected = reference.lm_head(reference.model.norm(expected))
            what = f"PipelineParallel.forward, stage {rank} of {size} (layers "
            what += f"{kept.start}-{kept.stop - 1}): {'logits' if rank == size - 1 else 'output'}"
            x = pp.PipelineParallel(model)(x)
            assert_matches(x, expected, what, rtol=1e-5, atol=1e-6, reference="the model")


def send_recv_worker(rank, world):
    import pipeline_parallel as pp

    generator = torch.Generator().manual_seed(7)
    # A tensor from each rank, transposed: not contiguous in memory, as a stage's output can be.
    tensors = [torch.randn(2, 4, 3, generator=generator).transpose(1, 2) for _ in range(world)]
    peer = 1 - rank
    receive = pp.Recv((2, 3, 4), peer, torch.device("cpu"))  # posted before the peer sends
    dist.barrier()
    send = pp.Send(tensors[rank], peer)
    got = receive.wait()
    what, sent = "Recv.wait: the tensor received", "the other rank sent"
    assert_matches(got, tensors[peer], what, rtol=0, atol=0, reference=sent)
    assert send.wait() is None and isinstance(got, torch.Tensor)


def test_send_and_recv_carry_a_tensor_between_two_stages(tmp_path):
    """Recv and Send, on 2 ranks: each receives the other's tensor, its receive posted before
    the other sends."""
    spawn(AFAB, send_recv_worker, 2, tmp_path, timeout=60)


def test_stage_backward_gives_its_input_gradient():
    """Stage.backward, on one process: a middle stage gets its output's gradient and returns its
    input's; the last starts from its loss; the first returns none. Each also leaves its
    weights' gradients, as autograd gives them."""
    pp = import_step(AFAB, "pipeline_parallel")
    torch.manual_seed(0)
    for rank, place in [(1, "a middle stage"), (2, "the last stage"), (0, "the first stage")]:
        pgm = SimpleNamespace(pp_rank=rank, pp_size=3, pp_group_ids=[0, 1, 2])
        layer = torch.nn.Linear(4, 4)
        reference = torch.nn.Linear(4, 4)
        reference.load_state_dict(layer.state_dict())
        stage = pp.Stage(layer, pgm)
        x = torch.randn(2, 3, 4)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, y_ref = stage.forward(x1), reference(x2)
        grad = torch.randn_like(y)
        if rank == 2:  # the last stage's output is its loss
            y, y_ref, grad = (y * grad).sum(), (y_ref * grad).sum(), None
        got = stage.backward(x1, y, grad)
        y_ref.backward(grad)
        where = f"Stage.backward on {place}"
        if rank == 0:
            returned = type(got).__name__  # its type: pytest would print the whole tensor
            assert returned == "NoneType", f"{where} returns a {returned}: there is no stage before"
        else:
            what = f"{where}: the input's gradient"
            assert_matches(got, x2.grad, what, rtol=1e-6, atol=1e-7, reference="autograd")
        for name, param in layer.named_parameters():
            want, what = reference.get_parameter(name).grad, f"{where}: {name}.grad"
            assert_matches(param.grad, want, what, rtol=1e-6, atol=1e-7, reference="autograd")


def test_bad_pipeline_shapes_are_refused():
    pp = import_step(AFAB, "pipeline_parallel")
    with pytest.raises(ValueError, match="pp_size=4 is larger than num_hidden_layers=3"):
        pp.check_pipeline_parallel(config(3), 4)


def test_smollm_with_tied_embeddings_runs_at_pp2():
    """SmolLM-135M's config ties its embeddings (and keeps its 49152-token vocabulary here): two
    stages take it. tests/test_convergence.py shows that tied layouts train like one process."""
    args = [*TINY, "--model_name", "smollm-135m", "--pp_size", "2", "--max_steps", "2"]
    args += ["--num_proc", "1", "--eval_steps", "1", "--sample_tokens", "2"]
    result = check(run_step(AFAB, args, nproc=2))
    assert "step 2/2 | loss" in result.stdout and "sample:" in result.stdout


def test_too_many_stages_exit_on_every_rank():
    result = run_step(AFAB, [*TINY, "--pp_size", "3"], nproc=3, timeout=120)
    assert result.returncode != 0
    assert "pp_size=3 is larger than num_hidden_layers=2" in result.stdout + result.stderr


def train(step, tmp_path, name, nproc=1, accumulation=4, extra=()):
    log_file = tmp_path / f"{name}.jsonl"
    args = [*TINY, "--num_hidden_layers", "3", "--max_steps", "20"]
    args += ["--gradient_accumulation_steps", str(accumulation), "--eval_every", "10"]
    args += ["--eval_steps", "4", "--num_proc", "1", "--sample_tokens", "8"]
    args += ["--log_file", str(log_file), *extra]
    result = check(run_step(step, args, nproc=nproc))
    return read_log(log_file), result


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Step 3, one process, 3 layers, accumulation 4."""
    return train("step3_dataloader", tmp_path_factory.mktemp("base"), "base")


def test_afab_pp2_uneven_trains_like_one_process(tmp_path, baseline):
    records, result = train(AFAB, tmp_path, "pp2", nproc=2, extra=["--pp_size", "2"])
    assert_same_training(records, baseline[0])
    sample = result.stdout.split("sample:")[1].splitlines()[0]
    assert sample == baseline[1].stdout.split("sample:")[1].splitlines()[0]


def test_1f1b_pp2_dp2_trains_like_one_process(tmp_path, baseline):
    extra = ["--pp_size", "2", "--dp_size", "2", "--pp_engine", "1f1b"]
    records, _ = train(ONE_F_ONE_B, tmp_path, "pp2dp2", nproc=4, accumulation=2, extra=extra)
    assert_same_training(records, baseline[0])


def test_1f1b_pp2_tp2_resumes_like_one_process(tmp_path, baseline):
    save = tmp_path / "ckpt"
    extra = ["--pp_size", "2", "--tp_size", "2", "--pp_engine", "1f1b", "--save_dir", str(save)]
    extra += ["--save_every", "10"]
    records, _ = train(ONE_F_ONE_B, tmp_path, "pp2tp2", nproc=4, extra=extra)
    assert_same_training(records, baseline[0])
    files = sorted(p.name for p in (save / "step_000010").glob("model-*"))
    assert files == [f"model-pp{p}-of-2-tp{t}-of-2.safetensors" for p in (0, 1) for t in (0, 1)]
    (save / "latest").write_text("step_000010")
    resumed, _ = train(ONE_F_ONE_B, tmp_path, "resumed", nproc=4, extra=[*extra, "--resume"])
    assert_same_training(resumed, baseline[0][10:])


@pytest.mark.parametrize("engine", ["1f1b", "afab"])
def test_timeline_flag_prints_each_stage_and_writes_a_trace(tmp_path, engine):
    trace = tmp_path / "timeline" / "pp.json"
    args = [*TINY, "--max_steps", "1", "--pp_size", "2", "--pp_engine", engine]
    args += ["--pp_timeline", str(trace)]
    args += ["--gradient_accumulation_steps", "3", "--num_proc", "1", "--sample_tokens", "2"]
    result = check(run_step(ONE_F_ONE_B, args, nproc=2))
    if engine == "1f1b":
        printed = [["F1", "F2", "B1", "F3", "B2", "B3"], ["F1", "B1", "F2", "B2", "F3", "B3"]]
    else:
        printed = [["F1", "F2", "F3", "B1", "B2", "B3"]] * 2
    for stage, held in enumerate([2, 1] if engine == "1f1b" else [3, 3]):
        schedule = " ".join(printed[stage])
        assert f"pp stage {stage} {engine}: {schedule} | held at most {held}" in result.stdout
    check_pipeline_trace(json.loads(trace.read_text()), printed, engine=engine)


@pytest.mark.parametrize(
    ("step", "engine"),
    [(AFAB, "afab"), (ONE_F_ONE_B, "afab"), (ONE_F_ONE_B, "1f1b")],
    ids=["step7-afab", "step8-afab", "step8-1f1b"],
)
def test_neighbours_post_their_messages_in_the_same_order(monkeypatch, step, engine):
    """NCCL runs the sends and receives between two ranks in the order they were posted, so two
    neighbours must post theirs in the same order (each send facing its receive), or both wait for
    ever. gloo matches them in any order, so the tests above cannot see it. Here each stage runs
    its schedule alone, sends and receives recorded instead of carried out, and the record of
    every pair of neighbours must mirror each other."""
    pp = import_step(step, "pipeline_parallel")

    class Scale(torch.nn.Module):  # a stand-in stage: the schedule only needs a graph
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            return x * self.weight

    class Recorder:
        """Stands in for torch.distributed: notes each send and receive, completes it at once."""

        def __init__(self, rank, posted):
            self.rank, self.posted = rank, posted

        def isend(self, tensor, dst):
            self.posted.setdefault((self.rank, dst), []).append("send")
            return self

        def irecv(self, tensor, src):
            self.posted.setdefault((self.rank, src), []).append("recv")
            return self

        def wait(self):
            pass

    for p, m in [(2, 1), (2, 4), (3, 2), (3, 5), (4, 3), (4, 8)]:
        posted = {}  # (rank, peer) -> "send" and "recv", in the order posted
        for rank in range(p):
            monkeypatch.setattr(pp, "dist", Recorder(rank, posted))
            pgm = SimpleNamespace(pp_rank=rank, pp_size=p, pp_group_ids=list(range(p)))
            batches = [(torch.ones(1, 3), None) for _ in range(m)]
            actions = pp.SCHEDULES[engine](p, m)[rank]
            pp.run_schedule(actions, [pp.Stage(Scale(), pgm)], batches, lambda y, _: y.sum(),
                            (1, 3), torch.device("cpu"), torch.float32)  # fmt: skip
        for rank in range(p - 1):
            ours, theirs = posted[(rank, rank + 1)], posted[(rank + 1, rank)]
            where = f"run_schedule ({engine}, pp_size={p}, m={m}): stage {rank} posts"
            assert len(ours) == 2 * m, (
                f"{where} {len(ours)} messages to stage {rank + 1}, expected {2 * m}: one "
                f"activation and one gradient per micro-batch ({' '.join(ours)})"
            )
            mirrored = ["recv" if kind == "send" else "send" for kind in theirs]
            assert ours == mirrored, (
                f"{where} {' '.join(ours)} to stage {rank + 1}, which posts {' '.join(theirs)}: "
                "each send must face its receive"
            )


def check_pipeline_trace(trace, timelines, engine):
    """A Chrome trace with one named track per stage; on each, a forward and a backward span per
    micro-batch in the printed order, a span for each blocking send and receive (stage 0 sends m
    activations and receives m gradients, the last stage the other way round), and the gaps
    between them as "other": spans that follow each other without overlap, from a clock shared
    by the stages (stage 1's first receive ends after stage 0's first forward: it needs its
    output)."""
    stages, m = len(timelines), len(timelines[0]) // 2
    assert trace["otherData"] == {"engine": engine, "pp_size": stages, "micro_batches": m}
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {s: f"stage {s}" for s in range(stages)}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == set(range(stages)) and min(e["ts"] for e in spans) == 0
    rows = []
    for s in range(stages):
        row = sorted((e for e in spans if e["tid"] == s), key=lambda e: e["ts"])
        for before, after in pairwise(row):
            assert before["ts"] + before["dur"] <= after["ts"], (before, after)
        compute = [e for e in row if e["cat"] in ("forward", "backward")]
        assert [e["name"] for e in compute] == timelines[s]
        assert {e["cat"] for e in row} <= {"forward", "backward", "send", "receive", "other"}
        receives = sum(e["cat"] == "receive" for e in row)
        sends = sum(e["cat"] == "send" for e in row)
        # Between two stages: m messages each way. Sends do not block, except to wait for the
        # one before and, once, for the last ones at the end of the step.
        neighbours = (s > 0) + (s < stages - 1)
        assert receives == m * neighbours
        assert sends == m * neighbours + 1
        rows.append(row)
    for earlier, later in pairwise(rows):
        forward = next(e for e in earlier if e["name"] == "F1")
        receive = next(e for e in later if e["cat"] == "receive")
        assert (
            receive["ts"] + receive["dur"] >= forward["ts"] + forward["dur"] - 1
        )  # 1 µs: rounding
