"""The quick tier (`pytest -m quick`) and how the full suite shares out over pytest-xdist's workers.

The quick tier is what to run after every edit: each step's technique proved once at its smallest
layout (its equivalence to one device, or to transformers for the model), the tools' smoke tests
and the style checks. `QUICK` names its tests by step; conftest.py marks them, and refuses an entry
that names no test (a renamed test would otherwise leave its step unproved without a word).

The full suite runs on pytest-xdist's workers (`-n`, set in pyproject.toml). A module's tests run on
one worker, in order, so that a module-scoped run (a baseline, a layout trained once and read by
several tests) runs once; test_readme_commands.py is shared out by README, whose commands run in
order in one working folder. The heaviest groups go first, so that no worker starts a long one
while the other has nothing left.
"""

QUICK = {
    "step1_model": [
        "tests/test_model.py::test_same_keys_and_logits_as_transformers[4-2-True-500000.0]",
    ],
    "step2_process_group_manager": [
        "tests/test_process_group_manager.py::test_group_ranks_are_the_permuted_grids",
        "tests/test_process_group_manager.py::test_check_sizes_message",
    ],
    "step3_dataloader": [
        "tests/test_dataloader.py::test_rows_are_documents_joined_by_eos",
        "tests/test_dataloader.py::test_targets_are_inputs_shifted_by_one",
        "tests/test_dataloader.py::test_resumes_from_its_position",
        "tests/test_train.py::test_step3_resume_gives_identical_losses",
        "tests/test_host_syncs.py::test_step3_one_process",
    ],
    "step4_tensor_parallel": [
        "tests/test_tensor_parallel.py::test_model_matches_single_device[untied]",
    ],
    "step5_data_parallel_naive": [
        "tests/test_data_parallel.py::test_naive_gradients_equal_one_process_and_ddp[3]",
    ],
    "step6_data_parallel_bucket": [
        "tests/test_data_parallel.py::test_bucket_gradients_equal_one_process_naive_and_ddp[3]",
    ],
    "step7_pipeline_parallel_afab": [
        "tests/test_pipeline_parallel.py::test_pipeline_gradients_equal_one_process[step7-2]",
    ],
    "step8_pipeline_parallel_1f1b": [
        "tests/test_pipeline_parallel.py::test_pipeline_gradients_equal_one_process[step8-2]",
        "tests/test_schedules.py::test_each_stage_runs_what_torch_runs[step8-1f1b]",
    ],
    "step9_3d_parallel": [
        "tests/test_3d_parallel.py::test_init_from_hf_into_a_layout[pp2-tp2-tied]",
    ],
    "step10_zero1": [
        "tests/test_zero1.py::test_sharded_adamw_equals_adamw_on_one_process",
    ],
    "step11_context_parallel": [
        "tests/test_context_parallel.py::test_ring_attention_equals_full_attention[layer]",
    ],
    "step12_zero3": [
        "tests/test_zero3.py::test_piece_matches_one_process[step12-stage_2]",
        "tests/test_zero3.py::test_piece_matches_one_process[step12-backward]",
    ],
    "step13_sequence_parallel": [
        "tests/test_sequence_parallel.py::test_piece_matches_one_process[step13-model]",
    ],
    "step14_pipeline_schedules": [
        "tests/test_pipeline_schedules.py::test_b_then_w_gives_autograds_gradients[step14-model]",
        "tests/test_pipeline_schedules.py::test_interleaved_order_is_torchs[step14-pp2-m4-v2]",
        "tests/test_pipeline_schedules.py::test_zb1_order_is_torchs[step14-pp2-m4]",
    ],
    "step15_expert_parallel": [
        "tests/test_expert_parallel.py::test_logits_and_losses_equal_transformers_mixtral",
        "tests/test_expert_parallel.py::test_the_exchange_computes_what_one_rank_computes[None]",
        "tests/test_expert_parallel.py::test_ep2_over_dp2_trains_like_one_process",
    ],
    "tools": [
        "tests/test_convergence.py::test_compare_flags_a_nan_and_a_missing_step",
        "tests/test_foundation_tools.py::test_collectives_demo[3-6-False]",
        "tests/test_foundation_tools.py::test_the_grid_picture",
        "tests/test_step_tooling.py::test_patches_are_fresh",
        "tests/test_step_tooling.py::test_model_identical_in_every_step",
        "tests/test_step_tooling.py::test_frozen_modules_identical_from_their_step",
        "tests/test_step_tooling.py::test_steps_change_only_declared_files",
        "tests/test_break_it.py::test_every_exercise_is_written_out_as_the_lesson_says",
        "tests/test_style.py::test_ruff_format",
        "tests/test_style.py::test_ruff_lint",
    ],
}

# The groups that take longest on the 2-core machine (a minute or more of a worker's time):
# started first.
HEAVY = [
    "tests/test_expert_parallel.py",
    "tests/test_dynamics.py",
    "tests/test_operations.py",
    "tests/test_exercise.py",
    "tests/test_break_it.py",
    "README.md",
    "tests/test_sequence_parallel.py",
    "tests/test_zero3.py",
    "tests/test_pipeline_schedules.py",
    "tests/test_convergence.py",
    "tests/test_bad_input.py",
]


def quick_ids():
    return {node for nodes in QUICK.values() for node in nodes}


def matches(nodeid, entry):
    """An entry names one test, or every parametrisation of a test when it has no brackets."""
    return nodeid == entry or ("[" not in entry and nodeid.startswith(entry + "["))


def group(item):
    """The xdist group of a test: its README for a README's command, else its module."""
    if item.path.name == "test_readme_commands.py" and hasattr(item, "callspec"):
        command = item.callspec.params.get("command")
        if command is not None:
            return command.readme
    return item.nodeid.split("::")[0]
