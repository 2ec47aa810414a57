"""actor_critic.py: A2C and PPO. Value targets of every estimator against a
plain-loop reference, the losses by hand, the value chunk and target syncs,
minibatch passes, value probes with known values, gSDE's noise schedule,
CartPole-v1 learning, the defaults' PPO, the per-env settings and bad input.
Module-level pieces are called with `agent.spec`; nothing is monkey-patched."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import actor_critic as ac  # noqa: E402
import common  # noqa: E402
import fields  # noqa: E402
import policies  # noqa: E402
from harness import flags  # noqa: E402
import probe_envs  # noqa: E402
# The probe envs (registered on import) and the phase driver are test_pg's.
from test_pg import GYMNAX_ENVS, cache, run_phases  # noqa: E402,F401 (cache: a fixture)

# ---------------------------------------------------------------------------
# Actor-critic (a2c, ppo): value targets, losses, value probes, learning.
# ---------------------------------------------------------------------------

GAMMA = 0.9


def ref_n_step(t, n, reward, terminated, truncated, final_value, values, last_value, gamma):
    """Plain-loop reference: the n-step return of step t in a row that may hold
    several episodes. The sum stops at the episode's end (a termination adds
    nothing more, a truncation adds gamma * V(final obs)) and at the row's end
    (then gamma^e V(last obs)); otherwise it bootstraps from V(s_{t+n})."""
    total, discount = 0.0, 1.0
    for j in range(n):
        i = t + j
        if i == len(reward):  # past the collected steps: bootstrap from the last obs
            return total + discount * last_value
        total += discount * reward[i]
        if terminated[i]:
            return total
        if truncated[i]:
            return total + discount * gamma * final_value[i]
        discount *= gamma
    i = t + n
    return total + discount * (last_value if i == len(reward) else values[i])


def ref_targets(name, margin, lam, row, gamma=GAMMA):
    """Each step's value target by the definitions, not by the estimators'
    recursions: Monte Carlo = the return to the episode's (or row's) end;
    td_k = the k-step return; td_lambda and gae on Trax's slices of margin
    steps = the lambda-weighted n-step returns, n = 1..margin."""
    reward, terminated, truncated, final_value, values, last_value = row
    steps = len(reward)
    n_step = lambda t, n: ref_n_step(t, n, reward, terminated, truncated, final_value, values,
                                     last_value, gamma)
    if name == 'monte_carlo':
        return np.array([n_step(t, steps + 1) for t in range(steps)])
    if name == 'td_k':
        return np.array([n_step(t, margin) for t in range(steps)])
    weights = [(1 - lam) * lam ** (n - 1) for n in range(1, margin)] + [lam ** (margin - 1)]
    return np.array([sum(w * n_step(t, n) for n, w in zip(range(1, margin + 1), weights))
                     for t in range(steps)])


# One env's row of 9 steps: an episode terminated at step 2, one truncated by
# the time limit at step 5 (V(final obs) = 4), then one running past the row's
# end (V(last obs) = 2.5).
ROW = (np.array([1.0, -2.0, 3.0, 0.5, 1.5, 2.0, -1.0, 0.25, 4.0], np.float32),
       np.array([0, 0, 1, 0, 0, 0, 0, 0, 0], bool),
       np.array([0, 0, 0, 0, 0, 1, 0, 0, 0], bool),
       np.array([9, 9, 9, 9, 9, 4.0, 9, 9, 9], np.float32),
       np.array([0.3, 1.1, -0.7, 2.0, 0.4, 1.6, -0.2, 0.9, 1.3], np.float32),
       np.float32(2.5))


def row_advantages(name, margin, lam, row, gamma=GAMMA):
    reward, terminated, truncated, final_value, values, last_value = map(jnp.asarray, row)
    reward = ac.bootstrapped_rewards(reward, terminated, truncated, final_value, gamma)
    estimator = ac.make_estimator(name, gamma, margin, lam)
    return ac.step_advantages(estimator, margin, name == 'monte_carlo', gamma, reward,
                              terminated | truncated, jnp.ones(len(row[0]), bool), values,
                              last_value)


@pytest.mark.parametrize('name, margin', [('monte_carlo', 0), ('monte_carlo', 3), ('td_k', 1),
                                          ('td_k', 3), ('td_lambda', 1), ('td_lambda', 4),
                                          ('gae', 4), ('gae', 12)])
def test_value_targets_are_values_plus_each_estimators_advantage(name, margin):
    """V(s) + A for every common.py estimator on Trax's slices equals the
    definition's return: episode ends cut it, a truncation bootstraps from
    V(final obs), the row's end from V(last obs), a termination from nothing."""
    adv = row_advantages(name, margin, 0.8, ROW)
    np.testing.assert_allclose(np.asarray(adv) + ROW[4], ref_targets(name, margin, 0.8, ROW),
                               rtol=1e-5, atol=1e-5)


