"""Suite-wide settings.

TRITON_INTERPRET must be set before anything imports triton (`import lightning` does), so that the kernel tests run
Triton's interpreter on CPU instead of skipping.

The slowest tests run first. `make test` runs two xdist workers under `--dist worksteal`: each takes half of the
collected tests in order, and an idle worker steals the tail of the other's queue. A long test can't be split, so one
that starts last bounds the wall time by its own length; started first, the short ones balance the two queues
around it. `SLOWEST_FIRST` is that order (node ids, slowest first, from `make test`'s `--durations=30` on 2 cores,
2026-12-01); a name that no longer exists is ignored, and a new slow test only costs balance until it is added.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

SLOWEST_FIRST = [
    "test_user_path.py::test_single_file_resumes_under_zero2_then_loads_anywhere",
    "test_resume_matrix.py::test_resume_matrix",
    "test_user_path.py::test_single_file_resumes_under_pp_like_one_process",
    "test_hf_tokenizer.py::test_fit_with_a_library_tokenizer_then_generate_and_export_decode_with_it",
    "test_moe.py::test_balancing_on_a_skewed_task",
    "test_cli.py::test_pp_yaml_trains_like_one_process",
    "test_checkpoint_tools.py::test_upcycled_checkpoint_generates_alone_and_export_hf_refuses_it_in_one_line",
    "test_launch.py::test_torchrun_sh_restarts_and_resumes_from_last",
    "test_logging.py::test_plain_lines_every_n_steps_and_across_a_resume",
    "test_pp.py::test_harness_parity_pp",
    "test_composed.py::test_context_parallel_compositions_on_four_ranks_match_one_process",
    "test_zero.py::test_zero3_on_3_ranks_with_uneven_and_empty_shards",
    "test_gpu_check.py::test_every_section_passes_and_names_the_machine",
    "test_module.py::test_derived_config_fields_follow_the_yaml_not_the_default_instance",
    "test_errors.py::test_bad_input_is_one_line",
    "test_tp.py::test_strategy_matches_single_process_and_reshards_checkpoints",
    "test_composed.py::test_eight_rank_compositions_match_one_process",
    "test_parity_mutations.py::test_harness_reports_every_mutant",
    "test_composed.py::test_context_parallel_on_two_ranks_matches_one_process",
    "test_check.py::test_every_mutant_fails_the_check",
    "test_cli.py::test_cp_yaml_trains_and_validates_like_one_process",
    "test_hf_tokenizer.py::test_a_hugging_face_model_smaller_than_the_tokenizer_is_refused_in_one_line",
    "test_user_path.py::test_kill_during_the_first_save_resumes_the_step_before",
    "test_plan.py::test_plan_for_two_nodes_ranks_layouts_and_answers",
    "test_user_path.py::test_generate_from_a_zero3_checkpoint_streams_the_greedy_continuation",
    "test_launch.py::test_two_torchrun_nodes_match_one_node",
    "test_cli.py::test_fit_then_validate_from_checkpoint",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules in the order of their slowest listed test, that test first in its module (a parametrized one: all
    its cases), the rest in collection order. A module stays together so its module-scoped fixtures are built once."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    own = {id(item): rank.get(f"{item.path.name}::{item.originalname}", len(rank)) for item in items}
    module = {}
    for item in items:
        module[item.path] = min(module.get(item.path, len(rank)), own[id(item)])
    items.sort(key=lambda item: (module[item.path], str(item.path), own[id(item)]))  # stable within a module
