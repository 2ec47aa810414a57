"""Test-session setup shared by every test module.

XLA compile time dominates these tests on CPU (each agent program is compiled
once and then runs for well under a second), so compile with XLA's backend
optimisation level 0: about half the compile time, same semantics. A value
already set in XLA_FLAGS wins.
"""

import os

_flags = os.environ.get('XLA_FLAGS', '')
if '--xla_backend_optimization_level' not in _flags:
    os.environ['XLA_FLAGS'] = (_flags + ' --xla_backend_optimization_level=0').strip()


# Scheduling only (pytest.ini: -n 2 --maxschedchunk 1): xdist hands tests to
# the two workers in collection order, one at a time as each frees up, so the
# long tests go first (longest first) and the short ones fill in at the end,
# where they keep both workers busy until the last test. The figures are
# seconds per test (the slowest parametrization) of a run under load 8-10;
# only their order matters. A name missing here, or a stale figure, changes
# where a test runs, never what it checks.
SLOW_FIRST = {
    'test_scale.py::test_pg_ppo_conv_and_gsde_grids_equal_the_separate_runs': 106,
    'test_reliability.py::test_kill_9_then_resume_is_bitwise_identical': 99,
    'test_reliability.py::test_resume_takes_the_saved_config': 96,
    'test_reliability.py::test_one_writer_per_run_dir_and_kill_9_leaves_no_lock': 85,
    'test_scale.py::test_conv_grid_equals_the_separate_runs': 81,
    'test_scale.py::test_sharded_over_four_devices_matches_one_device': 73,
    'test_scale.py::test_grid_equals_the_separate_runs': 72,
    'test_benchmark.py::test_gpu_suite_smoke': 67,
    'test_scale.py::test_pg_gru_grid_equals_the_separate_runs': 64,
    'test_readme.py::test_readme_commands_run': 60,  # one README line, or one run's lines
    'test_distributed.py::test_two_processes_equal_one_process': 56,
    'test_reliability.py::test_resume_extends_to_total_epochs': 54,
    'test_scale.py::test_pg_grid_equals_the_separate_runs': 50,
    'test_recurrent.py::test_ppo_learns_the_cue_with_the_gru_and_not_without': 50,
    'test_reliability.py::test_tensorboard_events_match_metrics_and_a_resume_writes_no_duplicates': 47,
    'test_reliability.py::test_time_limit_stops_with_a_checkpoint_and_the_run_goes_on': 44,
    'test_library.py::test_run_sweep_gives_the_command_lines_numbers': 42,
    'test_distributed.py::test_kill_9_of_one_process_then_rerun_resumes_bitwise': 42,
    'test_faults.py::test_one_run_per_device_is_bitwise_one_device': 41,
    'test_scale.py::test_fused_epoch_equals_the_phases': 35,
    'test_distributed.py::test_readme_localhost_example_runs_as_written': 35,
    'test_pg.py::test_one_epoch_on_every_gymnax_env': 33,
    'test_pg.py::test_defaults_solve_cartpole': 29,
    'test_recurrent.py::test_the_cell_over_a_stored_sequence_equals_the_rollouts_stepping': 29,
    'test_recurrent.py::test_the_state_at_each_episodes_first_step_is_the_initial_state': 29,
    'test_reliability.py::test_ctrl_c_finishes_the_epoch_and_leaves_a_loadable_checkpoint': 27,
    'test_actor_critic.py::test_value_network_learns_the_image_probe_through_the_conv_torso': 26,
    'test_reliability.py::test_truncated_checkpoint_is_reported_and_previous_survives': 26,
    'test_faults.py::test_a_signal_in_the_last_epoch_finishes_the_summary': 26,
    'test_scale.py::test_chunks_and_the_evaluation_cadence_never_change_training': 25,
    'test_readme.py::test_readme_python_block_runs': 24,
    'test_reliability.py::test_out_of_memory_from_xla_is_one_line_status_1_and_keeps_the_checkpoint': 24,
    'test_faults.py::test_a_second_ctrl_c_abandons_the_chunk_in_one_line': 23,
    'test_reliability.py::test_restored_trainer_step_is_validated': 22,
    'test_recurrent.py::test_reinforce_learns_the_cue_with_the_gru': 21,
    'test_reliability.py::test_output_dir_that_is_a_file': 19,
    'test_actor_critic.py::test_ppo_and_a2c_are_unchanged_by_the_replay': 19,
    'test_reliability.py::test_resume_with_changed_config_is_refused': 19,
    'test_actor_critic.py::test_actor_critic_solves_cartpole': 18,
    'test_scale.py::test_plot_writes_a_png': 17,
    'test_dqn.py::test_env_settings_apply_flags_override_and_config_records': 16,
    'test_dqn.py::test_one_epoch_on_every_gymnax_env': 16,
    'test_reliability.py::test_nan_guard_stops_and_keeps_last_good_checkpoint': 16,
    'test_reliability.py::test_an_error_in_the_checkpoint_thread_reaches_the_driver': 15,
    'test_reliability.py::test_only_eval_restores_and_never_writes_the_checkpoint': 15,
    'test_pg.py::test_same_seed_and_flags_give_identical_results': 14,
    'test_reliability.py::test_checkpoints_follow_the_wall_clock_from_a_background_thread': 14,
}


def _seconds(item):
    module = os.path.basename(str(item.path))
    return SLOW_FIRST.get(f'{module}::{item.originalname}', 0)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -_seconds(item))  # stable: otherwise collection order
