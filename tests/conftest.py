"""Suite-wide settings.

TRITON_INTERPRET must be set before anything imports triton (`import lightning` does), so that the kernel tests run
Triton's interpreter on CPU instead of skipping.

The slowest tests run first. `make test` runs two xdist workers under `--dist worksteal`: each takes half of the
collected tests in order, and an idle worker steals the tail of the other's queue. A long test can't be split, so one
that starts last bounds the wall time by its own length; started first, the short ones balance the two queues
around it. `SLOWEST_FIRST` is that order (node ids, slowest first; a module runs together where its first listed
test is, so modules of several slow tests are placed by their total): from the fresh-clone `make test` at 17c834f on
2 cores (12:21, `--durations=30`), the tests made faster since placed by their new times; a name that no longer exists
is ignored, and a new slow test only costs balance until it is added.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402  (after TRITON_INTERPRET is set)

from lit_lm import spawn  # noqa: E402

# the suite's rank imports, loaded once per worker (tests/forkserver_preload.py)
spawn.PRELOAD.append("forkserver_preload")

# One intra-op thread in each test worker, as in every rank it starts (lit_lm/spawn.py) and every CLI run
# (OMP_NUM_THREADS=1): `make test` runs two workers on two cores, beside their ranks; torch's default (a thread per
# core) would put two threads of each in-process test on cores the other worker's ranks use.
torch.set_num_threads(1)

SLOWEST_FIRST = [
    "test_gpu_check.py::test_every_section_passes_and_names_the_machine",
    "test_compile.py::test_inductor_compiled_matches_eager",
    "test_compile.py::test_presets_compiled_match_eager",
    "test_cli.py::test_zero2_on_two_ranks_resumes_exactly_on_one",
    "test_cli.py::test_cp_yaml_trains_and_validates_like_one_process",
    "test_cli.py::test_pp_yaml_trains_like_one_process",
    "test_fp8.py::test_a_short_fp8_run_ends_near_bf16",
    "test_resume_matrix.py::test_resume_matrix",
    "test_data_memory.py::test_tokenizing_memory_is_flat_in_the_corpus_size",
    "test_resilience.py::test_preemption_saves_at_a_common_step_and_the_requeued_job_finishes_the_run",
    "test_crash.py::test_lost_rank_is_named_and_the_others_exit",
    "test_crash.py::test_save_killed_midway_leaves_the_previous_checkpoint",
    "test_launch.py::test_torchrun_sh_restarts_and_resumes_from_last",
    "test_full_size.py::test_full_size_matches_a_real_run_on_cpu_ranks",
    "test_user_path.py::test_single_file_resumes_under_zero2_then_loads_anywhere",
    "test_user_path.py::test_kill_during_the_first_save_resumes_the_step_before",
    "test_plan.py::test_the_3d_rule_comes_out_of_the_estimates",
    "test_plan.py::test_plan_for_two_nodes_ranks_layouts_and_answers",
    "test_check.py::test_every_mutant_fails_the_check",
    "test_composed.py::test_eight_rank_compositions_match_one_process",
    "test_cp.py::test_cp3_ring_matches_one_process_and_the_reversed_ring_is_reported",
    "test_hf_import.py::test_zero3_import_peak_memory_stays_below_the_model",
    "test_user_path.py::test_single_file_resumes_under_pp_like_one_process",
    "test_hf_tokenizer.py::test_fit_with_a_library_tokenizer_then_generate_and_export_decode_with_it",
    "test_plan.py::test_plan_yaml_runs_under_fit",
    "test_user_path.py::test_generate_from_a_zero3_checkpoint_streams_the_greedy_continuation",
    "test_check.py::test_every_preset_passes",
    "test_cli.py::test_pp_microbatches_that_do_not_divide_the_batch_are_reported",
    "test_logging.py::test_plain_lines_every_n_steps_and_across_a_resume",
    "test_hf_families.py::test_imported_families_under_layouts_match_one_process",
    "test_resilience.py::test_kill_during_background_save_resumes_from_the_previous_checkpoint",
    "test_errors.py::test_bad_input_is_one_line",
    "test_cli.py::test_fit_then_validate_from_checkpoint",
    "test_host_sync.py::test_no_host_sync_between_logging_steps",
    "test_kernels_apply.py::test_swapped_model_matches_reference",
    "test_kernels.py::test_flash_attention",
    "test_composed.py::test_four_rank_compositions_match_one_process",
    "test_estimate.py::test_estimate_matches_measurement_of_every_strategy",
    "test_composed.py::test_context_parallel_compositions_on_four_ranks_match_one_process",
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


@pytest.fixture(scope="session")
def torchrun_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict[int, float]]:
    """The one-node `lit-lm fit` (lm_ddp x 2 processes, batch 2 per device, 10 steps) that the torchrun jobs of
    test_launch.py and test_resilience.py must reproduce: its arguments (their corpus and data cache, built by this
    run, are then shared) and its step -> train_loss. One run per worker instead of one per test (each is two fresh
    CLI processes)."""
    from test_launch import REFERENCE_STEPS, _args, _one_node

    root = tmp_path_factory.mktemp("torchrun_reference")
    args = _args(root, batch=2, steps=REFERENCE_STEPS)
    return args, _one_node(root, args, root / "one", devices=2)
