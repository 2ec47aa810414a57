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
# modules with the longest tests go first, their longest first, and the short
# ones fill in at the end, where they keep both workers busy until the last
# test. The figures are seconds per test (its slowest parametrization, 6 s or
# more) of a full run on 2 busy cores (load 4-5); only their order matters. A
# name missing here, or a stale figure, changes where a test runs, never what
# it checks.
SLOW_FIRST = {
    'test_distributed.py::test_kill_9_of_one_process_then_rerun_resumes_bitwise': 54,
    'test_distributed.py::test_two_processes_equal_one_process': 44,
    'test_benchmark.py::test_gpu_suite_smoke': 36,
    'test_scale.py::test_pg_ppo_conv_and_gsde_grids_equal_the_separate_runs': 31,
    'test_distributed.py::test_readme_localhost_example_runs_as_written': 31,
    'test_actor_critic.py::test_ppo_and_a2c_are_unchanged_by_the_replay': 29,
    'test_copy.py::test_the_copied_files_run_with_the_command_lines_numbers': 29,
    'test_reliability.py::test_time_limit_stops_with_a_checkpoint_and_the_run_goes_on': 26,
    'test_actor_critic.py::test_value_network_learns_the_image_probe_through_the_conv_torso': 25,
    'test_scale.py::test_pg_grid_equals_the_separate_runs': 23,
    'test_faults.py::test_one_run_per_device_is_bitwise_one_device': 23,
    'test_faults.py::test_a_signal_in_the_last_epoch_finishes_the_summary': 23,
    'test_recurrent.py::test_ppo_learns_the_cue_with_the_gru_and_not_without': 21,
    'test_faults.py::test_a_second_ctrl_c_abandons_the_chunk_in_one_line': 20,
    'test_readme.py::test_readme_commands_run': 20,
    'test_reliability.py::test_resume_takes_the_saved_config': 19,
    'test_reliability.py::test_one_writer_per_run_dir_and_kill_9_leaves_no_lock': 18,
    'test_library.py::test_run_sweep_gives_the_command_lines_numbers': 18,
    'test_reliability.py::test_tensorboard_events_match_metrics_and_a_resume_writes_no_duplicates': 18,
    'test_reliability.py::test_resume_extends_to_total_epochs': 17,
    'test_recurrent.py::test_the_state_at_each_episodes_first_step_is_the_initial_state': 17,
    'test_reliability.py::test_kill_9_then_resume_is_bitwise_identical': 17,
    'test_scale.py::test_conv_grid_equals_the_separate_runs': 17,
    'test_dqn.py::test_one_epoch_on_every_gymnax_env': 16,
    'test_recurrent.py::test_the_cell_over_a_stored_sequence_equals_the_rollouts_stepping': 16,
    'test_scale.py::test_fused_epoch_equals_the_phases': 16,
    'test_scale.py::test_sharded_over_four_devices_matches_one_device': 16,
    'test_readme.py::test_readme_python_block_runs': 15,
    'test_dqn.py::test_same_seed_same_metrics': 15,
    'test_scale.py::test_chunks_and_the_evaluation_cadence_never_change_training': 14,
    'test_scale.py::test_grid_equals_the_separate_runs': 14,
    'test_distributed.py::test_an_error_only_one_process_meets_stops_both': 14,
    'test_actor_critic.py::test_defaults_are_a_ppo_whose_ratio_moves': 14,
    'test_scale.py::test_pg_gru_grid_equals_the_separate_runs': 14,
    'test_pg.py::test_one_epoch_on_every_gymnax_env': 13,
    'test_reliability.py::test_ctrl_c_finishes_the_epoch_and_leaves_a_loadable_checkpoint': 13,
    'test_faults.py::test_a_damaged_run_dir_is_refused_in_one_line_and_left_as_it_was': 13,
    'test_distributed.py::test_nobody_answers_is_one_line_in_bounded_time': 12,
    'test_reliability.py::test_truncated_checkpoint_is_reported_and_previous_survives': 11,
    'test_reliability.py::test_restored_trainer_step_is_validated': 11,
    'test_recurrent.py::test_reinforce_learns_the_cue_with_the_gru': 11,
    'test_dqn.py::test_cartpole_learns': 11,
    'test_actor_critic.py::test_a_mode_brings_its_own_settings_never_ppos': 10,
    'test_reliability.py::test_resume_with_changed_config_is_refused': 10,
    'test_distributed.py::test_processes_must_see_the_same_saved_run': 10,
    'test_actor_critic.py::test_gsde_ppo_solves_mountain_car_continuous': 10,
    'test_actor_critic.py::test_ppo_settings_solve_catch': 10,
    'test_registries.py::test_kl_penalty_objective_is_its_formula_and_trains': 10,
    'test_actor_critic.py::test_env_settings_apply_flags_override_and_config_records': 10,
    'test_library.py::test_algorithm_file_and_common_alone_run_a_sweep': 9,
    'test_actor_critic.py::test_actor_critic_solves_cartpole': 9,
    'test_common.py::test_step_first_episode_equals_env_step_until_the_episode_ends': 9,
    'test_pg.py::test_defaults_solve_cartpole': 9,
    'test_actor_critic.py::test_replayed_epochs_each_get_their_own_advantages_and_every_pass_covers_them': 9,
    'test_registries.py::test_munchausen_target_is_its_formula_and_trains': 9,
    'test_scale.py::test_plot_writes_a_png': 9,
    'test_actor_critic.py::test_train_syncs_the_target_before_value_training_and_after_each_chunk': 9,
    'test_reliability.py::test_checkpoints_follow_the_wall_clock_from_a_background_thread': 8,
    'test_actor_critic.py::test_joint_with_value_loss_coeff_0_trains_the_policy_as_the_policy_loss_alone': 8,
    'test_pg.py::test_same_seed_and_flags_give_identical_results': 8,
    'test_actor_critic.py::test_value_chunk_regresses_on_target_network_targets_and_syncs_after': 8,
    'test_copy.py::test_the_copy_refuses_with_the_command_lines_message': 8,
    'test_reliability.py::test_output_dir_that_is_a_file': 8,
    'test_dqn.py::test_env_settings_apply_flags_override_and_config_records': 8,
    'test_recurrent.py::test_gru_sequence_is_the_gru_equations_with_resets': 7,
    'test_faults.py::test_what_the_checkpoint_can_rebuild_is_rebuilt': 7,
    'test_pg.py::test_num_seeds_give_different_trajectories_and_parameters': 7,
    'test_faults.py::test_a_divergence_in_a_grid_names_the_run_and_keeps_the_healthy_runs_epochs': 7,
    'test_dqn.py::test_probe_image_observation_through_the_conv_torso': 7,
    'test_common.py::test_conv_torso_shapes_and_gradients_match_lax_conv': 7,
    'test_common.py::test_conv_in_chunks_is_the_whole_batch_bitwise': 6,
}


def _seconds(item):
    module = os.path.basename(str(item.path))
    return SLOW_FIRST.get(f'{module}::{item.originalname}', 0)


def pytest_collection_modifyitems(config, items):
    # A module's tests stay together (a worker that left a module and came back
    # would set its module fixtures up again): the modules by their slowest
    # test, then within each module its slowest tests first.
    weight = {}
    for item in items:
        weight[item.module.__name__] = max(weight.get(item.module.__name__, 0), _seconds(item))
    items.sort(key=lambda item: (-weight[item.module.__name__], item.module.__name__,
                                 -_seconds(item)))  # stable: otherwise collection order
