"""The recurrent torso (--torso gru): the cell against a numpy reference,
the exact reset at each episode's first step, stored sequences against the
rollout's own stepping, and a cue that only a policy with memory can use."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import actor_critic as ac  # noqa: E402
import common  # noqa: E402
import policies  # noqa: E402
import dqn  # noqa: E402
import pg  # noqa: E402
import probe_envs  # noqa: E402

probe_envs.register()


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def numpy_gru(params, obs, hidden, reset):
    """The GRU torso in float64 numpy, step by step: ReLU MLP -> input
    projection; r, z, n gates; the state zeroed after a reset step."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    size = hidden.shape[-1]
    outputs = []
    for x, done in zip(obs, reset):
        for layer in p['base'][:-1]:
            x = np.maximum(x @ layer['w'] + layer['b'], 0.0)
        x = x @ p['base'][-1]['w'] + p['base'][-1]['b']
        h = hidden @ p['gru']['wh'] + p['gru']['bh']
        r = sigmoid(x[:size] + h[:size])
        z = sigmoid(x[size:2 * size] + h[size:2 * size])
        n = np.tanh(x[2 * size:] + r * h[2 * size:])
        out = (1 - z) * n + z * hidden
        outputs.append(out)
        hidden = np.zeros_like(out) if done else out
    return np.asarray(outputs), hidden


def random_gru(key, obs_size=3, hidden=(5,), size=4):
    params = policies.init_network(key, (obs_size,), hidden, 2, 'gru', gru_size=size)
    # Non-zero biases, so each gate's bias is exercised.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    return jax.tree.unflatten(tree, [leaf + 0.3 * jax.random.normal(k, leaf.shape)
                                     for leaf, k in zip(leaves, keys)])


