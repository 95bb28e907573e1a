"""Suite-wide settings.

TRITON_INTERPRET must be set before anything imports triton (`import lightning` does), so that the kernel tests run
Triton's interpreter on CPU instead of skipping.

The slowest tests run first. `make test` runs two xdist workers under `--dist worksteal`: each takes half of the
collected tests in order, and an idle worker steals the tail of the other's queue. A long test can't be split, so one
that starts last bounds the wall time by its own length; started first, the short ones balance the two queues
around it. `SLOWEST_FIRST` is that order (node ids, slowest first, from `--durations` on 2 cores); a name that no
longer exists is ignored, and a new slow test only costs balance until it is added here.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

SLOWEST_FIRST = [
    "test_resume_matrix.py::test_resume_matrix",
    "test_tp.py::test_strategy_matches_single_process_and_reshards_checkpoints",
    "test_user_path.py::test_single_file_resumes_under_zero2_then_loads_anywhere",
    "test_composed.py::test_context_parallel_on_two_ranks_matches_one_process",
    "test_composed.py::test_eight_rank_compositions_match_one_process",
    "test_cli.py::test_pp_yaml_trains_like_one_process",
    "test_composed.py::test_context_parallel_compositions_on_four_ranks_match_one_process",
    "test_gpu_check.py::test_every_section_passes_and_names_the_machine",
    "test_cli.py::test_cp_yaml_trains_and_validates_like_one_process",
    "test_parity_mutations.py::test_harness_reports_every_mutant",
    "test_tp.py::test_harness_parity_tp_and_dp_tp_zero",
    "test_launch.py::test_torchrun_sh_restarts_and_resumes_from_last",
    "test_user_path.py::test_single_file_resumes_under_pp_like_one_process",
    "test_pp.py::test_pp_matches_one_process_and_resumes_on_one_stage",
    "test_checkpoint_tools.py::test_a_path_that_is_not_a_checkpoint_is_one_line",
    "test_launch.py::test_two_torchrun_nodes_match_one_node",
    "test_ep.py::test_dp_ep_parity_zero_and_resume_across_stages",
    "test_composed.py::test_four_rank_compositions_match_one_process",
    "test_user_path.py::test_kill_during_the_first_save_resumes_the_step_before",
    "test_plan.py::test_plan_yaml_runs_under_fit",
    "test_cp.py::test_cp3_ring_matches_one_process_and_the_reversed_ring_is_reported",
    "test_compress_sharded.py::test_compression_matches_single_process_under_tp_with_zero",
    "test_checkpoint.py::test_resume_on_2_and_1_ranks_and_from_a_converted_file",
    "test_cli.py::test_fit_then_validate_from_checkpoint",
    "test_hf_tokenizer.py::test_fit_with_a_library_tokenizer_then_generate_and_export_decode_with_it",
    "test_zero.py::test_zero3_on_3_ranks_with_uneven_and_empty_shards",
    "test_cli.py::test_zero2_on_two_ranks_resumes_exactly_on_one",
    "test_crash.py::test_save_killed_midway_leaves_the_previous_checkpoint",
    "test_user_path.py::test_generate_from_a_zero3_checkpoint_streams_the_greedy_continuation",
    "test_tp.py::test_sequence_parallel_shards_the_norms_saved_activations",
    "test_ep.py::test_ep_harness_parity_with_global_batch_balancing",
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
