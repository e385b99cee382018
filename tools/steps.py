"""Find the step folders of the course and the files that belong to each step.

A step folder sits at the repository root and is named `step<number>_<topic>`; the steps are
ordered by their number (step10 comes after step9). A file belongs to a step when git tracks it
or would track it: untracked files count as soon as they exist (so a new file is part of the step
before it is committed), ignored files never do, and neither does anything in `__pycache__` or
ending in `.pyc`, even if it was committed by mistake.
"""

import os
import re
import subprocess
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

STEP_NAME = re.compile(r"step(\d+)_[A-Za-z0-9_]+")


def git(root: Path, *args: str) -> bytes:
    """Run git in `root` and return its stdout; a failure raises with git's own message."""
    result = subprocess.run(["git", "-C", str(root), *args], capture_output=True)
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"`git {' '.join(args)}` failed in {root}: {message}")
    return result.stdout


def step_number(folder: Path) -> int:
    match = STEP_NAME.fullmatch(folder.name)
    assert match, f"{folder.name} is not a step folder"
    return int(match.group(1))


def step_folders(root: Path) -> list[Path]:
    """The step folders at the root, ordered by their number (as numbers: 9 before 10)."""
    folders = [p for p in root.iterdir() if p.is_dir() and STEP_NAME.fullmatch(p.name)]
    folders.sort(key=step_number)
    for earlier, later in pairwise(folders):
        if step_number(earlier) == step_number(later):
            raise ValueError(
                f"two folders for step {step_number(later)}: {earlier.name}, {later.name}"
            )
    return folders


def step_modules(root: Path) -> list[str]:
    """The names of the Python modules the step folders hold (model, train, ...). The steps share
    them: a process that imports two steps' modules drops these from its cache in between."""
    return sorted({p.stem for step in step_folders(root) for p in step.glob("*.py")})


def is_build_output(path: str) -> bool:
    return "__pycache__" in path.split("/") or path.endswith(".pyc")