def test_gru_sequence_is_the_gru_equations_with_resets():
    params = random_gru(jax.random.PRNGKey(0))
    obs = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 3))
    hidden = jax.random.normal(jax.random.PRNGKey(2), (2, 4))
    reset = jnp.asarray([[0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1]], bool)
    outputs, last = policies.recurrent_features(params, obs, (3,), hidden, reset)
    for row in range(2):
        expected, expected_last = numpy_gru(params, np.asarray(obs[row]),
                                            np.asarray(hidden[row], np.float64),
                                            np.asarray(reset[row]))
        np.testing.assert_allclose(outputs[row], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(last[row], expected_last, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(last[1], 0.0)  # its last step ended an episode
    # After the reset, row 0 is what a sequence from the zero state gives.
    fresh, _ = policies.recurrent_features(params, obs[:1, 3:], (3,), jnp.zeros((1, 4)),
                                         reset[:1, 3:])
    np.testing.assert_allclose(outputs[0, 3:], fresh[0], rtol=1e-6, atol=1e-7)
    assert not np.allclose(outputs[0, :3], 0.0)


# A tiny PPO on the cue probe (5-step episodes), rows of 12 steps: episode
# ends fall inside rows and across the epochs' boundaries.
TINY = dict(env=probe_envs.CUE_PROBE, torso='gru', gru_size=8, hidden_sizes=(8,), n_envs=4,
            n_interactions_per_epoch=48, batch_size=24, value_batch_size=24,
            max_slice_length=6, train_steps_per_epoch=4, value_train_steps_per_epoch=4,
            n_eval_episodes=4, epochs=2)


def collect_twice(**overrides):
    agent = ac.make_agent(ac.Config(**{**TINY, **overrides}))
    hp = {name: jnp.asarray(value, jnp.float32)
          for name, value in common.expand_runs(agent.spec.config, {}, 0, 1)[0].items()
          if name != 'seed'}
    state = agent.init(jax.random.PRNGKey(3), hp)
    first, _ = agent.collect(hp, state)
    first, _ = agent.train(hp, first)  # new params: the next rollout's states differ
    second, _ = agent.collect(hp, first)
    return agent, first, second


def test_the_state_at_each_episodes_first_step_is_the_initial_state():
    _, first, second = collect_twice()
    for name in ('policy', 'value'):
        previous = first.replay.memory[name][0]
        memory = second.replay.memory[name][0]  # [n_envs, steps, H]
        done = np.asarray(second.replay.terminated[0] | second.replay.truncated[0])
        starts = np.zeros(done.shape, bool)
        starts[:, 1:] = done[:, :-1]
        # The epoch's first step: an episode start where the last row ended one.
        last_done = np.asarray(first.replay.terminated[0] | first.replay.truncated[0])[:, -1]
        starts[:, 0] = last_done
        assert starts.sum() >= 8 and (~starts).sum() >= 8
        np.testing.assert_array_equal(np.asarray(memory)[starts], 0.0)  # exactly
        assert np.all(np.abs(np.asarray(memory)[~starts]).max(axis=-1) > 0)
        # A row that goes on from the last one starts from the state it left.
        np.testing.assert_array_equal(memory[:, 0][~last_done],
                                      first.replay.last_memory[name][0][~last_done])
        assert not np.array_equal(previous, memory)


@pytest.mark.parametrize('name', ['policy', 'value'])
def test_the_cell_over_a_stored_sequence_equals_the_rollouts_stepping(name):
    """Each sequence run from the state stored at its first step gives, after
    each step, the state the rollout stored for the next step (where no
    episode ended between them), bitwise."""
    agent, _, state = collect_twice()
    spec, replay = agent.spec, state.replay
    net = state.params['net'] if name == 'policy' else state.value_params
    length = spec.slice_length
    sequence = lambda x: policies.sequences(x[0], length)
    reset = ac.resets(replay)
    outputs = policies.features_of(spec.policy, net, sequence(replay.obs),
                                 (sequence(replay.memory[name])[:, 0], sequence(reset)))
    outputs = np.asarray(outputs).reshape(replay.memory[name][0].shape)
    stored = np.asarray(replay.memory[name][0])
    after = ~np.asarray(reset[0])[:, :-1]
    assert after.sum() >= 16
    np.testing.assert_array_equal(outputs[:, :-1][after], stored[:, 1:][after])
    last = np.asarray(replay.last_memory[name][0])
    row_goes_on = ~np.asarray(reset[0])[:, -1]
    np.testing.assert_array_equal(outputs[:, -1][row_goes_on], last[row_goes_on])


def final_greedy(module, config, seed=0, num_seeds=2):
    agent = module.make_agent(config)
    _, _, metrics = common.run_sweep(agent, config, seed=seed, num_seeds=num_seeds)
    return np.asarray(metrics[common.return_tag(0.0, agent.max_steps)][-1])


CUE_PPO = dict(env=probe_envs.CUE_PROBE, hidden_sizes=(16,), gru_size=16, n_envs=8,
               n_interactions_per_epoch=160, batch_size=80, value_batch_size=80,
               train_steps_per_epoch=8, value_train_steps_per_epoch=8, lr=3e-3, value_lr=3e-3,
               entropy_coeff=0.0, n_eval_episodes=64, epochs=40)


def test_ppo_learns_the_cue_with_the_gru_and_not_without():
    """The query step's right action depends on the cue 4 steps earlier: the
    GRU's policy gets it every time, the MLP's cannot beat a coin."""
    recurrent = final_greedy(ac, ac.Config(**CUE_PPO, torso='gru', max_slice_length=20))
    memoryless = final_greedy(ac, ac.Config(**{k: v for k, v in CUE_PPO.items()
                                              if k != 'gru_size'}, torso='mlp'))
    assert np.all(recurrent >= 0.95), recurrent
    assert np.all(np.abs(memoryless) <= 0.5), memoryless


def test_reinforce_learns_the_cue_with_the_gru():
    config = pg.Config(env=probe_envs.CUE_PROBE, torso='gru', hidden_sizes=(16,), gru_size=16,
                       n_trajectories_per_epoch=64, epochs=40, lr=1e-2, n_eval_episodes=64)
    assert np.all(final_greedy(pg, config) >= 0.95)


def test_reinforce_n_interactions_rows_start_each_episode_from_zero():
    """pg's rows in the n_interactions mode: an unfinished episode waits in the
    tail and is rerun from its first step; the batch's resets mark every
    episode end and the padding before the tail's first step."""
    config = pg.Config(env=probe_envs.CUE_PROBE, torso='gru', hidden_sizes=(8,), gru_size=8,
                       n_trajectories_per_epoch=None, n_envs=2, n_interactions_per_epoch=14,
                       n_eval_episodes=0, epochs=2)
    agent = pg.make_agent(config)
    hp = {name: jnp.asarray(value, jnp.float32)
          for name, value in common.expand_runs(config, {}, 0, 1)[0].items() if name != 'seed'}
    state = agent.init(jax.random.PRNGKey(0), hp)
    state, _ = agent.collect(hp, state)
    state, _ = agent.collect(hp, state)
    batch = jax.tree.map(lambda x: np.asarray(x).reshape((2, -1) + x.shape[1:]), state.batch)
    for row in range(2):
        trained = batch.weight[row] > 0
        first = np.argmax(trained)  # the first step trained on starts an episode
        assert trained.any() and first > 0 and batch.reset[row][first - 1]
    log_probs, _ = pg.log_probs_of(agent.spec, state.params, state.batch)
    assert np.all(np.isfinite(np.asarray(log_probs)))


def test_bad_recurrent_settings_are_refused():
    error = common.UsageError
    with pytest.raises(error, match='must divide the rows'):
        ac.make_agent(ac.Config(**{**TINY, 'max_slice_length': 5}))
    with pytest.raises(error, match='multiple of the sequences'):
        ac.make_agent(ac.Config(**{**TINY, 'batch_size': 20}))
    with pytest.raises(error, match='acts with --torso gru only'):
        ac.make_agent(ac.Config(**{**TINY, 'torso': 'mlp'}))
    with pytest.raises(error, match='acts with --torso gru only'):
        pg.make_agent(pg.Config(gru_size=8))
    with pytest.raises(error, match='needs --batch-size 0'):
        pg.make_agent(pg.Config(torso='gru', batch_size=64))
    with pytest.raises(error, match='--torso must be one of auto, mlp, conv,'):
        dqn.make_agent(dataclasses.replace(dqn.Config(), torso='gru'))


def test_dqn_has_no_recurrent_torso_on_its_command_line(capsys):
    with pytest.raises(SystemExit) as info:
        dqn.main(['--torso', 'gru'])
    assert info.value.code == 2
    assert 'gru' in capsys.readouterr().err
