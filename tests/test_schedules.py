"""Steps 7 and 8: the schedules as data. Each stage's order of forwards and backwards against
PyTorch's own schedules (ScheduleGPipe is AFAB), both what they run and what they list; the
memory each schedule holds; the stages' neighbours around the ring; and the tables the lessons
print, made by `pipeline_parallel.py` itself."""

import subprocess
import sys
import textwrap
from unittest import mock

import pytest
from conftest import ROOT, import_step, step_dir
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

AFAB, ONE_F_ONE_B = "step7_pipeline_parallel_afab", "step8_pipeline_parallel_1f1b"
TORCH = {"afab": (ScheduleGPipe, "GPipe"), "1f1b": (Schedule1F1B, "1F1B")}
# (pp_size, m): torch's 1F1B refuses fewer micro-batches than stages, its GPipe takes them.
SHAPES = {
    "afab": [(2, 1), (2, 4), (3, 2), (3, 5), (4, 4), (4, 8)],
    "1f1b": [(2, 2), (2, 4), (3, 3), (3, 5), (4, 4), (4, 8)],
}


# (step, engine): each schedule in the step that introduces it, which grades it (tools/steps.py),
# and AFAB again in step 8's copy.
ENGINES = [(AFAB, "afab"), (ONE_F_ONE_B, "afab"), (ONE_F_ONE_B, "1f1b")]
ENGINE_IDS = ["step7-afab", "step8-afab", "step8-1f1b"]
FUNCTION = {"afab": "afab", "1f1b": "one_f_one_b"}  # the function that lists each schedule


def ours(engine, p, m, step=ONE_F_ONE_B):
    pp = import_step(step, "pipeline_parallel")
    return [[f"{a.kind}{a.micro_batch}" for a in actions] for actions in pp.SCHEDULES[engine](p, m)]


def torch_runs(engine, p, m):
    """What torch's schedule runs on each rank: its `_step_microbatches`, with a stand-in stage
    that notes each forward and backward and has no messages to send."""
    rows = []
    for rank in range(p):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.num_stages, stage.stage_index = rank, p, p, rank
        stage.is_first, stage.is_last, stage.submod, stage.device = (
            rank == 0,
            rank == p - 1,
            None,
            "cpu",
        )
        order = []
        stage.forward_one_chunk.side_effect = lambda k, *_, order=order, **__: order.append(f"F{k}")
        stage.backward_one_chunk.side_effect = lambda k, order=order, **_: order.append(f"B{k}")
        for name in [
            "get_fwd_recv_ops",
            "get_fwd_send_ops",
            "get_bwd_recv_ops",
            "get_bwd_send_ops",
        ]:
            getattr(stage, name).return_value = []
        TORCH[engine][0](stage, m, loss_fn=None, scale_grads=False)._step_microbatches(
            [()] * m, [{}] * m
        )
        rows.append(order)
    return rows


def torch_lists(engine, p, m):
    """torch's listing of the schedule (`get_schedule_ops`, from `pipeline_order`): the forwards
    and backwards of each rank, without the idle slots and the gradient reduction."""
    listing = get_schedule_ops(TORCH[engine][1], p, m)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return [
        [f"{kinds[a.computation_type.name]}{a.microbatch_index}" for a in row
         if a is not None and a.computation_type.name in kinds]
        for row in listing
    ]  # fmt: skip


@pytest.mark.parametrize(("step", "engine"), ENGINES, ids=ENGINE_IDS)
def test_each_stage_runs_what_torch_runs(step, engine):
    for p, m in SHAPES[engine]:
        mine, theirs = ours(engine, p, m, step), torch_runs(engine, p, m)
        assert mine == theirs, (
            f"{FUNCTION[engine]}(pp_size={p}, m={m}) lists {mine}, torch's "
            f"{TORCH[engine][1]} runs {theirs} (micro-batches counted from 0)"
        )


@pytest.mark.parametrize("engine", ["afab", "1f1b"])
def test_each_stage_runs_what_torch_lists(engine):
    """The listing agrees with what runs, but for 1F1B's last rank: torch 2.13 lists it as F1 B0
    F2 B1 ... Fm B(m-1), every forward one micro-batch late and an Fm that does not exist
    (`Schedule1F1B._get_pipeline_order` steps its forward counter before the first forward when a
    rank has no warm-up). `_step_microbatches` runs F0 B0 F1 B1 ..., as ours does (the test
    above): the listing is wrong there, not the schedule."""
    for p, m in SHAPES[engine]:
        mine, listed = ours(engine, p, m), torch_lists(engine, p, m)
        assert mine[:-1] == listed[:-1], (engine, p, m)
        late = [f"F{int(op[1:]) + 1}" if op[0] == "F" else op for op in mine[-1]]
        assert listed[-1] in (mine[-1], late), (engine, p, m, listed[-1])