def test_truncation_bootstraps_and_termination_does_not():
    """The same row, read with the truncation as a termination (Trax): its
    episode's targets lose gamma^j * gamma * V(final obs), and nothing else
    changes."""
    as_terminal = (ROW[0], ROW[1] | ROW[2], np.zeros(9, bool), *ROW[3:])
    for name, margin in (('td_lambda', 4), ('monte_carlo', 0), ('td_k', 3)):
        diff = np.asarray(row_advantages(name, margin, 0.8, ROW)
                          - row_advantages(name, margin, 0.8, as_terminal))
        np.testing.assert_allclose(diff[:3], 0, atol=1e-6)  # the terminated episode
        np.testing.assert_allclose(diff[6:], 0, atol=1e-6)  # the episode after
        assert diff[5] == pytest.approx(GAMMA * 4.0, rel=1e-5)  # its last step: r + gamma V
        assert np.all(diff[3:6] > 0)
    # gae equals td_lambda on the same slices (Trax's table: td_lambda = gae).
    np.testing.assert_allclose(row_advantages('gae', 5, 0.7, ROW),
                               row_advantages('td_lambda', 5, 0.7, ROW), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('name', ['gae', 'td_lambda'])
@pytest.mark.parametrize('extra', [0, 5])
def test_one_pass_over_the_row_is_every_slice_bitwise(name, extra):
    """With a margin reaching past the row's end from every step, the one
    backward pass (row_estimator's fast path) gives Trax's slices' advantages
    bit for bit: rows with terminations, truncations (bootstrap in the
    reward), uncollected steps after an episode's end, and value outliers."""
    key = jax.random.PRNGKey(3)
    rows, length = 64, 20
    k = jax.random.split(key, 5)
    reward = jax.random.normal(k[0], (rows, length)) * 3
    done = jax.random.uniform(k[1], (rows, length)) < 0.15
    first_invalid = jax.random.randint(k[2], (rows, 1), length // 2, length + 8)
    valid = jnp.arange(length)[None] < first_invalid
    values = jax.random.normal(k[3], (rows, length)) * 10
    last = jax.random.normal(k[4], (rows,)) * 10
    margin = length + extra
    fast = ac.row_estimator(name, 0.97, margin, 0.9, length)
    slices = functools.partial(ac.step_advantages, ac.make_estimator(name, 0.97, margin, 0.9),
                               margin, False, 0.97)
    assert isinstance(fast, functools.partial) and fast.func is ac.whole_row_advantages
    got = jax.jit(jax.vmap(fast))(reward, done, valid, values, last)
    want = jax.jit(jax.vmap(slices))(reward, done, valid, values, last)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # A margin one short of the row is not the same for the first step.
    short = ac.row_estimator(name, 0.97, length - 1, 0.9, length)
    assert short.func is ac.step_advantages


# pg.py's defaults, which these small configs were written against (the
# defaults here are PPO's): one full-batch policy step, no momentum, no clipping.
OLD_DEFAULTS = dict(n_interactions_per_epoch=None, train_steps_per_epoch=1, batch_size=0,
                    lr=1e-2, adam_b1=0.0, adam_b2=0.99, gamma=0.995, entropy_coeff=0.0,
                    max_grad_norm=0.0, value_batch_size=64, value_train_steps_per_epoch=500)


def ac_config(**overrides):
    values = dict(OLD_DEFAULTS, env='PgProbe-Countdown', epochs=1, n_trajectories_per_epoch=2,
                  max_steps=6,
                  hidden_sizes=(), policy_loss='a2c', advantage_estimator='td_lambda',
                  added_policy_slice_length=3, lr_schedule='constant', gamma=GAMMA,
                  value_batch_size=0, value_train_steps_per_epoch=2, value_lr=0.1,
                  n_eval_episodes=0)
    values.update(overrides)
    return ac.Config(**values)


def single_hp(config):
    return {name: jnp.asarray(value, jnp.float32)
            for name, value in common.expand_runs(config, {}, 0, 1)[0].items() if name != 'seed'}


def hand_rollout():
    """Two rows of 6 steps of Countdown-shaped observations [x, 1]: row 0 is
    ROW's first 6 steps (terminated at 2, truncated at 5), row 1 one episode
    running past the end of the row."""
    obs = jnp.stack([jnp.linspace(0, 1, 6), jnp.ones(6)], -1)
    obs = jnp.stack([obs, obs[::-1] * jnp.asarray([0.5, 1.0])])
    final = obs + jnp.asarray([0.3, 0.0])
    return ac.Rollout(obs=obs, action=jnp.zeros((2, 6), jnp.int32),
                      reward=jnp.stack([jnp.asarray(ROW[0][:6]), jnp.arange(6.0)]),
                      terminated=jnp.asarray([ROW[1][:6], np.zeros(6, bool)]),
                      truncated=jnp.asarray([ROW[2][:6], np.zeros(6, bool)]),
                      final_obs=final, valid=jnp.ones((2, 6), bool),
                      last_obs=jnp.asarray([[0.2, 1.0], [0.9, 1.0]]))


def as_replay(rollout):
    """One epoch's rollout as a replay of n_replay_epochs 1."""
    return jax.tree.map(lambda x: x[None], rollout)


def linear_value(params, obs):
    return np.asarray(obs) @ np.asarray(params[0]['w'])[:, 0] + float(params[0]['b'][0])


def test_value_chunk_regresses_on_target_network_targets_and_syncs_after():
    """One value chunk of 2 full-batch Adam steps: the targets are
    V_target + A from the target network, computed once and held while the
    online network moves (they differ between syncs); right after the chunk
    the target network is the trained one."""
    config = ac_config()
    agent = ac.make_agent(config)
    hp = single_hp(config)
    state = agent.init(jax.random.PRNGKey(0), hp)
    online = [{'w': jnp.asarray([[1.5], [0.5]]), 'b': jnp.asarray([0.2])}]
    target = [{'w': jnp.asarray([[-1.0], [2.0]]), 'b': jnp.asarray([0.1])}]
    rollout = hand_rollout()
    # (The fresh optimiser state of init fits these parameters' shapes.)
    state = state._replace(replay=as_replay(rollout), value_params=online, target_value_params=target)
    new_state, _ = ac.value_chunk(agent.spec, hp, state, jax.random.PRNGKey(1))

    # The targets by the definitions, with the target network's values.
    targets = []
    for row in range(2):
        v = linear_value(target, rollout.obs[row])
        row_data = (np.asarray(rollout.reward[row]), np.asarray(rollout.terminated[row]),
                    np.asarray(rollout.truncated[row]),
                    linear_value(target, rollout.final_obs[row]), v,
                    linear_value(target, rollout.last_obs[row][None])[0])
        targets.append(ref_targets('td_lambda', 3, 0.95, row_data))
    targets = jnp.asarray(np.concatenate(targets), jnp.float32)
    obs = rollout.obs.reshape(12, 2)

    def l2(params):
        return jnp.mean((obs @ params[0]['w'][:, 0] + params[0]['b'][0] - targets) ** 2)

    optimizer = optax.adam(0.1)
    params, opt_state = online, optimizer.init(online)
    for _ in range(2):
        updates, opt_state = optimizer.update(jax.grad(l2)(params), opt_state)
        params = optax.apply_updates(params, updates)
    for got, want in zip(jax.tree.leaves(new_state.value_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Right after the chunk: synced.
    for got, want in zip(jax.tree.leaves(new_state.target_value_params),
                         jax.tree.leaves(new_state.value_params)):
        np.testing.assert_array_equal(got, want)
    assert int(new_state.value_train_step) == 2
    # Between syncs the target network is not the online one: targets from the
    # online network (or refreshed after the first step) give other parameters.
    state_online = state._replace(target_value_params=online)
    other, _ = ac.value_chunk(agent.spec, hp, state_online, jax.random.PRNGKey(1))
    assert not np.allclose(other.value_params[0]['w'], new_state.value_params[0]['w'])


def test_train_syncs_the_target_before_value_training_and_after_each_chunk():
    config = ac_config(value_evals_per_epoch=2, value_train_steps_per_epoch=4)
    agent = ac.make_agent(config)
    hp = single_hp(config)
    state = agent.init(jax.random.PRNGKey(0), hp)
    stale = jax.tree.map(lambda x: x + 1.0, state.value_params)
    state = state._replace(replay=as_replay(hand_rollout()), target_value_params=stale)
    new_state, metrics = agent.train(hp, state)
    for got, want in zip(jax.tree.leaves(new_state.target_value_params),
                         jax.tree.leaves(new_state.value_params)):
        np.testing.assert_array_equal(got, want)
    # Chunk by chunk, by hand: sync, chunk, sync, chunk (the stale target is never used).
    manual = state._replace(target_value_params=state.value_params)
    for chunk_key in jax.random.split(jax.random.split(state.key, 3)[1], 2):
        manual, _ = ac.value_chunk(agent.spec, hp, manual, chunk_key)
    for got, want in zip(jax.tree.leaves(new_state.value_params),
                         jax.tree.leaves(manual.value_params)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert int(new_state.value_train_step) == 4 and int(new_state.train_step) == 1


def linear_softmax_case(seed=0, n=8, d=3, k=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    actions = rng.integers(0, k, size=n)
    weight = np.array([1, 1, 0, 1, 1, 1, 0, 1], np.float32)[:n]
    params = [{'w': jnp.asarray(rng.normal(size=(d, k)) * 0.5, jnp.float32),
               'b': jnp.asarray(rng.normal(size=k) * 0.5, jnp.float32)}]
    return x, actions, weight, params


def softmax_np(logits):
    p = np.exp(logits - logits.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def test_a2c_loss_value_and_gradient_by_hand():
    x, actions, weight, params = linear_softmax_case()
    adv = np.array([1.5, -0.5, 3.0, 0.2, -2.0, 0.7, 9.0, -1.0], np.float32)

    def loss(params):
        log_probs = policies.categorical_log_prob(common.mlp(params, x), jnp.asarray(actions))
        return ac.a2c_loss(log_probs, jnp.asarray(adv), jnp.asarray(weight))

    probs = softmax_np(x @ np.asarray(params[0]['w']) + np.asarray(params[0]['b']))
    log_p = np.log(probs[np.arange(8), actions])
    assert float(loss(params)) == pytest.approx(-(weight * log_p * adv).sum() / weight.sum(),
                                                rel=1e-5)
    grads = jax.grad(loss)(params)[0]
    dlogits = -(weight * adv / weight.sum())[:, None] * (np.eye(3)[actions] - probs)
    np.testing.assert_allclose(grads['w'], x.T @ dlogits, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads['b'], dlogits.sum(0), rtol=1e-4, atol=1e-6)


def test_ppo_loss_value_and_gradient_by_hand_and_clipping_zeroes_it():
    """ratio = pi / pi_old. Per step the objective is min(ratio A, clip(ratio) A);
    its gradient is ratio A d log pi where the unclipped term is the minimum and
    0 where the clipped one is: ratio > 1 + eps with A > 0, ratio < 1 - eps
    with A < 0."""
    x, actions, weight, params = linear_softmax_case(seed=1)
    eps = 0.2
    probs = softmax_np(x @ np.asarray(params[0]['w']) + np.asarray(params[0]['b']))
    p_taken = probs[np.arange(8), actions]
    # Old probabilities chosen to put each step's ratio where we want it.
    ratio = np.array([1.5, 1.5, 0.5, 0.5, 1.1, 0.9, 1.5, 1.0], np.float32)
    adv = np.array([1.0, -1.0, 1.0, -1.0, 2.0, -2.0, 0.0, 0.5], np.float32)
    old_log_probs = np.log(p_taken / ratio)

    def loss(params):
        log_probs = policies.categorical_log_prob(common.mlp(params, x), jnp.asarray(actions))
        return ac.ppo_loss(log_probs, jnp.asarray(old_log_probs), jnp.asarray(adv),
                           jnp.asarray(weight), eps)

    objective = np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
    assert float(loss(params)) == pytest.approx(-(weight * objective).sum() / weight.sum(),
                                                rel=1e-4)
    # Steps 0 (ratio 1.5, A > 0) and 3 (ratio 0.5, A < 0): clipped, no gradient;
    # 1 and 2 (the other side): the unclipped term, full gradient.
    active = np.array([0, 1, 1, 0, 1, 1, 1, 1], np.float32)
    dlogits = (-(weight * active * adv * ratio / weight.sum())[:, None]
               * (np.eye(3)[actions] - probs))
    grads = jax.grad(loss)(params)[0]
    np.testing.assert_allclose(grads['w'], x.T @ dlogits, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads['b'], dlogits.sum(0), rtol=1e-4, atol=1e-6)
    # Per step: the gradient with respect to its own log-prob.
    per_step = jax.grad(lambda lp: ac.ppo_loss(lp, jnp.asarray(old_log_probs), jnp.asarray(adv),
                                               jnp.ones(8), eps))(jnp.asarray(np.log(p_taken)))
    np.testing.assert_allclose(per_step, -active * adv * ratio / 8, rtol=1e-5, atol=1e-7)
    assert float(per_step[0]) == 0.0 and float(per_step[3]) == 0.0
    assert float(per_step[1]) != 0.0 and float(per_step[2]) != 0.0


def test_awr_loss_value_and_gradient_by_hand():
    """Trax's AWRLoss: each step's log-prob weighted by min(exp(A / beta), w_max),
    -sum(w weight log pi) / sum(w); the weights are constants (no gradient to A)
    and an overflowing exp is capped, not NaN."""
    x, actions, weight, params = linear_softmax_case(seed=2)
    adv = np.array([1.0, -0.5, 3.0, 0.0, -2.0, 0.7, 9.0, -1.0], np.float32)
    beta, w_max = 0.5, 20.0
    # exp(2 A), by hand: e^2, e^-1, e^6 > 20, e^0, e^-4, e^1.4, e^18 > 20, e^-2.
    by_hand = np.array([7.3890561, 0.36787944, 20.0, 1.0, 0.018315639, 4.0552, 20.0, 0.13533528])
    np.testing.assert_allclose(ac.awr_weights(jnp.asarray(adv), beta, w_max), by_hand, rtol=1e-5)

    def loss(params, adv):
        log_probs = policies.categorical_log_prob(common.mlp(params, x), jnp.asarray(actions))
        return ac.awr_loss(log_probs, adv, jnp.asarray(weight), beta, w_max)

    probs = softmax_np(x @ np.asarray(params[0]['w']) + np.asarray(params[0]['b']))
    log_p = np.log(probs[np.arange(8), actions])
    assert float(loss(params, jnp.asarray(adv))) == pytest.approx(
        -(weight * by_hand * log_p).sum() / weight.sum(), rel=1e-5)
    grads, adv_grad = jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(adv))
    dlogits = -(weight * by_hand / weight.sum())[:, None] * (np.eye(3)[actions] - probs)
    np.testing.assert_allclose(grads[0]['w'], x.T @ dlogits, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads[0]['b'], dlogits.sum(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(adv_grad, np.zeros(8))
    huge = jnp.asarray(adv).at[0].set(1e4)  # exp(2e4) = inf: capped at w_max
    assert float(ac.awr_weights(huge, beta, w_max)[0]) == w_max
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(jax.grad(loss)(params, huge)))


def replay_config(n_replay_epochs, **overrides):
    """AWR in n_interactions mode on the Countdown probe: 2 envs x 6 steps an epoch."""
    return ac_config(policy_loss='awr', n_replay_epochs=n_replay_epochs, max_steps=None,
                     n_trajectories_per_epoch=None, n_envs=2, n_interactions_per_epoch=12,
                     **overrides)


def test_replay_is_a_ring_of_the_last_epochs():
    """Epoch e's rollout goes to slot e % n_replay_epochs, overwriting the
    oldest; slots not yet collected are invalid. (Collection does not depend on
    the replay: n_replay_epochs 1 collects the same rollouts.)"""
    configs = [replay_config(1), replay_config(2)]
    agents = [ac.make_agent(config) for config in configs]
    hp = single_hp(configs[0])
    states = [agent.init(jax.random.PRNGKey(4), hp) for agent in agents]
    assert not np.any(states[1].replay.valid)
    for epoch in range(3):
        states = [agent.collect(hp, state)[0] for agent, state in zip(agents, states)]
        latest = jax.tree.map(lambda x: x[0], states[0].replay)
        jax.tree.map(np.testing.assert_array_equal, latest,
                     jax.tree.map(lambda x: x[epoch % 2], states[1].replay))
        if epoch == 0:
            assert np.all(states[1].replay.valid[0]) and not np.any(states[1].replay.valid[1])
        else:  # the other slot holds the epoch before
            jax.tree.map(np.testing.assert_array_equal, previous,
                         jax.tree.map(lambda x: x[(epoch - 1) % 2], states[1].replay))
        previous = latest
        states = [state._replace(epoch=state.epoch + 1) for state in states]  # as train does


def test_replayed_epochs_each_get_their_own_advantages_and_every_pass_covers_them():
    """advantages_of over a replay of 2 epochs = each epoch alone (each row
    bootstraps from its own last observation); minibatch passes visit every
    collected step of every replayed epoch once, also while the replay is not
    yet full."""
    config = replay_config(3, hidden_sizes=(4,))
    agent = ac.make_agent(config)
    hp = single_hp(config)
    state = agent.init(jax.random.PRNGKey(5), hp)
    for _ in range(2):
        state, _ = agent.collect(hp, state)
        state = state._replace(epoch=state.epoch + 1)
    adv, values = ac.advantages_of(agent.spec, hp, state.value_params, state.replay)
    for slot in range(2):
        alone = jax.tree.map(lambda x: x[slot:slot + 1], state.replay)
        adv_alone, values_alone = ac.advantages_of(agent.spec, hp, state.value_params, alone)
        np.testing.assert_allclose(adv[slot], adv_alone[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(values[slot], values_alone[0], rtol=1e-6, atol=1e-6)
    weight = ac.flat(state.replay.valid).astype(jnp.float32)  # 24 of 36 steps
    minibatch = ac.minibatches(agent.spec, jax.random.PRNGKey(6), weight, 6, 8)
    batches = np.stack([np.asarray(minibatch(step)) for step in range(6)])
    for one_pass in (batches[:3], batches[3:]):
        assert sorted(one_pass.ravel()) == list(range(24))  # slots 0 and 1, not 2
    # One epoch collected, 12 steps: 6 minibatch steps of 8 are 3 passes, each whole.
    weight_one = weight.at[12:].set(0.0)
    minibatch = ac.minibatches(agent.spec, jax.random.PRNGKey(6), weight_one, 6, 8)
    batches = np.stack([np.asarray(minibatch(step)) for step in range(6)])
    for one_pass in (batches[0:2], batches[2:4], batches[4:6]):
        assert sorted(one_pass.ravel()) == sorted(list(range(12)) + list(one_pass.ravel()[:4]))
    assert not np.array_equal(batches[2:4], batches[4:6])  # each pass a fresh order


def test_normalized_advantages_use_the_factor_epsilon_and_weights():
    adv = jnp.asarray([1.0, 3.0, 100.0, 5.0])
    weight = jnp.asarray([1.0, 1.0, 0.0, 1.0])
    got = np.asarray(ac.normalized_advantages(adv, weight, 2.0, 0.5))
    raw = np.array([1.0, 3.0, 5.0])
    np.testing.assert_allclose(got[[0, 1, 3]], 2.0 * (raw - 3.0) / (raw.std() + 0.5), rtol=1e-6)


def test_minibatches_visit_every_valid_step_once_per_pass():
    weight = jnp.asarray([1, 0, 1, 1, 0, 1, 1, 1, 1, 1], jnp.float32)  # 8 valid
    key = jax.random.PRNGKey(3)
    batches = [np.asarray(ac.minibatch_indices(key, weight, 4, step)) for step in range(6)]
    for pass_batches in (batches[0:2], batches[2:4], batches[4:6]):
        assert sorted(np.concatenate(pass_batches)) == [0, 2, 3, 5, 6, 7, 8, 9]
    assert not np.array_equal(np.concatenate(batches[0:2]), np.concatenate(batches[2:4]))


def test_precomputed_pass_orders_give_the_same_minibatches():
    """With every step weighted the orders are drawn once per epoch
    (pass_orders); the minibatches are those each step would sort for itself."""
    weight = jnp.ones(10)
    key = jax.random.PRNGKey(5)
    n_passes = ac.passes_needed(7, 4, 10)  # 3 minibatches per pass: 3 passes
    assert n_passes == 3
    orders = ac.pass_orders(key, weight, n_passes)
    for step in range(7):
        np.testing.assert_array_equal(ac.minibatch_indices(key, weight, 4, step, orders),
                                      ac.minibatch_indices(key, weight, 4, step))


def trained_value(config, obs, epochs):
    agent, state, history, _, _ = run_phases(config, epochs=epochs)
    value_params = jax.tree.map(lambda x: x[0], state.value_params)
    return np.asarray(ac.value_net(agent.spec, value_params, jnp.asarray(obs))), history


@pytest.mark.parametrize('estimator', ['td_lambda', 'monte_carlo'])
def test_learned_value_matches_the_known_discounted_value(estimator):
    """Countdown: 5 steps paying 1..5, then termination; V(s_t) = sum_j
    gamma^j (t + 1 + j), the same whatever the policy (one-hot time steps and
    a linear value network, which can represent it exactly)."""
    config = ac_config(env='PgProbe-CountdownOneHot', epochs=20, n_trajectories_per_epoch=8,
                       max_steps=None, advantage_estimator=estimator,
                       value_train_steps_per_epoch=40, value_evals_per_epoch=4, value_lr=0.05)
    expected = [sum(GAMMA ** j * (t + 1 + j) for j in range(5 - t)) for t in range(5)]
    obs = np.eye(6)[:5]
    values, history = trained_value(config, obs, config.epochs)
    np.testing.assert_allclose(values, expected, rtol=0.03)


def test_value_bootstraps_through_truncation():
    """Endless is only ever truncated (at 5 steps): with the bootstrap from
    V(final obs) its value is 1 / (1 - gamma) = 10; read as terminal (Trax)
    it would be the mean truncated return, about 2.6."""
    config = ac_config(env='PgProbe-Endless', epochs=25, n_trajectories_per_epoch=4,
                       max_steps=None, hidden_sizes=(8,), value_train_steps_per_epoch=40,
                       value_evals_per_epoch=4, value_lr=0.05)
    values, _ = trained_value(config, np.ones((1, 2)), config.epochs)
    assert float(values[0]) == pytest.approx(1 / (1 - GAMMA), rel=0.05)


# Small CartPole-v1 configs: 16 envs whose episodes run on across epochs,
# Adam with momentum, gradients clipped at 0.5, Trax's entropy bonus 0.01,
# GAE over slices of 32 steps.
AC_CARTPOLE = dict(n_trajectories_per_epoch=None, n_envs=16, advantage_estimator='gae',
                   adam_b1=0.9, adam_b2=0.999, max_grad_norm=0.5, gamma=0.99,
                   entropy_coeff=0.01, value_lr=1e-3, n_eval_episodes=4)


@pytest.mark.parametrize('policy_loss, overrides', [
    # PPO: 64 minibatch steps of 128 (4 passes) on 2048 steps per epoch.
    ('ppo', dict(n_interactions_per_epoch=2048, train_steps_per_epoch=64, batch_size=128,
                 value_batch_size=128, value_train_steps_per_epoch=64, lr=1e-3, epochs=100)),
    # A2C: 2 full-batch steps on 1024 steps per epoch.
    ('a2c', dict(n_interactions_per_epoch=1024, train_steps_per_epoch=2, batch_size=0,
                 value_batch_size=128, value_train_steps_per_epoch=32, lr=1e-3, epochs=120)),
    # --joint PPO (separate torsos): the same 64 steps of 128 on one loss, one Adam.
    ('ppo', dict(n_interactions_per_epoch=2048, train_steps_per_epoch=64, batch_size=128,
                 lr=1e-3, epochs=100, joint=True, value_loss_coeff=0.5)),
    # Trax's PPOJoint: one shared torso, value coefficient 0.1; the value head
    # predicts V * (1 - gamma), so its loss does not swamp the torso.
    ('ppo', dict(n_interactions_per_epoch=2048, train_steps_per_epoch=64, batch_size=128,
                 lr=1e-3, epochs=100, joint=True, shared_torso=True, value_loss_coeff=0.1,
                 scale_value_targets=True)),
])
def test_actor_critic_solves_cartpole(policy_loss, overrides):
    config = ac.Config(policy_loss=policy_loss, **AC_CARTPOLE, **overrides)
    agent, state, history, _, _ = run_phases(config, epochs=config.epochs)
    key = common.return_tag(0.0, 500)
    assert float(history[0][key][0]) < 200  # it learned, it did not start there
    assert float(history[-1][key][0]) >= 475
    assert np.isfinite(float(history[-1]['metrics/value_loss'][0]))


@pytest.mark.parametrize('argv, message', [
    (['--advantage-estimator', 'mean_return'], '--advantage-estimator'),  # pg.py's
    (['--policy-loss', 'reinforce'], '--policy-loss'),  # pg.py's
    (['--policy-loss', 'sarsa'], '--policy-loss'),
    (['--policy-loss', 'a2c', '--advantage-estimator', 'nope'], '--advantage-estimator'),
    (['--policy-loss', 'a2c', '--added-policy-slice-length', '0'], '--added-policy-slice-length'),
    (['--policy-loss', 'ppo', '--lambda', '1.5'], '--lambda'),
    (['--policy-loss', 'ppo', '--epsilon', '0'], '--epsilon'),
    (['--policy-loss', 'ppo', '--value-train-steps-per-epoch', '10',
      '--value-evals-per-epoch', '3'], 'divisible'),
    (['--policy-loss', 'ppo', '--scale-value-targets', '--gamma', '1'], '--scale-value-targets'),
    (['--policy-loss', 'ppo', '--n-replay-epochs', '2'], '--n-replay-epochs'),  # on-policy
    (['--policy-loss', 'a2c', '--n-replay-epochs', '3'], '--policy-loss awr'),
    (['--policy-loss', 'awr', '--n-replay-epochs', '0'], '--n-replay-epochs'),
    (['--policy-loss', 'awr', '--awr-beta', '0'], '--beta'),
    (['--policy-loss', 'awr', '--awr-max-weight', '-1,20'], '--w-max'),
    # Flags of another mode: saved, binding a resume, changing nothing.
    (['--policy-loss', 'a2c', '--epsilon', '0.3'], '--epsilon acts with --policy-loss ppo'),
    (['--policy-loss', 'awr', '--epsilon', '0.2,0.3'], '--epsilon acts'),
    (['--policy-loss', 'ppo', '--beta', '2'], '--beta acts with --policy-loss awr'),
    (['--policy-loss', 'ppo', '--w-max', '5'], '--w-max acts'),
    (['--advantage-estimator', 'td_k', '--lambda', '0.9'], '--lambda acts with'),
    # --joint: one loss, one optimiser; the value trainer's own flags cannot act.
    (['--shared-torso'], '--shared-torso acts with --joint only'),
    (['--value-loss-coeff', '0.1'], '--value-loss-coeff acts with --joint only'),
    (['--joint', '--value-lr', '3e-4'], '--value-lr acts without --joint only'),
    (['--joint', '--value-batch-size', '64'], '--value-batch-size acts without --joint'),
    (['--joint', '--value-train-steps-per-epoch', '8'], '--value-train-steps-per-epoch acts'),
    (['--joint', '--value-evals-per-epoch', '2'], '--value-evals-per-epoch acts'),
    (['--joint', '--value-loss-coeff', '-1'], '--value-loss-coeff'),
])
def test_bad_actor_critic_input_exits_2_with_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / 'bad'
    with pytest.raises(SystemExit) as exit_info:
        ac.main([*argv, '--output-dir', str(out), '--quiet'])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not out.exists()  # refused before anything is compiled or written


def test_lambda_flag_and_actor_critic_defaults():
    parser = flags.build_parser(ac.Config, 'actor_critic.py', '')
    args = parser.parse_args(['--lambda', '0.9,0.8', '--policy-loss', 'ppo'])
    config, grid = flags.config_and_grid(ac.Config, args)
    assert grid == {'lambda_': [0.9, 0.8]} and config.lambda_ == 0.9
    # PPO's defaults: GAE, rollouts carried over epochs, minibatches, momentum, clipping.
    default = ac.Config()
    assert (default.policy_loss, default.advantage_estimator) == ('ppo', 'gae')
    assert default.n_trajectories_per_epoch is None and default.n_interactions_per_epoch
    assert default.batch_size and default.value_batch_size
    assert (default.adam_b1, default.adam_b2, default.max_grad_norm) == (0.9, 0.999, 0.5)
    assert default.value_train_steps_per_epoch < 500  # not Trax's 500 value steps
    # Trax's name for the normalisation switch is an alias of ours.
    for argv, value in ((['--no-advantage-normalization'], False),
                        (['--advantage-normalization'], True), (['--no-normalize-advantages'], False)):
        config, _ = flags.config_and_grid(ac.Config, parser.parse_args(argv))
        assert config.normalize_advantages is value


@pytest.mark.parametrize('policy_loss, overrides', [
    ('ppo', {}), ('awr', {'n_replay_epochs': 3, 'beta': 0.5})])
def test_gaussian_probe_converges_to_the_best_continuous_action(policy_loss, overrides):
    """The Box path of the actor-critic: PPO (Gaussian log-probs and ratios),
    and AWR (weighted log-probs, on 3 epochs of replay) on one-step episodes
    whose best action is 0.5."""
    config = ac_config(env='PgProbe-BoxTarget', policy_loss=policy_loss, epochs=40,
                       max_steps=None, n_trajectories_per_epoch=64, hidden_sizes=(16,), lr=0.02,
                       init_log_std=-0.5, train_steps_per_epoch=4, batch_size=32,
                       value_train_steps_per_epoch=8, value_lr=0.05, n_eval_episodes=8,
                       adam_b1=0.9, **overrides)
    agent, state, history, _, _ = run_phases(config, epochs=config.epochs)
    net = jax.tree.map(lambda x: x[0], state.params['net'])
    assert float(common.mlp(net, jnp.ones(2))[0]) == pytest.approx(0.5, abs=0.1)
    assert float(history[-1][common.return_tag(0.0, 1)][0]) > -0.01
    if policy_loss == 'ppo':
        assert 0 <= float(history[-1]['metrics/clip_fraction'][0]) <= 1
    else:  # Trax's weight statistics, within the cap
        last = history[-1]
        assert 0 < float(last['metrics/awr_weight_min'][0]) <= float(
            last['metrics/awr_weight_mean'][0]) <= float(last['metrics/awr_weight_max'][0]) <= 20


@pytest.mark.parametrize('freq, blocks', [(4, [[0, 4], [4, 8]]), (0, [[0, 8]])])
def test_sde_weights_are_held_for_sde_sample_freq_steps(freq, blocks):
    """BoxTarget's observation never changes, so action - mean is the noise
    weights' draw itself: constant over each --sde-sample-freq block of an
    env's steps (0: the whole epoch's rollout), fresh across blocks and envs."""
    config = ac_config(env='PgProbe-BoxTarget', policy_loss='ppo', max_steps=None,
                       n_trajectories_per_epoch=None, n_envs=2, n_interactions_per_epoch=16,
                       hidden_sizes=(16,), state_dependent_exploration=True,
                       sde_sample_freq=freq)
    agent = ac.make_agent(config)
    hp = single_hp(config)
    state, _ = agent.collect(hp, agent.init(jax.random.PRNGKey(0), hp))
    mean, _ = policies.policy(agent.spec.policy, state.params, jnp.ones(2))
    noise = np.asarray(state.replay.action[0, ..., 0] - mean[0])  # [env, step]
    firsts = []
    for start, stop in blocks:
        block = noise[:, start:stop]
        np.testing.assert_allclose(block, block[:, :1].repeat(stop - start, 1), atol=1e-6)
        firsts.append(block[:, 0])
    firsts = np.concatenate(firsts)
    assert len(np.unique(np.round(firsts, 5))) == len(firsts)  # every draw its own
    assert np.all(np.abs(firsts) > 1e-4)


def test_gsde_ppo_solves_mountain_car_continuous():
    """The env's settings (PPO, gSDE, observations on [-1, 1]) on seed 0: the
    goal pays 100 minus the pushes; standing still gets 0."""
    settings = {**ac.ENV_SETTINGS['MountainCarContinuous-v0'], 'n_eval_episodes': 4}
    config = ac.Config(env='MountainCarContinuous-v0', **settings)
    agent, state, history, _, _ = run_phases(config, epochs=config.epochs)
    key = common.return_tag(0.0, 999)
    assert abs(float(history[0][key][0])) < 50  # the first greedy policy barely moves
    assert float(history[-1][key][0]) >= 90


def test_ppo_settings_solve_catch():
    """Catch-bsuite's entry (PPO) on seed 0: the ball must be caught every time
    (+1); REINFORCE's CartPole defaults, which it replaces, missed on 3 seeds of 8."""
    config = ac.Config(env='Catch-bsuite', **{**ac.ENV_SETTINGS['Catch-bsuite'],
                                              'n_eval_episodes': 64})
    agent, state, history, _, _ = run_phases(config, epochs=config.epochs)
    key = common.return_tag(*agent.eval_tags[0])
    assert float(history[0][key][0]) < 0.5  # not caught by chance
    assert float(history[-1][key][0]) == 1.0


def test_value_network_learns_the_image_probe_through_the_conv_torso():
    """A2C's value network, conv torso: V = +1 or -1 by the lit channel, at every cell."""
    probe_envs.register()
    config = ac_config(env=probe_envs.IMAGE_PROBE, epochs=30, n_trajectories_per_epoch=32,
                       max_steps=None, hidden_sizes=(16,), conv_channels=(4,),
                       advantage_estimator='monte_carlo', value_train_steps_per_epoch=20,
                       value_lr=0.005, gamma=0.9)
    cells = jnp.arange(25)
    obs = jnp.concatenate([jax.vmap(probe_envs.image_observation, (0, None))(cells, 1.0),
                           jax.vmap(probe_envs.image_observation, (0, None))(cells, -1.0)])
    values, _ = trained_value(config, obs, config.epochs)
    np.testing.assert_allclose(values, [1.0] * 25 + [-1.0] * 25, atol=0.1)


def test_env_settings_table_names_real_fields_and_valid_configs():
    config_fields = {field.name: field for field in dataclasses.fields(ac.Config)}
    defaults = {name: field.default for name, field in config_fields.items()}
    # (table, the loss each entry is for, what an entry's fields would be without it)
    tables = [(ac.ENV_SETTINGS, 'ppo', defaults)]
    for loss, own in ac.MODE_SETTINGS.items():
        tables.append(({'CartPole-v1': own}, loss, defaults))
        tables.append((ac.MODE_ENV_SETTINGS[loss], loss, {**defaults, **own}))
    for table, loss, base in tables:
        for name, entry in table.items():
            assert name in GYMNAX_ENVS, name
            settings = {**base, **entry}
            assert settings['policy_loss'] == loss  # each entry names the loss it is for
            for field, value in entry.items():
                assert field in config_fields, (name, field)
                assert value != base[field] or field == 'policy_loss' or \
                    entry is ac.BLINES_MINATAR, (name, field)  # a recipe carried over whole
            fields.check_grid(dataclasses.replace(
                ac.Config(env=name), **{k: v for k, v in settings.items() if k != 'env'}), {},
                ac.check_runs)
    # The table a command line gets: PPO's unless it asks for a mode with its own.
    assert ac.env_settings('ppo', 'Pendulum-v1') is ac.ENV_SETTINGS
    for loss in ('a2c', 'awr'):
        assert ac.env_settings(loss, 'Catch-bsuite')['Catch-bsuite'] == {
            **ac.MODE_SETTINGS[loss], **ac.MODE_ENV_SETTINGS[loss].get('Catch-bsuite', {})}


def test_env_settings_apply_flags_override_and_config_records(tmp_path, capsys):
    """MountainCarContinuous-v0's settings, one tiny epoch: the settings line
    shows them as flags one can type; flags given win; config.json resolves."""
    out = tmp_path / 'run'
    ac.main(['--env', 'MountainCarContinuous-v0', '--epochs', '1', '--n-envs', '2',
             '--n-interactions-per-epoch', '8', '--batch-size', '4', '--value-batch-size', '4',
             '--train-steps-per-epoch', '2', '--value-train-steps-per-epoch', '2',
             '--n-eval-episodes', '0', '--sde-sample-freq', '16',
             '--compile-cache', 'none', '--no-tensorboard', '--output-dir', str(out)])
    printed = capsys.readouterr().out.splitlines()[0]
    assert printed.startswith('actor_critic.py: settings for MountainCarContinuous-v0: ')
    assert '--policy-loss ppo' in printed and '--state-dependent-exploration' in printed
    assert '--normalize-observations ' in printed and 'sde-sample-freq' not in printed
    config = json.loads((out / 'config.json').read_text())
    assert config['policy_loss'] == 'ppo' and config['normalize_observations'] is True
    assert config['sde_sample_freq'] == 16 and config['n_trajectories_per_epoch'] is None
    assert config['state_dependent_exploration'] is True and config['epochs'] == 1


@pytest.mark.parametrize('loss, env', [('awr', 'CartPole-v1'), ('awr', 'Pendulum-v1'),
                                       ('a2c', 'Pendulum-v1')])
def test_a_mode_brings_its_own_settings_never_ppos(loss, env, tmp_path, capsys):
    """`--policy-loss a2c` or `awr` (one tiny epoch): the mode's settings, with
    the env's entry for that mode over them, are applied and printed; none of
    the env's PPO entry is (Pendulum's gamma 0.95); a flag typed still wins."""
    out = tmp_path / 'run'
    typed = dict(epochs=1, n_envs=2, n_interactions_per_epoch=8, batch_size=4,
                 value_batch_size=4, train_steps_per_epoch=2, value_train_steps_per_epoch=2,
                 n_eval_episodes=0, n_replay_epochs=3)
    if loss == 'a2c':  # leave two of A2C's own settings to apply
        typed = {k: v for k, v in typed.items()
                 if k not in ('batch_size', 'train_steps_per_epoch', 'n_replay_epochs')}
    ac.main(['--policy-loss', loss, '--env', env, *fields.settings_flags(typed).split(),
             '--compile-cache', 'none', '--no-tensorboard', '--output-dir', str(out)])
    settings = {**ac.MODE_SETTINGS[loss], **ac.MODE_ENV_SETTINGS[loss].get(env, {})}
    applied = {field: value for field, value in settings.items()
               if field not in typed and field != 'policy_loss'}
    printed = capsys.readouterr().out.splitlines()[0]
    assert printed == (f'actor_critic.py: settings for {env}: {fields.settings_flags(applied)} '
                       '(a flag on the command line overrides each)')
    config = json.loads((out / 'config.json').read_text())
    for field, value in {**settings, **typed}.items():
        assert config[field] == (list(value) if isinstance(value, tuple) else value), field
    for field in set(ac.ENV_SETTINGS.get(env, {})) - set(settings) - set(typed):
        assert config[field] == getattr(ac.Config, field), field  # PPO's entry: not applied


# Tiny A2C and PPO runs through common.run_sweep (3 epochs, 2 seeds) by today's
# code and by the commit before AWR and its replay came in (its actor_critic.py
# and common.py, from the git history), both on this machine with this
# session's XLA options. Bitwise equal (checked on an Intel Xeon; the numbers
# this test once held, recorded on an AMD EPYC, were too): a replay of one
# epoch adds a size-1 axis and a slot write, no arithmetic. Both are computed
# here because another CPU's float32 rounding differs from a recorded run's.
PRE_REPLAY_COMMIT = '7182748'  # b1a555a^, the parent of the replay's commit
# Every field the defaults have moved since then is given (lr, value_lr).
TINY = dict(n_envs=4, n_interactions_per_epoch=64, train_steps_per_epoch=8, batch_size=16,
            value_batch_size=16, value_train_steps_per_epoch=6, value_evals_per_epoch=2,
            hidden_sizes=(8,), n_eval_episodes=2, epochs=3, lr=2e-3, value_lr=2e-3)
UNCHANGED_BY_THE_REPLAY = {
    'ppo': dict(TINY, policy_loss='ppo'),
    'a2c': dict(TINY, policy_loss='a2c', n_interactions_per_epoch=None,
                n_trajectories_per_epoch=3, max_steps=40, batch_size=0,
                advantage_estimator='td_lambda'),
}
# Run in a fresh interpreter in a folder holding the two old files: every
# parameter leaf (policy, then value network), then each metric, sorted by name.
SWEEP_TO_NPZ = """
import sys, jax, numpy as np, actor_critic as ac, common
config = ac.Config(**{kwargs!r})
_, state, metrics = common.run_sweep(ac.make_agent(config), config, num_seeds=2)
leaves = jax.tree.leaves(state.params) + jax.tree.leaves(state.value_params)
names = sorted(metrics)
np.savez(sys.argv[1], *leaves, *[metrics[name] for name in names], names=np.array(names))
"""


def pre_replay_sweep(kwargs, folder):
    """The pre-replay code's run of `kwargs` -> (leaves, {metric: array})."""
    for name in ('actor_critic.py', 'common.py'):
        shown = subprocess.run(['git', '-C', ROOT, 'show', f'{PRE_REPLAY_COMMIT}:{name}'],
                               capture_output=True)
        if shown.returncode:  # e.g. a shallow clone or an exported tree
            pytest.skip(f'needs the git history (commit {PRE_REPLAY_COMMIT}): '
                        f'{shown.stderr.decode().strip()}')
        (folder / name).write_bytes(shown.stdout)
    env = {name: value for name, value in os.environ.items() if name != 'PYTHONPATH'}
    result = subprocess.run([sys.executable, '-c', SWEEP_TO_NPZ.format(kwargs=kwargs),
                             str(folder / 'old.npz')], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    with np.load(folder / 'old.npz') as saved:
        names = list(saved['names'])
        arrays = [saved[f'arr_{i}'] for i in range(len(saved.files) - 1)]
    n_leaves = len(arrays) - len(names)
    return arrays[:n_leaves], dict(zip(names, arrays[n_leaves:]))


@pytest.mark.parametrize('loss', sorted(UNCHANGED_BY_THE_REPLAY))
def test_ppo_and_a2c_are_unchanged_by_the_replay(loss, tmp_path):
    """n_replay_epochs 1 (the default) is A2C and PPO as they were before AWR:
    every parameter and metric bitwise the pre-replay code's on this machine."""
    kwargs = UNCHANGED_BY_THE_REPLAY[loss]
    old_leaves, old_metrics = pre_replay_sweep(kwargs, tmp_path)
    config = ac.Config(**kwargs)
    _, state, metrics = common.run_sweep(ac.make_agent(config), config, num_seeds=2)
    leaves = jax.tree.leaves(state.params) + jax.tree.leaves(state.value_params)
    assert len(leaves) == len(old_leaves) == 8
    for i, (got, want) in enumerate(zip(leaves, old_leaves)):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f'parameter leaf {i}')
    assert 'metrics/policy_loss' in old_metrics and 'metrics/value_loss' in old_metrics
    for name, want in old_metrics.items():  # NaN (epochs not evaluated) equals NaN
        np.testing.assert_array_equal(np.asarray(metrics[name]), want, err_msg=name)
    assert state.replay.valid.shape[1] == 1  # [runs, n_replay_epochs, ...]


def test_defaults_are_a_ppo_whose_ratio_moves(tmp_path, cache):
    """`python actor_critic.py`, one epoch: PPO's minibatch passes move the
    policy away from the collecting one, so the ratio leaves 1 (approx_kl > 0)
    and some steps are clipped."""
    out = str(tmp_path / 'defaults')
    metrics = ac.main(['--epochs', '1', '--output-dir', out, '--quiet', *cache])
    assert float(metrics['metrics/approx_kl'][0]) > 0
    assert float(metrics['metrics/clip_fraction'][0]) > 0
    assert json.load(open(os.path.join(out, 'config.json')))['policy_loss'] == 'ppo'


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit):
        ac.main(['--help'])
    out = capsys.readouterr().out
    for field in dataclasses.fields(ac.Config):
        assert '--' + field.name.replace('_', '-') in out
        assert field.metadata['help']
    assert '--awr-beta' in out and '--awr-max-weight' in out  # the names for Trax's
    assert 'Pendulum-v1: --policy-loss ppo' in out  # PPO's per-env settings
    with pytest.raises(SystemExit):  # and with awr, AWR's
        ac.main(['--policy-loss', 'awr', '--help'])
    out = capsys.readouterr().out
    assert 'CartPole-v1: --policy-loss awr --n-replay-epochs' in out
    assert 'Pendulum-v1: --policy-loss ppo' not in out  # (--epsilon acts with ppo only)


# ---------------------------------------------------------------------------
# --joint (Trax's ActorCriticJointAgent) and --shared-torso.
# ---------------------------------------------------------------------------


def np_mlp(layers, x):
    """An init_mlp network by hand: ReLU after each layer but the last."""
    for layer in layers[:-1]:
        x = np.maximum(x @ np.asarray(layer['w']) + np.asarray(layer['b']), 0.0)
    return x @ np.asarray(layers[-1]['w']) + np.asarray(layers[-1]['b'])


@pytest.mark.parametrize('shared', [False, True])
def test_joint_loss_by_hand(shared):
    """PPO's clipped objective on normalised advantages, minus 0.01 x the
    entropy, plus value_loss_coeff x the weighted L2 towards the targets; the
    value head's bias gradient is coeff x 2 mean_w(V - target)."""
    config = ac_config(joint=True, shared_torso=shared, policy_loss='ppo', hidden_sizes=(5,),
                       entropy_coeff=0.01, value_batch_size=ac.Config.value_batch_size,
                       value_train_steps_per_epoch=ac.Config.value_train_steps_per_epoch,
                       value_lr=ac.Config.value_lr)  # (refused under --joint, as by the CLI)
    agent = ac.make_agent(config)
    hp = {**single_hp(config), 'value_loss_coeff': jnp.float32(0.3)}
    state = agent.init(jax.random.PRNGKey(0), hp)
    nets = {'policy': state.params, 'value': state.value_params}
    rng = np.random.default_rng(1)
    n = 8
    batch = {'obs': rng.normal(size=(n, 2)).astype(np.float32),
             'action': rng.integers(0, agent.spec.policy.n_outputs, n).astype(np.int32),
             'adv': rng.normal(size=n).astype(np.float32) * 3,
             'old_log_probs': np.log(rng.uniform(0.2, 0.8, n)).astype(np.float32),
             'targets': rng.normal(size=n).astype(np.float32) * 2,
             'weight': np.array([1, 1, 0, 1, 1, 1, 1, 0], np.float32)}
    loss, metrics = ac.joint_objective(agent.spec, nets, jax.tree.map(jnp.asarray, batch), hp)

    w, a = batch['weight'], batch['adv']
    mean = lambda x: (w * x).sum() / w.sum()
    a = (a - mean(a)) / (np.sqrt(mean((a - mean(a)) ** 2)) + 1e-5)
    net = state.params['net']
    probs = softmax_np(np_mlp(net, batch['obs']))
    ratio = probs[np.arange(n), batch['action']] / np.exp(batch['old_log_probs'])
    objective = np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
    entropy = -(probs * np.log(probs)).sum(1)
    value_layers = net[:-1] + [state.value_params] if shared else state.value_params
    value = np_mlp(value_layers, batch['obs'])[:, 0]
    l2 = mean((value - batch['targets']) ** 2)
    assert float(metrics['metrics/value_loss']) == pytest.approx(l2, rel=1e-5)
    assert float(loss) == pytest.approx(-mean(objective) - 0.01 * mean(entropy) + 0.3 * l2,
                                        rel=1e-5)
    grads = jax.grad(lambda nets: ac.joint_objective(
        agent.spec, nets, jax.tree.map(jnp.asarray, batch), hp)[0])(nets)
    head = grads['value'] if shared else grads['value'][-1]
    assert float(head['b'][0]) == pytest.approx(0.3 * 2 * mean(value - batch['targets']),
                                                rel=1e-4)


@pytest.mark.parametrize('shared', [False, True])
def test_joint_with_value_loss_coeff_0_trains_the_policy_as_the_policy_loss_alone(shared):
    """An epoch of --joint minibatch steps at --value-loss-coeff 0 gives the
    policy bitwise the parameters the policy loss alone gives (the policy
    trainer of the separate networks, on the same advantages), and leaves
    the value network (with a shared torso, the value head) untouched."""
    small = dict(n_envs=4, n_interactions_per_epoch=64, train_steps_per_epoch=8, batch_size=16,
                 hidden_sizes=(8,))
    joint = ac.Config(**small, joint=True, shared_torso=shared, value_loss_coeff=0.0)
    alone = ac.Config(**small)
    agent_j, agent_a = ac.make_agent(joint), ac.make_agent(alone)
    hp_j, hp_a = single_hp(joint), single_hp(alone)
    state, _ = agent_j.collect(hp_j, agent_j.init(jax.random.PRNGKey(0), hp_j))
    value_view = ac.value_network(agent_j.spec, state.params, state.value_params)
    state_a = agent_a.init(jax.random.PRNGKey(0), hp_a)._replace(
        params=state.params, value_params=value_view, replay=state.replay, key=state.key)
    key = jax.random.PRNGKey(5)
    new_j, _ = jax.jit(functools.partial(ac.policy_chunks, agent_j.spec))(hp_j, state, key)
    new_a, _ = jax.jit(functools.partial(ac.policy_chunks, agent_a.spec))(hp_a, state_a, key)
    chex_leaves = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]
    for got, want in zip(chex_leaves(new_j.params), chex_leaves(new_a.params)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(chex_leaves(new_j.value_params), chex_leaves(state.value_params)):
        np.testing.assert_array_equal(got, want)
    assert int(new_j.train_step) == 8


# --- PureJaxRL's PPO pieces as options (issue 52, item 1) ------------------

def test_the_clipped_value_loss_is_its_formula():
    rng = np.random.default_rng(0)
    v, old, target = (rng.normal(size=64).astype(np.float32) for _ in range(3))
    weight = (rng.random(64) > 0.2).astype(np.float32)
    eps = 0.2
    clipped = old + np.clip(v - old, -eps, eps)
    want = np.sum(weight * np.maximum((v - target) ** 2, (clipped - target) ** 2)) / weight.sum()
    got = ac.value_loss(jnp.asarray(v), jnp.asarray(target), jnp.asarray(weight),
                        jnp.asarray(old), eps)
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    grad = jax.grad(lambda p: ac.value_loss(p, jnp.asarray(target), jnp.asarray(weight),
                                            jnp.asarray(old), eps))(jnp.asarray(v))
    # Where the clipped term is the larger and V moved past the clip, no gradient.
    flat = (np.abs(v - old) > eps) & ((clipped - target) ** 2 > (v - target) ** 2)
    assert flat.any() and np.all(np.asarray(grad)[flat] == 0)
    unclipped = ac.value_loss(jnp.asarray(v), jnp.asarray(target), jnp.asarray(weight))
    np.testing.assert_allclose(float(unclipped), np.sum(weight * (v - target) ** 2)
                               / weight.sum(), rtol=1e-6)


def test_orthogonal_init_has_purejaxrls_gains_and_tanh_is_the_nonlinearity():
    config = ac.Config(init='orthogonal', activation='tanh', hidden_sizes=(64, 64))
    agent = ac.make_agent(config)
    hp = common.hyperparameters(config, common.expand_runs(config, {}, 0, 1))
    state = agent.init(jax.random.PRNGKey(0), jax.tree.map(lambda x: x[0], hp))
    policy, value = state.params['net'], state.value_params
    for layers, head in ((policy, 0.01), (value, 1.0)):
        for layer, gain in zip(layers, (np.sqrt(2), np.sqrt(2), head)):
            w = np.asarray(layer['w'], np.float64)
            gram = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T
            np.testing.assert_allclose(gram, gain ** 2 * np.eye(len(gram)), atol=1e-5)
            assert not np.any(np.asarray(layer['b']))
    obs = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    x = np.asarray(obs, np.float64)
    for layer in policy[:-1]:
        x = np.tanh(x @ np.asarray(layer['w'], np.float64) + np.asarray(layer['b']))
    np.testing.assert_allclose(np.asarray(policies.features_of(agent.spec.policy, policy, obs)),
                               x, atol=1e-5)


def test_purejaxrls_pieces_train_joint_and_separate():
    for joint in (True, False):
        config = ac.Config(epochs=3, joint=joint, activation='tanh', init='orthogonal',
                           clip_value_loss=True, hidden_sizes=(16,), n_eval_episodes=2)
        _, _, metrics = common.run_sweep(ac.make_agent(config), config, num_seeds=2)
        assert np.all(np.isfinite(metrics['metrics/value_loss']))


# --- --joint's own settings (issue 52, item 2) ------------------------------

@pytest.mark.parametrize('shared', [False, True])
def test_joint_brings_purejaxrls_config_and_a_typed_flag_wins(shared, monkeypatch):
    from harness import cli
    captured = {}
    monkeypatch.setattr(cli, 'run_experiment', lambda make_agent, config, grid, args, prog,
                        agent=None: captured.update(config=config))
    argv = ['--joint', *(['--shared-torso'] if shared else []), '--lr', '1e-3', '--quiet']
    ac.main(argv)
    config = captured['config']
    want = {**ac.JOINT_SETTINGS['CartPole-v1'], 'lr': 1e-3}
    assert {name: getattr(config, name) for name in want} == want
    assert config.joint and config.shared_torso == shared
    assert not set(want) & set(ac.VALUE_ONLY)  # the value trainer's own: none under --joint
    ac.main(['--joint', '--policy-loss', 'a2c', '--quiet'])  # a mode's own, never PPO's
    assert captured['config'].epochs == ac.A2C_SETTINGS['epochs']
    ac.main(['--quiet'])  # without --joint: the defaults
    assert captured['config'].n_envs == ac.Config.n_envs


def test_joint_help_shows_its_settings(capsys):
    with pytest.raises(SystemExit):
        ac.main(['--joint', '--help'])
    out = ' '.join(capsys.readouterr().out.split())
    assert ('CartPole-v1: ' + fields.settings_flags(ac.JOINT_SETTINGS['CartPole-v1'])) in out