def step_files(root: Path, step: Path) -> list[str]:
    """Files of one step, as sorted posix paths relative to the step folder."""
    # --cached: tracked files; --others --exclude-standard: untracked files git does not ignore.
    listing = ["ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    out = git(root, *listing, "--", step.name)
    prefix = step.name + "/"
    files = set()
    for name in os.fsdecode(out).split("\0"):
        if not name.startswith(prefix) or is_build_output(name):
            continue
        # A tracked file deleted from the working tree is no longer part of the step.
        if (root / name).is_file():
            files.add(name[len(prefix) :])
    return sorted(files)


# ---- The manifest: the course's steps in one table ---------------------------------------------


@dataclass(frozen=True)
class Blank:
    """A function of a step's exercise (tools/exercise.py): `name` in the step's file `file` (a
    function, or `Class.method`), whose body the learner writes. `hint`: how to write it, call by
    call. With a `nudge` (what the function is for, not how), hints come in two levels: the
    emptied function raises the nudge and `start` lists it, and `hint` is shown only when asked
    (`exercise.py hint DIR NAME`); without one, `hint` is what both show. `traps`: what a
    reasonable first try gets wrong, said up front. `installed`: a graded test that runs the
    function inside the model that the step's plan builds; the grader runs it on the step's code
    with only this function (and the others installed by it) the learner's, before that test on
    the learner's whole copy."""

    file: str
    name: str
    hint: str
    nudge: str = ""
    traps: tuple[str, ...] = ()
    installed: str = ""


@dataclass(frozen=True)
class Step:
    """One step of the course. `changes`: the files it adds or changes from the step before (every
    other file is that step's, byte for byte); `frozen`: those of them that no later step changes.
    What the tools run for it: `convergence`, its layouts trained against one device, each
    (name, processes, flags, the divisor of the baseline's gradient accumulation); `memory`, the
    layout of its row in tools/memory_table.py; `bench`, the parts of tools/bench.py that measure
    its technique against PyTorch's (its name: processes). Its exercise: `blanks`, the functions
    to write, in the order to write them; `graded`, the tests that grade them (pytest node ids),
    smallest first: each layer against its single-device reference, then the collectives
    counted, then the whole layout against one device."""

    folder: str
    changes: tuple[str, ...]
    frozen: tuple[str, ...] = ()
    convergence: tuple[tuple, ...] = ()
    memory: dict | None = None
    bench: dict = field(default_factory=dict)
    blanks: tuple[Blank, ...] = ()
    graded: tuple[str, ...] = ()

    @property
    def number(self):
        return int(STEP_NAME.fullmatch(self.folder).group(1))


DP2_BUCKETS = ("--dp_size", "2", "--bucket_size_mb", "0.05")  # several buckets for a tiny model
PP2 = ("--pp_size", "2", "--pp_engine")  # then the engine
GRID = ("--tp_size", "2", "--dp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b")
ZERO3 = ("--zero_stage", "3")
SP2 = ("--tp_size", "2", "--sequence_parallel")
INTERLEAVED = ("--pp_size", "2", "--pp_engine", "interleaved", "--pp_virtual_stages", "2")
ZB1 = ("--pp_size", "2", "--pp_engine", "zb1")
MOE = ("--model_name", "tiny-moe")
EP2 = ("--ep_size", "2")
# Step 4: f and g first, each with the layer that uses it; then the vocabulary's two layers, the
# gather of the logits, and the plan that puts them all in the model.
TP = "tensor_parallel.py"
TP_BLANKS = (
    Blank(TP, "Copy.forward", "f is the identity forward; keep the group in ctx for backward"),
    Blank(TP, "Copy.backward",
          "every rank's slice read the whole input: all-reduce the gradient over ctx.group"),
    Blank(TP, "ColumnParallelLinear.forward",
          "a local matmul with this rank's rows of the weight: its slice of the output features"),
    Blank(TP, "Reduce.forward", "g sums the ranks' partial results: an all-reduce over group"),
    Blank(TP, "Reduce.backward", "the gradient of a sum reaches every term whole: the identity"),
    Blank(TP, "RowParallelLinear.forward",
          "this rank's columns of the weight give a partial sum of the output; g adds them up"),
    Blank(TP, "VocabParallelEmbedding.forward",
          "look up the ids in [vocab_start, vocab_start + vocab_per_partition), zeros for the "
          "others, then g"),
    Blank(TP, "vocab_parallel_cross_entropy",
          "log(sum exp(z - m)) - (z_target - m): the max m, the sum and the target's logit "
          "reduced over group"),
    Blank(TP, "Gather.forward",
          "all-gather the ranks' slices, side by side along the last dim; keep the group in ctx"),
    Blank(TP, "Gather.backward", "keep this rank's slice of the gradient, along the last dim"),
    Blank(TP, "apply_tensor_parallel",
          "swap what PLAN names, embed_tokens and lm_head; f on every norm's output (a forward "
          "hook); tie_weights"),
)  # fmt: skip
TP_TESTS = "tests/test_tensor_parallel.py::"
TP_GRADED = (
    *(f"{TP_TESTS}test_layer_matches_dense[{layer}]"
      for layer in ("column", "row", "embedding", "cross_entropy", "gather")),
    f"{TP_TESTS}test_two_all_reduces_forward_and_two_backward_per_block[untied]",
    f"{TP_TESTS}test_model_matches_single_device[untied]",
    f"{TP_TESTS}test_tp2_trains_like_one_process",
)  # fmt: skip
# Step 7: the cut (which layers a stage holds, what it runs), the schedule as data, the messages,
# the stage's seam, then the executor that runs a schedule with them.
PP = "pipeline_parallel.py"
PP_BLANKS = (
    Blank(PP, "stage_layers",
          "consecutive layers; when pp_size does not divide num_layers, the first stages take "
          "one more"),
    Blank(PP, "PipelineParallel.forward",
          "what this stage kept, in the model's order: embed_tokens, its layers, then norm and "
          "lm_head"),
    Blank(PP, "afab", "each stage's list of actions: every micro-batch forward, then every one "
          "backward"),
    Blank(PP, "Recv.__init__",
          "post a non-blocking receive from peer into a new buffer of this shape; keep both"),
    Blank(PP, "Recv.wait", "wait until the tensor has arrived, then give it"),
    Blank(PP, "Send.__init__",
          "start a non-blocking send to peer, of the tensor made contiguous and kept alive"),
    Blank(PP, "Send.wait", "wait until the tensor has left"),
    Blank(PP, "Stage.__init__",
          "this chunk's place in the pipeline, chunk * pp_size + pp_rank: first? last? and the "
          "global ranks before and after it around the ring"),
    Blank(PP, "Stage.backward",
          "autograd from y, grad its gradient (None: y is the loss); x's gradient goes to the "
          "stage before"),
    Blank(PP, "run_schedule",
          "F: the input (received one forward ahead unless first), forward, loss / m on the last, "
          "send it on; B: the gradient (unless last), backward, send x's gradient back"),
)  # fmt: skip
PP_TESTS, SCHEDULE_TESTS = "tests/test_pipeline_parallel.py::", "tests/test_schedules.py::"
PP_GRADED = (
    f"{PP_TESTS}test_stage_layers_are_balanced_and_cover_the_model",
    f"{PP_TESTS}test_stages_one_after_the_other_are_the_model",
    f"{SCHEDULE_TESTS}test_each_stage_runs_what_torch_runs[step7-afab]",
    f"{PP_TESTS}test_send_and_recv_carry_a_tensor_between_two_stages",
    f"{SCHEDULE_TESTS}test_stages_find_their_neighbours_around_the_ring",
    f"{PP_TESTS}test_stage_backward_gives_its_input_gradient",
    f"{PP_TESTS}test_neighbours_post_their_messages_in_the_same_order[step7-afab]",
    *(f"{PP_TESTS}test_pipeline_gradients_equal_one_process[step7-{pp}]" for pp in (2, 3, 4)),
    f"{PP_TESTS}test_afab_pp2_uneven_trains_like_one_process",
)
# Step 8: one more schedule, the list of actions of 1F1B; step 7's executor runs it.
ONE_F_ONE_B_BLANKS = (
    Blank(PP, "one_f_one_b",
          "the warm-up's forwards, then one forward and one backward (the oldest held) in turn, "
          "then the backwards left"),
)  # fmt: skip
ONE_F_ONE_B_GRADED = (
    f"{SCHEDULE_TESTS}test_what_each_schedule_holds[step8-1f1b]",
    f"{SCHEDULE_TESTS}test_each_stage_runs_what_torch_runs[step8-1f1b]",
    f"{PP_TESTS}test_neighbours_post_their_messages_in_the_same_order[step8-1f1b]",
    "tests/test_comm_stats.py::test_pipeline_passes_one_activation_and_one_gradient_per_micro_batch",
    *(f"{PP_TESTS}test_pipeline_gradients_equal_one_process[step8-{pp}]" for pp in (2, 3, 4)),
    f"{PP_TESTS}test_1f1b_pp2_dp2_trains_like_one_process",
)
# Step 2: the grid, the rows of a group's ranks in it, then the manager that places this rank and
# makes the groups.
PGM = "process_group_manager.py"
PGM_BLANKS = (
    Blank(PGM, "grid",
          "the world's ranks in one dimension per entry of AXES, in that order: the last varies "
          "fastest"),
    Blank(PGM, "group_ranks",
          "the other axes of the grid to the front, these to the back; then one row of ranks per "
          "group"),
    Blank(PGM, "ProcessGroupManager.__init__",
          "check_sizes; global_rank, world_size, the grid; per axis {axis}_rank, _size, _group, "
          "_group_ids; the pp stages' first, last, prev and next"),
    Blank(PGM, "ProcessGroupManager.group",
          "the first call for some axes makes every one of their groups, on every rank, with the "
          "timeout; keep this rank's and its ranks"),
)  # fmt: skip
PGM_TESTS = "tests/test_process_group_manager.py::"
PGM_GRADED = (
    f"{PGM_TESTS}test_grid_layout_tp_fastest",
    f"{PGM_TESTS}test_group_ranks_are_the_permuted_grids",
    f"{PGM_TESTS}test_groups_from_axis_names_are_the_permuted_grids[2-3-1-4]",
    f"{PGM_TESTS}test_grid_membership[2-2-2]",
    "tests/test_train.py::test_step2_every_rank_trains_its_own_copy",
)
# Step 5: the wrapper's hooks and their all-reduce, then each dp rank's share of the batches.
DP = "data_parallel.py"
NAIVE_BLANKS = (
    Blank(DP, "DataParallelNaive.__init__",
          "keep module, dp_group, dp_size and require_backward_grad_sync (True); on each trainable "
          "parameter, a hook that runs once its gradient has accumulated"),
    Blank(DP, "DataParallelNaive._all_reduce_grad",
          "on the last micro-batch only: param.grad becomes its average over dp_group, in place"),
    Blank("dataloader.py", "MicroBatchDataLoader.__next__",
          "micro-batch k of dp rank r is micro-batch k * dp_size + r of step 3's stream; position "
          "counts every rank's rows"),
)  # fmt: skip
DP_TESTS = "tests/test_data_parallel.py::"
NAIVE_GRADED = (
    *(f"{DP_TESTS}test_naive_gradients_equal_one_process_and_ddp[{m}]" for m in (1, 3)),
    f"{DP_TESTS}test_loader_split_is_disjoint_and_covers_one_process",
    f"{DP_TESTS}test_naive_all_reduces_each_gradient_once_a_step",
    f"{DP_TESTS}test_dp2_trains_like_one_process[step5_data_parallel_naive]",
)
# Step 6: the buckets' layout, a bucket's launch, all-reduce and wait, then the wrapper's hook and
# its wait.
BUCKET_BLANKS = (
    Blank(DP, "BucketManager.__init__",
          "fill buckets of up to bucket_size bytes of grad_dtype in backward's order (the "
          "parameters reversed); main_grad: a view of its bucket's buffer; bucket_of"),
    Blank(DP, "Bucket.mark_ready", "launch the bucket when the last of its parameters is ready"),
    Blank(DP, "Bucket.sync_gradient",
          "average the buffer over dp_group by an asynchronous all-reduce, its handle in "
          "self.handle (at dp 1: nothing to send)"),
    Blank(DP, "Bucket.wait",
          "a bucket that no hook launched (a parameter without gradient) launches now; then wait "
          "for its handle"),
    Blank(DP, "DataParallelBucket._accumulate_grad",
          "add the micro-batch's grad into main_grad and free it; on the last micro-batch, tell "
          "the timeline, and the bucket that this parameter is ready"),
    Blank(DP, "DataParallelBucket.finish_gradient_synchronization",
          "wait for every bucket, under timeline.wait(); then each main_grad is its parameter's "
          ".grad, in the parameter's dtype"),
)  # fmt: skip
BUCKET_GRADED = (
    f"{DP_TESTS}test_bucket_sizes_count_real_bytes",
    f"{DP_TESTS}test_bucket_launches_when_full_and_averages",
    *(f"{DP_TESTS}test_bucket_gradients_equal_one_process_naive_and_ddp[{m}]" for m in (1, 3)),
    f"{DP_TESTS}test_parameter_without_gradient_does_not_hang",
    "tests/test_comm_stats.py::test_data_parallel_all_reduces_the_gradients_once",
    f"{DP_TESTS}test_dp2_trains_like_one_process[step6_data_parallel_bucket]",
)
# Step 10: a bucket cut into shards and its reduce-scatter, the optimizer's pieces, the all-gather
# of the updated shards, then the norm from the shards.
ZERO = "zero.py"
ZERO_BLANKS = (
    Blank(ZERO, "ShardedBucket.__init__",
          "a zero fp32 buffer of dp_size equal shards (padded) for Bucket; this rank's start, end "
          "and grad_shard, a view; each parameter's main_grad view and offset"),
    Blank(ZERO, "ShardedBucket.in_shard",
          "where each parameter's run [offset, offset + numel) meets [start, end): (param, first, "
          "lo, hi)"),
    Blank(ZERO, "ShardedBucket.sync_gradient",
          "average in place: an asynchronous reduce-scatter of the buffer into grad_shard, its "
          "handle in self.handle (at dp 1: nothing to send)"),
    Blank(ZERO, "DataParallelZero1.finish_gradient_synchronization",
          "wait for every bucket, under timeline.wait(); no parameter gets a .grad"),
    Blank(ZERO, "DataParallelZero1.shard",
          "for each run in_shard of the wanted parameters: a detached view, its run of the buffer "
          "as .grad; (piece, first) in self.pieces"),
    Blank(ZERO, "ShardedBucket.start_all_gather",
          "this rank's updated runs into its shard of the buffer, then an asynchronous all-gather "
          "of the buffer: return its handle"),
    Blank(ZERO, "ShardedBucket.copy_parameters_out", "each parameter takes its run of the buffer"),
    Blank(ZERO, "DataParallelZero1.all_gather_parameters",
          "start every bucket's all-gather, then wait for each in turn and copy its parameters "
          "out"),
    Blank(ZERO, "DataParallelZero1.gradients",
          "this rank's pieces for placement's clip_grad_norm (each run in its shard over its "
          "placed axes and shard_axes; a tied copy left out), every grad_shard to be clipped"),
)  # fmt: skip
ZERO_TESTS = "tests/test_zero1.py::"
ZERO_GRADED = (
    *(f"{ZERO_TESTS}test_piece_matches_one_process[{piece}]"
      for piece in ("layout", "in_shard", "reduce_scatter", "shard", "all_gather", "clip")),
    "tests/test_comm_stats.py::test_zero1_sends_the_bytes_of_data_parallel",
    f"{ZERO_TESTS}test_sharded_adamw_equals_adamw_on_one_process",
    f"{ZERO_TESTS}test_trains_like_step9[dp2-reference]",
)  # fmt: skip
# Step 11: the merge of two partial softmaxes, which blocks a rank computes, the ring's messages;
# then ring attention forward and backward, and the layer that feeds it its chunks' positions.
CP = "context_parallel.py"
CP_BLANKS = (
    Blank(CP, "merge",
          "each part was normalised by exp(its lse): renormalise both by the merged one and add; "
          "return the merged lse too"),
    Blank(CP, "blocks",
          "(i, j, causal) for this rank's query chunk i and the source's key chunk j, unless every "
          "key comes after every query"),
    Blank(CP, "ring_send_recv",
          "post in one batch a send of each tensor to the next rank of the group and a receive of "
          "its shape from the one before"),
    Blank(CP, "RingAttention.forward",
          "cp_size steps: attend to the k, v block held (spans) while it travels on, merge in "
          "fp32; save what backward needs"),
    Blank(CP, "RingAttention.backward",
          "the blocks go around again: attend_backward with the final out and lse; each block's "
          "dk, dv travel with it and come home"),
    Blank(CP, "ContextParallelAttention.forward",
          "q, k, v as in LlamaAttention; RoPE at the global positions of this rank's chunks; "
          "RingAttention; o_proj"),
)  # fmt: skip
CP_TESTS = "tests/test_context_parallel.py::"
CP_GRADED = (
    f"{CP_TESTS}test_merge_gives_attention_over_both_blocks",
    f"{CP_TESTS}test_blocks_are_the_causal_half_shared_evenly",
    f"{CP_TESTS}test_ring_send_recv_passes_to_the_next_rank",
    *(f"{CP_TESTS}test_ring_attention_equals_full_attention[{part}]"
      for part in ("forward", "backward", "layer")),
    "tests/test_comm_stats.py::test_context_parallel_passes_key_value_blocks_around_the_ring",
    f"{CP_TESTS}test_trains_like_step3[cp2]",
)  # fmt: skip
# The graded tests that run a function inside the model a step's plan builds (Blank.installed).
IN_ZERO3_FORWARD = "tests/test_zero3.py::test_piece_matches_one_process[step12-forward]"
IN_ZERO3_BACKWARD = "tests/test_zero3.py::test_piece_matches_one_process[step12-backward]"
IN_SP_MODEL = "tests/test_sequence_parallel.py::test_piece_matches_one_process[step13-model]"
IN_RECOMPUTE_MODEL = (
    "tests/test_sequence_parallel.py::test_piece_matches_one_process[step13-apply_recompute]"
)
IN_ZB_MODEL = (
    "tests/test_pipeline_schedules.py::test_b_then_w_gives_autograds_gradients[step14-model]"
)
# Step 12: ZeRO-2's buckets that live while they travel; then ZeRO-3: each rank's rows, a unit's
# whole weights gathered, used and freed, its gradient reduce-scattered, the hooks around each
# unit's forward and backward, and the norm from the pieces.
FSDP = "fully_sharded.py"
ZERO3_BLANKS = (
    Blank(ZERO, "DataParallelZero1._accumulate_grad",
          "stage 1: DataParallelBucket's; stage 2, every micro-batch: wait for the bucket if it "
          "travels, allocate, add grad into main_grad and drop it, tell the timeline, mark it "
          "ready; once it leaves, wait for the others",
          nudge="stage 2 keeps a bucket's whole buffer only while it travels: every micro-batch "
          "fills it and sends it; stage 1 stays step 10's",
          traps=(
              "a bucket may still be on its way from the last micro-batch when this one's first "
              "gradient reaches it: wait for it before filling it again",
          ),
    ),
    Blank(ZERO, "ShardedBucket.wait",
          "stage 1: Bucket's wait; stage 2, while a whole buffer exists: wait, add the shard that "
          "arrived to grad_shard, then drop the buffer, received, the handle, ready and each "
          "main_grad",
          nudge="what arrives is this micro-batch's average of your shard: the earlier "
          "micro-batches' are in grad_shard already",
          traps=(
              "overwriting grad_shard instead of adding to it passes with one micro-batch and "
              "fails with two",
          ),
    ),
    Blank(FSDP, "shard_parameters",
          "a Split on dim 0 per axis of more than one rank; each parameter: a ValueError unless "
          "they divide its rows, then its record extended and a meta Parameter of its rows; "
          "init_piece where no init_parameter",
          nudge="before any weight exists, each parameter gets its 1/R of the rows: in its "
          "placement record, and as a meta Parameter of that size",
          traps=(
              "R is every shard axis's size multiplied (dp and cp), not dp alone",
          ),
          installed=IN_ZERO3_FORWARD,
    ),
    Blank(FSDP, "Unit.free",
          "resize the whole weights' storage to 0 (the views autograd saved stay, empty); not "
          "gathered",
          nudge="give back the whole weights' memory without taking away the tensor that autograd "
          "saved views of",
          traps=(
              "dropping the Python reference frees nothing while autograd holds views of it: the "
              "storage itself must shrink",
          ),
          installed=IN_ZERO3_FORWARD,
    ),
    Blank(FSDP, "Unit.start_gather",
          "unless gathered or on its way: received, R shards, filled by an asynchronous "
          "all-gather of shard, its handle in self.handle (at R 1: a copy, nothing to wait for)",
          nudge="start the unit's all-gather without waiting for it; a second call while it "
          "travels does nothing",
          traps=(
              "at R 1 there is nothing to send and no handle to wait for",
          ),
          installed=IN_ZERO3_FORWARD,
    ),
    Blank(FSDP, "Unit.gather",
          "unless gathered: start_gather and wait; full's memory back; each piece's R blocks of "
          "rows, one per rank, at R times its offset; drop received; gathered",
          nudge="the all-gather's buffer is laid out rank by rank; each parameter's whole rows "
          "must be put together from its block in every rank's part",
          traps=(
              "a parameter's whole rows are not one run of the gathered buffer: they are R "
              "blocks, one in each rank's shard",
          ),
          installed=IN_ZERO3_FORWARD,
    ),
    Blank(FSDP, "Unit.use_whole",
          "each piece's whole parameter, a view of full at R times its offset, R times its rows; "
          "each use's module._parameters[name] becomes it",
          nudge="the modules must compute with views of the gathered weights, not with their "
          "pieces",
          traps=(
              "a tied weight has two uses, and autograd must see the view in the module's "
              "_parameters, not in an attribute of its own",
          ),
          installed=IN_ZERO3_FORWARD,
    ),
    Blank(FSDP, "Unit.reduce_scatter",
          "full.grad as R rows of shards (a parameter's block r of rows at its place in row r), "
          "divided by R, reduce-scattered; add each run to its piece's .grad; measure, drop "
          "full.grad, free",
          nudge="gather's opposite: lay the whole gradient out as the ranks' shards, average over "
          "the ranks, and keep your own",
          traps=(
              "summed instead of averaged, the losses look the same (AdamW and clipping hide a "
              "factor of R): only the gradients' size shows it",
          ),
          installed=IN_ZERO3_BACKWARD,
    ),
    Blank(FSDP, "FullyShardedDataParallel.before_forward",
          "gather the unit, start the next one's all-gather (after: prefetch), measure, then its "
          "modules use the whole weights",
          nudge="this unit must be here before it computes, and the next one already on its way",
          traps=(
              "without the prefetch the logits are still right, and the forward's test fails all "
              "the same: it checks that the next unit was asked for early",
          ),
    ),
    Blank(FSDP, "FullyShardedDataParallel.after_forward",
          "the pieces back and the whole weights freed; if backward will come (grad enabled, "
          "output requires grad), before_backward as a hook on output's gradient",
          nudge="the whole weights go as soon as the unit's forward is done; backward will want "
          "them again",
          traps=(
              "under torch.no_grad (evaluation, sampling), or for an output that needs no "
              "gradient, no backward comes to hook",
          ),
    ),
    Blank(FSDP, "FullyShardedDataParallel.before_backward",
          "gather the unit again, start the one before's all-gather (prefetch), measure; the "
          "gradient passes unchanged",
          nudge="backward has reached the unit: its weights must be back, and the unit before it "
          "asked for",
          traps=(
              "a hook on a tensor's gradient replaces the gradient with what it returns",
          ),
    ),
    Blank(FSDP, "FullyShardedDataParallel.gradients",
          "the .grad of the pieces tied counts, each over its placed axes, for placement's "
          "clip_grad_norm over tp, pp and the shard axes; every .grad to be clipped",
          nudge="one norm for the whole model, from the pieces the ranks hold",
          traps=(
              "a tied weight held on two stages counts once",
          ),
    ),
)  # fmt: skip
ZERO3_TESTS = "tests/test_zero3.py::"
ZERO3_GRADED = (
    f"{ZERO3_TESTS}test_piece_matches_one_process[step12-stage_2]",
    f"{ZERO3_TESTS}test_shard_parameters_gives_each_rank_its_rows",
    *(f"{ZERO3_TESTS}test_piece_matches_one_process[step12-{piece}]"
      for piece in ("gather", "use_whole", "reduce_scatter", "forward", "backward", "clip")),
    f"{ZERO3_TESTS}test_stage_3_sends_half_again_as_much",
    f"{ZERO3_TESTS}test_stage_3_equals_fully_shard",
    *(f"{ZERO3_TESTS}test_stages_2_and_3_train_like_stage_1[{stage}]" for stage in (2, 3)),
)  # fmt: skip
# Step 13: the sequence's all-gather and reduce-scatter, f and g made of them, the norms on a
# rank's tokens and the plan that swaps them in; then recomputation, whole or of attention, and
# the plan that wraps the layers.
SP, RECOMPUTE = "sequence_parallel.py", "recompute.py"
SP_BLANKS = (
    Blank(SP, "gather_sequence",
          "at tp 1, x; else the sequence dim to the front, contiguous, all_gather_single into tp "
          "times the tokens, and back",
          nudge="every rank's tokens, side by side along the sequence, on every rank",
          traps=(
              "the collective lays the ranks' pieces one after the other along dim 0, and dim 0 "
              "is the batch",
          ),
          installed=IN_SP_MODEL,
    ),
    Blank(SP, "reduce_scatter_sequence",
          "at tp 1, x; else the sequence dim to the front, contiguous, reduce_scatter_single into "
          "a tp-th of the tokens, and back",
          nudge="the sum of the ranks' partial results, each rank keeping its own tokens",
          traps=(
              "the collective cuts along dim 0, and dim 0 is the batch",
          ),
          installed=IN_SP_MODEL,
    ),
    Blank(SP, "GatherSequence.forward",
          "keep the group in ctx; gather_sequence",
          nudge="f under sequence parallelism, forward: the sequence made whole",
          installed=IN_SP_MODEL,
    ),
    Blank(SP, "GatherSequence.backward",
          "each rank's gradient is a partial sum for every token: reduce_scatter_sequence it "
          "(None for the group)",
          nudge="each rank's gradient covers every token, but only its own heads' or MLP slice's "
          "share: what makes it this rank's tokens, summed?",
          installed=IN_SP_MODEL,
    ),
    Blank(SP, "ScatterSequence.forward",
          "keep the group in ctx; reduce_scatter_sequence",
          nudge="g under sequence parallelism, forward: the partial sums added, each rank keeping "
          "its tokens",
          installed=IN_SP_MODEL,
    ),
    Blank(SP, "ScatterSequence.backward",
          "every rank's partial sum met every token: gather_sequence the gradient (None for the "
          "group)",
          nudge="each rank's output gradient holds its own tokens; the input met every token",
          installed=IN_SP_MODEL,
    ),
    Blank(SP, "norm_forward",
          "RMSNorm's forward on this rank's tokens, the weight in _parameters swapped for "
          "Copy.apply(weight, tp_group) for the call, put back even on an error",
          nudge="the norm meets this rank's tokens only, so its weight's gradient is one part of "
          "a sum over tp",
          traps=(
              "once apply_sequence_parallel has installed it, `norm.forward` and `norm(x)` are "
              "this function: calling either recurses for ever (the model's own is "
              "RMSNorm.forward)",
              "the norm's weight must be its parameter again after the call, even when the call "
              "raises",
          ),
          installed=IN_SP_MODEL,
    ),
    Blank(SP, "set_sequence_parallel",
          "on each RowParallelLinear and VocabParallelEmbedding g: ScatterSequence if on, else "
          "Reduce; on each RMSNorm f: GatherSequence or Copy",
          nudge="choose f and g on every layer that has them, for the mode asked",
          traps=(
              "it must switch both ways: sampling turns sequence parallelism off and on again",
          ),
    ),
    Blank(SP, "apply_sequence_parallel",
          "set_sequence_parallel on; every RMSNorm's forward becomes norm_forward bound to it; "
          "return the model",
          nudge="put norm_forward in place of every norm's forward",
          traps=(
              "bind it to each norm, not to the class: the class is every model's",
          ),
    ),
    Blank(RECOMPUTE, "recompute",
          "torch.utils.checkpoint's checkpoint of function on args, non-reentrant",
          nudge="keep only the inputs, and run the function again when backward needs what it "
          "computed",
          traps=(
              "torch.utils.checkpoint has two variants: the tests want the non-reentrant one",
          ),
          installed=IN_RECOMPUTE_MODEL,
    ),
    Blank(RECOMPUTE, "RecomputeAttention.__torch_function__",
          "F.scaled_dot_product_attention under a checkpoint (its kwargs bound by partial); any "
          "other function called as it was",
          nudge="a function mode sees every torch call in its scope: attention's goes through a "
          "checkpoint, every other call as it came",
          traps=(
              "attention's keyword arguments (is_causal, enable_gqa) must reach the recomputed "
              "call too",
          ),
          installed=IN_RECOMPUTE_MODEL,
    ),
    Blank(RECOMPUTE, "apply_recompute",
          "none: the model as it is; else each layer's own forward wrapped: full, "
          "partial(recompute, forward); selective, partial(selective, forward)",
          nudge="each layer's own forward, wrapped inside the layer's call",
          traps=(
              "after keep_stage (step 7) the layers are an nn.ModuleDict: `for layer in "
              "model.model.layers` walks its keys, strings; walk `.values()`",
              "wrap `layer.forward`, not the layer: a wrapper module would rename every parameter",
          ),
    ),
)  # fmt: skip
SP_TESTS = "tests/test_sequence_parallel.py::"
SP_GRADED = (
    *(f"{SP_TESTS}test_piece_matches_one_process[step13-{piece}]"
      for piece in ("gather_sequence", "reduce_scatter_sequence", "f", "g", "norm", "model")),
    f"{SP_TESTS}test_recompute_runs_the_function_again_in_backward[step13]",
    f"{SP_TESTS}test_recompute_attention_keeps_q_k_v_alone[step13]",
    f"{SP_TESTS}test_piece_matches_one_process[step13-apply_recompute]",
    f"{SP_TESTS}test_every_layout_computes_one_process_gradients",
    f"{SP_TESTS}test_sequence_parallel_equals_dtensor",
    f"{SP_TESTS}test_every_layout_trains_like_one_process[sp_tp2_selective]",
)  # fmt: skip
# Step 14: the interleaved order, what a schedule holds, ZB-H1's order and the gradients' group
# of their own; then the backward split: the hand-over, the linear layer's two halves, the
# embedding's and the norms' weight gradients, and the plan that swaps them in.
ZB = "zero_bubble.py"
SCHEDULES_BLANKS = (
    Blank(PP, "interleaved_1f1b",
          "every rank's i-th forward: group, place = divmod(i, pp_size x chunks), micro-batch "
          "group x pp_size + place % pp_size, chunk place // pp_size (the backwards' reversed); "
          "rank r warms up with min((chunks - 1) pp_size + 2 (pp_size - r - 1), m x chunks), then "
          "F B, then the B's left",
          nudge="every rank runs the forwards in one order, p micro-batches at a time through "
          "each chunk, and the backwards in the same groups with the chunks reversed; the warm-up "
          "lasts until the first gradient can be back",
          traps=(
              "the backwards' chunks go in reverse: given the forwards' order they deadlock "
              "(exercise 2)",
          ),
    ),
    Blank(PP, "frees",
          "the kind after which a micro-batch's activations are gone: W where the actions have "
          "one, else B",
          nudge="which action ends a micro-batch's hold on its activations?",
    ),
    Blank(PP, "held",
          "the peak of a count that an F adds 1 to and the kind that frees takes 1 from",
          nudge="count the micro-batches in flight, action by action, and keep the peak",
    ),
    Blank(PP, "zero_bubble_h1",
          "1F1B's warm-up; in the steady state F B, and from rank r's (r + 1)-th on the oldest "
          "pending W; in the cool-down each B k, a W after it where k >= r; then the W's left",
          nudge="1F1B's order, each W kept back until the rank would otherwise wait",
          traps=(
              "rank r keeps r W's back: its first W comes only with its (r + 1)-th forward and "
              "backward of the steady state",
          ),
    ),
    Blank(PP, "gradient_group",
          "a new group for every pipeline (group_ranks along pp), made by every rank in the same "
          "order with pgm's timeout; return this rank's",
          nudge="the gradients need a group of their own between the same two neighbours",
          traps=(
              "every rank makes every pipeline's group, in the same order, even those it is not "
              "in",
          ),
    ),
    Blank(ZB, "hand_over",
          "outside deferred: torch.autograd.backward(weight, compute()) now; within: append to "
          "_pending a closure that does it",
          nudge="a weight's gradient is given to its parameter now, or kept for W",
          installed=IN_ZB_MODEL,
    ),
    Blank(ZB, "Linear.forward",
          "save x and the detached weight, keep the parameter (out of its tuple) in ctx; F.linear",
          nudge="keep what B and W will read, and let no edge of the graph reach the parameter",
          installed=IN_ZB_MODEL,
    ),
    Blank(ZB, "Linear.backward",
          "in the gradient's dtype: hand_over the parameter grad_y^T x over the flattened tokens "
          "(in the weight's dtype); return grad_y W (in x's dtype), None, None",
          nudge="B gives the input's gradient now; the weight's is handed over for W",
          traps=(
              "autograd computes the weight's gradient in the gradient's dtype: cast up, it "
              "passes in fp32 and fails under bf16 autocast",
          ),
          installed=IN_ZB_MODEL,
    ),
    Blank(ZB, "Lookup.backward",
          "hand_over the parameter aten.embedding_backward of grad and the ids (the table's rows, "
          "the padding index or -1, unscaled, dense); no gradient for any input",
          nudge="the embedding's whole backward is its table's gradient: hand it over",
          traps=(
              "the pad row gets no gradient: the padding index, or -1 where there is none",
          ),
          installed=IN_ZB_MODEL,
    ),
    Blank(ZB, "Hold.backward",
          "B computed the weight's gradient: hand_over it to the parameter as it is; None, None",
          nudge="B has computed the norm weight's gradient already: hold it until W",
          traps=(
              "returning None, None without handing it over drops the gradient quietly (exercise "
              "4)",
          ),
          installed=IN_ZB_MODEL,
    ),
    Blank(ZB, "apply_zero_bubble",
          "on every layer whose `linear` is F.linear (the tensor-parallel ones), linear; on the "
          "vocabulary's embedding, lookup; each RMSNorm's forward, held_norm_forward around its "
          "own; check that no nn.Linear is left without; return the model",
          nudge="swap the split functions in wherever a layer computes a linear or a lookup, and "
          "around every norm's forward",
          traps=(
              "after keep_stage the layers are an nn.ModuleDict: walk `model.modules()` or the "
              "dict's `.values()`",
          ),
    ),
)  # fmt: skip
SCHEDULES_TESTS = "tests/test_pipeline_schedules.py::"
SCHEDULES_GRADED = (
    *(f"{SCHEDULES_TESTS}test_interleaved_order_is_torchs[step14-{shape}]"
      for shape in ("pp2-m4-v2", "pp4-m8-v3")),
    f"{SCHEDULES_TESTS}test_interleaved_holds_its_warm_up[step14-pp4-m8-v2]",
    *(f"{SCHEDULES_TESTS}test_zb1_order_is_torchs[step14-{shape}]"
      for shape in ("pp2-m4", "pp4-m2", "pp4-m8")),
    f"{SCHEDULES_TESTS}test_zb1_holds_what_1f1b_holds_on_its_first_rank[step14-pp4-m8]",
    *(f"{SCHEDULES_TESTS}test_b_then_w_gives_autograds_gradients[step14-{piece}]"
      for piece in ("linear", "lookup", "norm", "model")),
    f"{SCHEDULES_TESTS}test_a_checkpoint_of_two_chunks_per_rank_resumes_elsewhere",
)  # fmt: skip
MOE_FILE, EP = "moe.py", "expert_parallel.py"
# Step 15: the layer on one rank first (its routing, its losses, their way out), then the
# exchange across ranks and the plan that puts it in.
MOE_BLANKS = (
    Blank(MOE_FILE, "MixtureOfExperts.route",
          "the router's logits in fp32, softmax over E, top k, the weights divided by their "
          "sum; the N k slots sorted by expert (a stable argsort), each slot's token as a row, "
          "the rows per expert (bincount); self.exchange(self, rows, counts); the rows back in "
          "slot order, times their weights, summed over the k slots, in x's dtype; while grad "
          "is enabled, AttachLoss of self.scale x router_losses, the counts (summed over "
          "tp_group when there is one) and self.record on the output"),
    Blank(MOE_FILE, "MixtureOfExperts.router_losses",
          "per sequence: its token slots per expert, its router probabilities and its "
          "logsumexp(logits)^2 summed over T; for each (group, averaged) of sequence_groups, the "
          "slots all-reduced, the two sums through Reduce (after Copy where averaged), T times "
          "the group's size; balance E sum_e (slots / T) (probabilities / T), z the squares / "
          "T; the mean over the sequences of aux_loss_coef balance + z_loss_coef z"),
    Blank(MOE_FILE, "AttachLoss.backward",
          "add ctx.facts to ctx.record; the gradient as it is, ones like the loss, None, None"),
    Blank(EP, "AllToAll.backward",
          "the same all-to-all of the gradient with receive and send swapped; no gradient for "
          "the counts or the group"),
    Blank(EP, "exchange",
          "the counts as (ep, E/ep); their all-to-all tells what each rank sends this rank's "
          "experts; the rows out and in per rank, as lists; AllToAll the rows; regroup them by "
          "local expert (a stable argsort), run_experts, back in rank order; AllToAll them back"),
    Blank(EP, "apply_expert_parallel",
          "in each layer keep this ep rank's E/ep experts (from ep_rank E/ep on) under their "
          "own keys, each linear's weight placed Held('ep', ep_rank); the layer's exchange over "
          "pgm.ep_group (functools.partial); return the model"),
)  # fmt: skip
MOE_TESTS = "tests/test_expert_parallel.py::"
MOE_GRADED = (
    f"{MOE_TESTS}test_logits_and_losses_equal_transformers_mixtral",
    f"{MOE_TESTS}test_router_losses_are_means_of_per_sequence_terms_and_transformers_is_not",
    f"{MOE_TESTS}test_the_router_losses_reach_the_router_through_any_output",
    f"{MOE_TESTS}test_the_exchange_computes_what_one_rank_computes[None]",
    f"{MOE_TESTS}test_the_all_to_all_bytes_follow_the_formula",
    f"{MOE_TESTS}test_every_layout_trains_like_one_process",
    f"{MOE_TESTS}test_a_checkpoint_of_experts_on_two_ranks_resumes_in_any_layout",
)  # fmt: skip
STEPS = [
    Step("step1_model", ("model.py", "train.py", "utils.py", "README.md"), ("model.py",),
         bench={"model": 1}),
    Step("step2_process_group_manager",
         ("process_group_manager.py", "train.py", "README.md"),
         blanks=PGM_BLANKS, graded=PGM_GRADED),
    Step("step3_dataloader",
         ("dataloader.py", "checkpoint.py", "comm_stats.py", "utils.py", "flags.py",
          "bookkeeping.py", "recipes.py", "retention.py", "kv_cache.py", "muon.py", "train.py",
          "README.md"),
         ("comm_stats.py", "utils.py", "flags.py", "bookkeeping.py", "recipes.py", "retention.py",
          "kv_cache.py", "muon.py"),
         memory={},
         bench={"kv_cache": 1}),
    Step("step4_tensor_parallel",
         ("tensor_parallel.py", "placement.py", "checkpoint.py", "train.py", "README.md"),
         (),
         convergence=(("tp2", 2, ("--tp_size", "2"), 1),), memory={"tp": 2}, bench={"tp": 2},
         blanks=TP_BLANKS, graded=TP_GRADED),
    Step("step5_data_parallel_naive",
         ("data_parallel.py", "dataloader.py", "train.py", "README.md"),
         convergence=(("dp2_naive", 2, ("--dp_size", "2"), 2),), memory={"dp": 2},
         blanks=NAIVE_BLANKS, graded=NAIVE_GRADED),
    Step("step6_data_parallel_bucket",
         ("data_parallel.py", "overlap_timeline.py", "train.py", "README.md"),
         ("data_parallel.py", "overlap_timeline.py"),
         convergence=(("dp2_bucket", 2, DP2_BUCKETS, 2),), memory={"dp": 2}, bench={"dp": 2},
         blanks=BUCKET_BLANKS, graded=BUCKET_GRADED),
    Step("step7_pipeline_parallel_afab",
         ("pipeline_parallel.py", "pipeline_timeline.py", "checkpoint.py", "train.py", "README.md"),
         (),
         convergence=(("pp2_afab", 2, (*PP2, "afab"), 1),),
         memory={"pp": 2, "micro_batches": 4}, blanks=PP_BLANKS, graded=PP_GRADED),
    Step("step8_pipeline_parallel_1f1b", ("pipeline_parallel.py", "train.py", "README.md"),
         convergence=(("pp2_1f1b", 2, (*PP2, "1f1b"), 1),),
         memory={"pp": 4, "engine": "1f1b", "micro_batches": 8}, bench={"pp": 2},
         blanks=ONE_F_ONE_B_BLANKS, graded=ONE_F_ONE_B_GRADED),
    Step("step9_3d_parallel", ("checkpoint.py", "hf_import.py", "train.py", "README.md"),
         ("hf_import.py",),
         convergence=(("tp2_dp2_pp2", 8, (*GRID, "--bucket_size_mb", "0.05"), 2),
                      ("pp3_1f1b", 3, ("--pp_size", "3", "--pp_engine", "1f1b"), 1)),
         memory={"tp": 2, "pp": 2, "engine": "1f1b", "micro_batches": 4}),
    Step("step10_zero1", ("zero.py", "train.py", "checkpoint.py", "README.md"),
         convergence=(("zero1_dp2", 2, DP2_BUCKETS, 2),
                      ("zero1_tp2_dp2", 4, (*DP2_BUCKETS, "--tp_size", "2"), 2),
                      ("zero1_tp2_dp2_pp2", 8,
                       (*DP2_BUCKETS, "--tp_size", "2", "--pp_size", "2", "--pp_engine", "1f1b"),
                       2)),
         memory={"tp": 2, "dp": 2}, bench={"zero": 2}, blanks=ZERO_BLANKS, graded=ZERO_GRADED),
    Step("step11_context_parallel",
         ("context_parallel.py", "process_group_manager.py", "dataloader.py",
          "pipeline_parallel.py", "checkpoint.py", "train.py", "README.md"),
         convergence=(("cp2", 2, ("--cp_size", "2"), 1),
                      ("cp2_tp2", 4, ("--cp_size", "2", "--tp_size", "2"), 1),
                      ("pp2_cp2", 4, ("--cp_size", "2", *PP2, "1f1b"), 1),
                      ("dp2_pp2_cp2", 8,
                       ("--cp_size", "2", *PP2, "1f1b", "--dp_size", "2", "--bucket_size_mb",
                        "0.05"), 2)),
         memory={"cp": 2}, bench={"cp": 2}, blanks=CP_BLANKS, graded=CP_GRADED),
    Step("step12_zero3", ("fully_sharded.py", "zero.py", "train.py", "README.md"), (),
         convergence=(("zero2_dp2", 2, (*DP2_BUCKETS, "--zero_stage", "2"), 2),
                      ("zero3_tp2_dp2", 4, ("--dp_size", "2", "--tp_size", "2", *ZERO3), 2),
                      ("zero3_dp2_pp2", 4, ("--dp_size", "2", *PP2, "1f1b", *ZERO3), 2),
                      ("zero3_dp2_cp2", 4, ("--dp_size", "2", "--cp_size", "2", *ZERO3), 2)),
         memory={"dp": 2, "zero_stage": 3},
         bench={"zero3": 2}, blanks=ZERO3_BLANKS, graded=ZERO3_GRADED),
    Step("step13_sequence_parallel",
         ("sequence_parallel.py", "recompute.py", "tensor_parallel.py", "fully_sharded.py",
          "train.py", "README.md"),
         ("sequence_parallel.py", "recompute.py"),
         convergence=(("sp_tp2_selective", 2, (*SP2, "--recompute", "selective"), 1),
                      ("sp_pp2_tp2_full", 4, (*SP2, *PP2, "1f1b", "--recompute", "full"), 1),
                      ("sp_cp2_tp2", 4, (*SP2, "--cp_size", "2"), 1),
                      ("sp_dp2_tp2_zero3_full", 4,
                       (*SP2, "--dp_size", "2", *ZERO3, "--recompute", "full"), 2),
                      ("zero3_dp2_pp2_full", 4,
                       ("--dp_size", "2", *PP2, "1f1b", *ZERO3, "--recompute", "full"), 2)),
         memory={"tp": 2, "sequence_parallel": True},
         bench={"sp": 2}, blanks=SP_BLANKS, graded=SP_GRADED),
    Step("step14_pipeline_schedules",
         ("pipeline_parallel.py", "zero_bubble.py", "tensor_parallel.py", "pipeline_timeline.py",
          "fully_sharded.py", "train.py", "README.md"),
         ("pipeline_parallel.py", "zero_bubble.py", "tensor_parallel.py", "pipeline_timeline.py"),
         convergence=(("interleaved_pp2_v2", 2, INTERLEAVED, 1),
                      ("interleaved_pp2_v2_tp2_sp", 4, (*INTERLEAVED, *SP2), 1),
                      ("interleaved_pp2_v2_dp2_zero3_full", 4,
                       (*INTERLEAVED, "--dp_size", "2", *ZERO3, "--recompute", "full"), 2),
                      ("zb1_pp2_tp2_sp", 4, (*ZB1, *SP2), 1),
                      ("zb1_pp2_dp2", 4, (*ZB1, *DP2_BUCKETS), 2)),
         memory={"pp": 2, "engine": "interleaved", "virtual_stages": 2, "micro_batches": 4},
         bench={"interleaved": 2, "zb1": 2}, blanks=SCHEDULES_BLANKS, graded=SCHEDULES_GRADED),
    # Trained against step 15 itself on one process, with the same experts (tiny-moe).
    Step("step15_expert_parallel",
         ("moe.py", "expert_parallel.py", "process_group_manager.py", "placement.py",
          "checkpoint.py", "zero.py", "fully_sharded.py", "train.py", "README.md"),
         ("moe.py", "expert_parallel.py", "process_group_manager.py", "placement.py",
          "checkpoint.py", "zero.py", "fully_sharded.py"),
         convergence=(("ep2_dp2", 2, (*MOE, *DP2_BUCKETS, *EP2), 2),
                      ("ep2_dp4", 4, (*MOE, "--dp_size", "4", "--bucket_size_mb", "0.05", *EP2),
                       4),
                      ("ep2_dp2_tp2", 4, (*MOE, *DP2_BUCKETS, *EP2, "--tp_size", "2"), 2),
                      ("moe_tp2_sp", 2, (*MOE, *SP2), 1),
                      ("ep2_dp2_tp2_sp", 4, (*MOE, *DP2_BUCKETS, *EP2, *SP2), 2),
                      ("ep2_dp2_pp2", 4, (*MOE, *DP2_BUCKETS, *EP2, *PP2, "1f1b"), 2),
                      ("ep2_dp2_pp2_zb1_full", 4,
                       (*MOE, *DP2_BUCKETS, *EP2, *ZB1, "--recompute", "full"), 2),
                      ("ep2_dp2_zero2", 2, (*MOE, *DP2_BUCKETS, *EP2, "--zero_stage", "2"), 2),
                      ("moe_dp2_zero3", 2, (*MOE, "--dp_size", "2", *ZERO3), 2),
                      ("ep2_dp4_zero3_full", 4,
                       (*MOE, "--dp_size", "4", *EP2, *ZERO3, "--recompute", "full"), 4),
                      ("moe_cp2", 2, (*MOE, "--cp_size", "2"), 1),
                      ("ep2_dp2_cp2", 4, (*MOE, *DP2_BUCKETS, *EP2, "--cp_size", "2"), 2)),
         memory={"dp": 2, "ep": 2, "moe": True},
         bench={"ep": 2}, blanks=MOE_BLANKS, graded=MOE_GRADED),
]  # fmt: skip


def step_entry(number):
    """The manifest's entry of step `number`."""
    [entry] = [step for step in STEPS if step.number == number]
    return entry


def carriers(file, folder):
    """The step `folder` that introduces or changes `file`, and every later step of the manifest,
    each of which carries the file (copied as it is, or changed again): the steps whose copy of a
    technique's code its detailed checks test."""
    start = step_entry(step_number(Path(folder)))
    assert file in start.changes, f"{folder} does not introduce or change {file}"
    return [step.folder for step in STEPS if step.number >= start.number]