@pytest.mark.parametrize(("step", "engine"), ENGINES, ids=ENGINE_IDS)
def test_what_each_schedule_holds(step, engine):
    """Every micro-batch forward once and backward once, its forward first; AFAB holds all m,
    1F1B at most pp_size - pp_rank (never more than m). The lesson's table (pp_size 4, m = 8)
    first, then pp_size 1 to 5 with m 1 to 9."""
    pp = import_step(step, "pipeline_parallel")
    for p, m in [(4, 8), *((p, m) for p in range(1, 6) for m in range(1, 10))]:
        for r, actions in enumerate(pp.SCHEDULES[engine](p, m)):
            bound = m if engine == "afab" else min(p - r, m)
            order = [str(a) for a in actions]
            where = f"{FUNCTION[engine]}(pp_size={p}, m={m}), stage {r}: {' '.join(order)}"
            for k in range(1, m + 1):
                assert order.count(f"F{k}") == order.count(f"B{k}") == 1, (
                    f"{where}: F{k} and B{k} must each run once"
                )
                assert order.index(f"F{k}") < order.index(f"B{k}"), f"{where}: B{k} before F{k}"
            held = pp.held(actions)
            assert held == bound, f"{where}: held at most {held} (expected {bound})"


def test_stages_find_their_neighbours_around_the_ring():
    """Chunk c of rank r is stage c * pp_size + r of the pipeline: with two chunks on four ranks,
    rank 3's chunk 0 sends to rank 0's chunk 1, which receives from rank 3."""
    from types import SimpleNamespace

    pp = import_step(AFAB, "pipeline_parallel")
    ids = [10, 11, 12, 13]  # the pipeline's global ranks
    stage = lambda rank, chunk, chunks=2: pp.Stage(
        None, SimpleNamespace(pp_rank=rank, pp_size=4, pp_group_ids=ids), chunk, chunks
    )
    places = {(r, c): (stage(r, c).is_first, stage(r, c).is_last) for r in range(4) for c in (0, 1)}
    assert places == {
        (r, c): ((r, c) == (0, 0), (r, c) == (3, 1)) for r in range(4) for c in (0, 1)
    }, f"Stage.__init__: (is_first, is_last) of (rank, chunk), two chunks on 4 ranks: {places}"
    assert (stage(3, 0).next_rank, stage(0, 1).prev_rank) == (10, 13), (
        "Stage.__init__: rank 3's chunk 0 sends to rank 0 (global rank 10), which receives from "
        f"rank 3 (13); got next_rank {stage(3, 0).next_rank}, prev_rank {stage(0, 1).prev_rank}"
    )
    neighbours = [(stage(r, 0).prev_rank, stage(r, 0).next_rank) for r in range(4)]
    want = [(13, 11), (10, 12), (11, 13), (12, 10)]
    assert neighbours == want, (
        f"Stage.__init__: (prev_rank, next_rank) of ranks 0 to 3 (global ranks 10 to 13) are "
        f"{neighbours}, expected {want}"
    )
    assert (stage(0, 0, 1).is_first, stage(3, 0, 1).is_last) == (True, True), (
        "Stage.__init__: with one chunk, rank 0 is the first stage and rank 3 the last"
    )


def table(step, *args):
    script = step_dir(step) / "pipeline_parallel.py"
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True)


@pytest.mark.parametrize("step", [AFAB, ONE_F_ONE_B])
def test_the_lesson_shows_the_table_the_code_prints(step):
    result = table(step, "--pp_size", "4", "--gradient_accumulation_steps", "8")
    assert result.returncode == 0, result.stderr
    text = (ROOT / step / "README.md").read_text()  # shown as is, or inside a list item
    assert result.stdout in text or textwrap.indent(result.stdout, "  ") in text
    refused = table(step, "--pp_size", "0")
    assert (
        refused.returncode == 2
        and "--pp_size and --gradient_accumulation_steps must be at least 1" in (refused.stderr)
    )
    assert "Traceback" not in refused.stderr
