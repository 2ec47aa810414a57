"""pg.py: REINFORCE pieces against hand computations, with and without jit
(chex.variants), and their chex contracts (a wrong-shaped call fails naming the
argument); probe environments with a known best action, the cut-off rule of
n_interactions mode, seeds, determinism, CartPole-v1 learning and one epoch on
every registered gymnax env."""

import json
import os
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import struct
import gymnax
from gymnax.environments import environment, spaces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import policies  # noqa: E402
from harness import rundir  # noqa: E402
import pg  # noqa: E402
import probe_envs  # noqa: E402
from contracts import assert_contracts_trace_to_nothing  # noqa: E402

# The gymnax envs before this file registers its probes.
GYMNAX_ENVS = [name for name in gymnax.registered_envs
               if not name.startswith('PgProbe') and not name.endswith('-test')]


# ---------------------------------------------------------------------------
# Probe environments (gymnax-style), registered under PgProbe-* names.
# ---------------------------------------------------------------------------


@struct.dataclass
class ProbeState(environment.EnvState):
    time: int
    target: jax.Array


@struct.dataclass
class ProbeParams(environment.EnvParams):
    max_steps_in_episode: int = 1


class OneStep(environment.Environment):
    """Constant observation, 3 actions, one step; action 2 pays 1, others 0."""

    @property
    def default_params(self):
        return ProbeParams()

    def step_env(self, key, state, action, params):
        reward = (action == 2).astype(jnp.float32)
        state = state.replace(time=state.time + 1)
        return self.get_obs(state), state, reward, jnp.array(True), {}

    def reset_env(self, key, params):
        state = ProbeState(time=0, target=jnp.int32(0))
        return self.get_obs(state), state

    def get_obs(self, state, params=None, key=None):
        return jnp.ones(2)

    def is_terminated(self, state, params):
        return jnp.array(True)

    def action_space(self, params=None):
        return spaces.Discrete(3)

    def observation_space(self, params):
        return spaces.Box(0.0, 1.0, (2,), jnp.float32)


class Match(OneStep):
    """One step; the observation one-hot encodes a random target in {0, 1}, and
    choosing that action pays 1 (the best action depends on the observation)."""

    def step_env(self, key, state, action, params):
        reward = (action == state.target).astype(jnp.float32)
        return self.get_obs(state), state.replace(time=state.time + 1), reward, \
            jnp.array(True), {}

    def reset_env(self, key, params):
        state = ProbeState(time=0, target=jax.random.bernoulli(key).astype(jnp.int32))
        return self.get_obs(state), state

    def get_obs(self, state, params=None, key=None):
        return jax.nn.one_hot(state.target, 2)

    def action_space(self, params=None):
        return spaces.Discrete(2)


class Countdown(OneStep):
    """Episodes of exactly 5 steps (terminated, not truncated); step t (0-based)
    pays t + 1, so each step's return identifies it. The time limit is 100."""
    length = 5

    @property
    def default_params(self):
        return ProbeParams(max_steps_in_episode=100)

    def step_env(self, key, state, action, params):
        state = state.replace(time=state.time + 1)
        reward = state.time.astype(jnp.float32)
        return self.get_obs(state), state, reward, state.time >= self.length, {}

    def get_obs(self, state, params=None, key=None):
        return jnp.array([state.time / self.length, 1.0])

    def is_terminated(self, state, params):
        return state.time >= self.length

    def action_space(self, params=None):
        return spaces.Discrete(2)


class BoxTarget(OneStep):
    """One step, a Box(-1, 1) action; reward -(a - 0.5)^2 of the action the env gets."""

    def step_env(self, key, state, action, params):
        reward = self.reward(action)
        return self.get_obs(state), state.replace(time=state.time + 1), reward, \
            jnp.array(True), {}

    def reward(self, action):
        return -jnp.sum((action - 0.5) ** 2)

    def action_space(self, params=None):
        return spaces.Box(-1.0, 1.0, (1,), jnp.float32)


class BoxEcho(BoxTarget):
    """The reward is the action the env received, so clipping is visible."""

    def reward(self, action):
        return jnp.sum(action)


class CountdownOneHot(Countdown):
    """Countdown observing its time step one-hot, so that a linear value
    network can represent V exactly."""

    def get_obs(self, state, params=None, key=None):
        return jax.nn.one_hot(state.time, 6)

    def observation_space(self, params):
        return spaces.Box(0.0, 1.0, (6,), jnp.float32)


class Endless(OneStep):
    """Reward 1 every step, a constant observation, never terminates: only the
    time limit (5) ends an episode. Its discounted value is 1 / (1 - gamma)."""

    @property
    def default_params(self):
        return ProbeParams(max_steps_in_episode=5)

    def step_env(self, key, state, action, params):
        state = state.replace(time=state.time + 1)
        return self.get_obs(state), state, jnp.float32(1.0), jnp.array(False), {}

    def is_terminated(self, state, params):
        return jnp.array(False)

    def action_space(self, params=None):
        return spaces.Discrete(2)


PROBES = {'PgProbe-OneStep': OneStep, 'PgProbe-Match': Match, 'PgProbe-Countdown': Countdown,
          'PgProbe-BoxTarget': BoxTarget, 'PgProbe-BoxEcho': BoxEcho, 'PgProbe-Endless': Endless,
          'PgProbe-CountdownOneHot': CountdownOneHot}
for _name, _factory in PROBES.items():
    if _name not in gymnax.registered_envs:
        gymnax.registration.register(_name, _factory)


# Small programs: compiling dominates their run time, so compile them for speed
# of compiling (unoptimised code is fine for a few tiny epochs).
FAST_COMPILE = {'xla_backend_optimization_level': 0, 'xla_cpu_use_fusion_emitters': False}


def run_phases(config, seeds=(0,), epochs=1, hp=None):
    """Drive make_agent's phases with jit(vmap) over seeds, as the driver does
    (the make_agent of the config's module: pg.py or actor_critic.py)."""
    agent = sys.modules[type(config).__module__].make_agent(config)
    runs = common.expand_runs(config, {}, seeds[0], len(seeds))
    hp = common.hyperparameters(config, runs) if hp is None else hp
    keys = jnp.stack([jax.random.PRNGKey(seed) for seed in seeds])
    state = jax.jit(jax.vmap(agent.init)).lower(keys, hp).compile(FAST_COMPILE)(keys, hp)
    phases = {name: jax.jit(jax.vmap(getattr(agent, name))).lower(hp, state).compile(FAST_COMPILE)
              for name in ('collect', 'train', 'evaluate')}
    history = []
    for _ in range(epochs):
        metrics = {}
        for name in ('collect', 'train', 'evaluate'):
            state, m = phases[name](hp, state)
            metrics.update(m)
        history.append(jax.device_get(metrics))
    return agent, state, history, phases, hp


def probe_config(env, **overrides):
    values = dict(env=env, epochs=30, n_trajectories_per_epoch=16, hidden_sizes=(16,),
                  lr=0.05, lr_schedule='constant', n_eval_episodes=16)
    values.update(overrides)
    return pg.Config(**values)


# ---------------------------------------------------------------------------
# The loss and its pieces.
# ---------------------------------------------------------------------------


def test_train_step_follows_the_reinforce_gradient():
    """The agent's train phase on a hand-made batch: with Adam (b1 0, bias
    corrected) the first update is -lr * g / (|g| + eps), g the hand gradient of
    -(1/N) sum A_hat log pi with normalised advantages."""
    config = pg.Config(env='PgProbe-Match', epochs=1, n_trajectories_per_epoch=4,
                       hidden_sizes=(), lr=0.01, lr_schedule='constant',
                       normalize_advantages=True, n_eval_episodes=0)
    agent = pg.make_agent(config)
    hp = {name: jnp.asarray(value, jnp.float32)
          for name, value in common.expand_runs(config, {}, 0, 1)[0].items() if name != 'seed'}
    state = agent.init(jax.random.PRNGKey(0), hp)
    obs = jnp.asarray([[1., 0.], [0., 1.], [0., 1.], [1., 0.]])
    action = jnp.asarray([0, 0, 1, 1])
    returns = jnp.asarray([1.0, 0.0, 1.0, 0.0])
    batch = pg.Batch(obs=obs, action=action, returns=returns, weight=jnp.ones(4),
                     episode_length=state.batch.episode_length, reset=state.batch.reset)
    net = [{'w': jnp.asarray([[1.0, -0.5], [0.3, 0.8]]), 'b': jnp.asarray([0.1, -0.2])}]
    state = state._replace(batch=batch, params={'net': net})
    new_state, metrics = agent.train(hp, state)

    w = np.asarray(state.params['net'][0]['w'])
    b = np.asarray(state.params['net'][0]['b'])
    logits = np.asarray(obs) @ w + b
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    adv = np.asarray(returns) - 0.5
    adv = (adv - adv.mean()) / (adv.std() + 1e-5)
    dlogits = -(adv / 4)[:, None] * (np.eye(2)[np.asarray(action)] - probs)
    grad_w = np.asarray(obs).T @ dlogits
    expected = w - 0.01 * grad_w / (np.abs(grad_w) + 1e-8)
    np.testing.assert_allclose(new_state.params['net'][0]['w'], expected, rtol=1e-4, atol=1e-6)
    assert int(new_state.train_step) == 1 and int(new_state.epoch) == 1
    log_p = np.log(probs[np.arange(4), np.asarray(action)])
    np.testing.assert_allclose(metrics['metrics/policy_loss'], -(adv * log_p).mean(), rtol=1e-5)


class PiecesTest(chex.TestCase):
    """The loss and its pieces, each with and without jit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_loss_gradient_equals_hand_computed_reinforce_gradient(self):
        # A linear softmax policy logits = x W + b (an MLP with no hidden layer).
        rng = np.random.default_rng(0)
        n, d, k = 7, 3, 4
        x = rng.normal(size=(n, d)).astype(np.float32)
        actions = rng.integers(0, k, size=n)
        returns = rng.normal(size=n).astype(np.float32) * 3
        weight = np.array([1, 1, 0, 1, 1, 0, 1], np.float32)
        params = common.init_mlp(jax.random.PRNGKey(1), [d, k], last_scale=1.0)
        params[0]['b'] = jnp.asarray(rng.normal(size=k), jnp.float32)

        def loss(params):
            adv, _ = pg.advantages(jnp.asarray(returns), jnp.asarray(weight), normalize=False)
            log_probs = policies.categorical_log_prob(common.mlp(params, x), jnp.asarray(actions))
            return pg.reinforce_loss(log_probs, adv, jnp.asarray(weight))

        grads = self.variant(jax.grad(loss))(params)[0]
        # By hand: dL/dlogits_i = -(w_i / sum w) A_i (onehot(a_i) - softmax_i), A = G - mean G.
        w_np, b_np = np.asarray(params[0]['w']), np.asarray(params[0]['b'])
        logits = x @ w_np + b_np
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        adv = returns - (returns * weight).sum() / weight.sum()
        dlogits = -(weight * adv / weight.sum())[:, None] * (np.eye(k)[actions] - probs)
        np.testing.assert_allclose(grads['w'], x.T @ dlogits, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grads['b'], dlogits.sum(0), rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_categorical_log_prob_entropy_and_temperature(self):
        logits = jnp.asarray([[2.0, 0.5, -1.0], [0.0, 0.0, 3.0]])
        probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        np.testing.assert_allclose(
            self.variant(policies.categorical_log_prob)(logits, jnp.asarray([1, 2])),
            np.log([probs[0, 1], probs[1, 2]]), rtol=1e-6)
        np.testing.assert_allclose(self.variant(policies.categorical_entropy)(logits),
                                   -(probs * np.log(probs)).sum(1), rtol=1e-6)
        noise = jax.random.gumbel(jax.random.PRNGKey(0), (40000, 3))
        many = jnp.broadcast_to(logits[0], noise.shape)  # noise has the logits' shape
        sample = self.variant(policies.categorical_sample, static_argnums=2)
        # T = 0: argmax, whatever the noise.
        np.testing.assert_array_equal(sample(noise, many, 0.0), 0)
        # T > 0: the frequencies of softmax(logits / T).
        for temperature in (1.0, 0.5, 2.0):
            samples = np.asarray(sample(noise, many, temperature))
            target = np.exp(logits[0] / temperature)
            target = target / target.sum()
            np.testing.assert_allclose(np.bincount(samples, minlength=3) / len(samples), target,
                                       atol=0.01)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gaussian_log_prob_entropy_and_temperature(self):
        mean = jnp.asarray([0.5, -1.0])
        log_std = jnp.asarray([0.0, np.log(0.3)])
        action = jnp.asarray([1.5, -0.4])
        std = np.exp(np.asarray(log_std))
        expected = np.sum(-0.5 * ((np.asarray(action) - mean) / std) ** 2 - np.log(std)
                          - 0.5 * np.log(2 * np.pi))
        np.testing.assert_allclose(self.variant(policies.gaussian_log_prob)(mean, log_std, action),
                                   expected, rtol=1e-6)
        np.testing.assert_allclose(self.variant(policies.gaussian_entropy)(log_std),
                                   np.sum(0.5 * np.log(2 * np.pi * np.e * std ** 2)), rtol=1e-6)
        noise = jax.random.normal(jax.random.PRNGKey(0), (40000, 2))
        means, log_stds = (jnp.broadcast_to(x, noise.shape) for x in (mean, log_std))
        sample = self.variant(policies.gaussian_sample, static_argnums=3)
        np.testing.assert_array_equal(sample(noise, means, log_stds, 0.0), means)
        for temperature in (1.0, 0.5):
            samples = np.asarray(sample(noise, means, log_stds, temperature))
            np.testing.assert_allclose(samples.mean(0), mean, atol=0.02)
            np.testing.assert_allclose(samples.std(0), temperature * std, rtol=0.03)

    @chex.variants(with_jit=True, without_jit=True)
    def test_baseline_is_the_mean_return_and_normalisation_ignores_padding(self):
        returns = jnp.asarray([3.0, 1.0, 2.0, 100.0, 6.0])
        weight = jnp.asarray([1.0, 1.0, 1.0, 0.0, 1.0])  # the 100 is padding
        advantages = self.variant(pg.advantages, static_argnums=2)
        adv, baseline = advantages(returns, weight, False)
        assert float(baseline) == pytest.approx(3.0)  # Trax's _value_fn: mean return
        np.testing.assert_allclose(adv, np.asarray(returns) - 3.0)
        adv, _ = advantages(returns, weight, True)
        valid = np.asarray(adv)[np.asarray(weight) > 0]
        raw = np.array([3.0, 1.0, 2.0, 6.0]) - 3.0
        np.testing.assert_allclose(valid, (raw - raw.mean()) / (raw.std() + 1e-5), rtol=1e-5)
        assert valid.mean() == pytest.approx(0.0, abs=1e-6)
        assert valid.std() == pytest.approx(1.0, abs=1e-4)

    @chex.variants(with_jit=True, without_jit=True)
    def test_episode_returns_match_a_loop_and_never_cross_episodes(self):
        rng = np.random.default_rng(3)
        rewards = rng.normal(size=(4, 9)).astype(np.float32)
        dones = rng.random((4, 9)) < 0.3
        valid = np.ones((4, 9), bool)
        valid[1, 6:] = False  # padding after an episode that ended at step 5
        dones[1, 5] = True
        gamma = 0.9
        expected = np.zeros_like(rewards)
        for row in range(4):
            future = 0.0
            for t in reversed(range(9)):
                if not valid[row, t]:
                    future = 0.0
                    continue
                future = rewards[row, t] + (0.0 if dones[row, t] else gamma * future)
                expected[row, t] = future
        episode_returns = self.variant(pg.episode_returns)
        got = episode_returns(jnp.asarray(rewards), jnp.asarray(dones), jnp.asarray(valid), gamma)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        # A truncated episode (done at the cap, no bootstrap): the discounted sum of
        # the rewards it observed.
        got = episode_returns(jnp.ones((1, 3)), jnp.asarray([[False, False, True]]),
                              jnp.ones((1, 3), bool), 0.5)
        np.testing.assert_allclose(got, [[1.75, 1.5, 1.0]])


class ContractTest(chex.TestCase):
    """A wrong-shaped call fails with chex's message naming the argument (with jit:
    while tracing) instead of broadcasting into a wrong result."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_episode_returns_names_the_wrong_argument(self):
        episode_returns = self.variant(pg.episode_returns)
        rows, length = 2, 5
        good = dict(rewards=jnp.ones((rows, length)), dones=jnp.zeros((rows, length), bool),
                    valid=jnp.ones((rows, length), bool), gamma=0.9)
        episode_returns(*good.values())
        for name in ('rewards', 'dones', 'valid'):  # one row without its batch axis
            with self.assertRaisesRegex(
                    AssertionError, rf'assert_rank failed: .*input 0 has rank 1 \(shape '
                                    rf'\(5,\)\) but expected 2\. \[argument `{name}` of '
                                    r'episode_returns\]'):
                episode_returns(*{**good, name: good[name][0]}.values())
        for name in ('dones', 'valid'):  # `~valid` of 0/1 integers is -1/-2
            with self.assertRaisesRegex(AssertionError, rf'assert_type.*\[argument `{name}` of'):
                episode_returns(*{**good, name: good[name].astype(jnp.float32)}.values())
        with self.assertRaisesRegex(AssertionError, r'\[argument `gamma` of episode_returns\]'):
            episode_returns(*{**good, 'gamma': jnp.full(rows, 0.9)}.values())
        with self.assertRaisesRegex(AssertionError, r'assert_equal_shape.*episode_returns'):
            episode_returns(*{**good, 'valid': good['valid'][:, :1]}.values())  # would broadcast

    @chex.variants(with_jit=True, without_jit=True)
    def test_distributions_name_the_wrong_argument(self):
        logits, action = jnp.zeros((6, 3)), jnp.zeros(6, jnp.int32)
        log_prob = self.variant(policies.categorical_log_prob)
        log_prob(logits, action)
        with self.assertRaisesRegex(AssertionError,
                                    r'\[argument `action` of categorical_log_prob\]'):
            log_prob(logits, action[:, None])  # [N, 1]
        with self.assertRaisesRegex(AssertionError, r'assert_type.*int.*\[argument `action` of'):
            log_prob(logits, action.astype(jnp.float32))
        with self.assertRaisesRegex(AssertionError,
                                    r'\[argument `logits` of categorical_entropy\]'):
            self.variant(policies.categorical_entropy)(jnp.zeros(()))
        with self.assertRaisesRegex(AssertionError, r'assert_equal_shape.*categorical_sample'):
            self.variant(policies.categorical_sample, static_argnums=2)(logits[:, :2], logits, 1.0)
        mean = jnp.zeros((6, 2))
        with self.assertRaisesRegex(AssertionError, r'assert_equal_shape.*gaussian_log_prob'):
            self.variant(policies.gaussian_log_prob)(mean, mean, mean[:, 0])  # [N] for [N, 1 or 2]
        with self.assertRaisesRegex(AssertionError, r'assert_equal_shape.*gaussian_sample'):
            self.variant(policies.gaussian_sample, static_argnums=3)(mean[:1], mean, mean, 1.0)
        with self.assertRaisesRegex(AssertionError,
                                    r'\[argument `log_std` of gaussian_entropy\]'):
            self.variant(policies.gaussian_entropy)(jnp.zeros(()))

    @chex.variants(with_jit=True, without_jit=True)
    def test_advantages_and_loss_name_the_wrong_argument(self):
        x = jnp.ones(8)
        advantages = self.variant(pg.advantages, static_argnums=2)
        with self.assertRaisesRegex(AssertionError, r'\[argument `weight` of advantages\]'):
            advantages(x, x[:, None], True)  # [N, 1]: the baseline would be over N * N
        with self.assertRaisesRegex(AssertionError, r'assert_equal_shape.*advantages'):
            advantages(x, x[1:], True)
        loss = self.variant(pg.reinforce_loss)
        with self.assertRaisesRegex(AssertionError, r'\[argument `adv` of reinforce_loss\]'):
            loss(x, x.reshape(2, 4), x)
        with self.assertRaisesRegex(AssertionError, r'assert_equal_shape.*reinforce_loss'):
            loss(x, x, x[1:])

    def test_contracts_add_nothing_to_the_traced_program(self):
        rows, length = 2, 5
        x, logits = jnp.ones(6), jnp.zeros((6, 3))
        for function, inputs in [
                (pg.episode_returns, (jnp.ones((rows, length)), jnp.zeros((rows, length), bool),
                                      jnp.ones((rows, length), bool), 0.9)),
                (policies.categorical_log_prob, (logits, jnp.zeros(6, jnp.int32))),
                (policies.categorical_entropy, (logits,)),
                (lambda *a: policies.categorical_sample(*a, 1.0), (logits, logits)),
                (policies.gaussian_log_prob, (logits, logits, logits)),
                (policies.gaussian_entropy, (logits,)),
                (lambda *a: policies.gaussian_sample(*a, 1.0), (logits, logits, logits)),
                (lambda *a: pg.advantages(*a, True), (x, x)),
                (pg.reinforce_loss, (x, x, x))]:
            assert_contracts_trace_to_nothing(function, *inputs)


# ---------------------------------------------------------------------------
# Collection: trajectories, clipping, the cut-off rule of interactions mode.
# ---------------------------------------------------------------------------


def test_trajectory_mode_collects_whole_episodes_and_masks_the_rest():
    config = pg.Config(env='PgProbe-Countdown', epochs=1, n_trajectories_per_epoch=3,
                       max_steps=8, gamma=1.0, hidden_sizes=(4,), n_eval_episodes=0)
    agent, state, (metrics,), _, _ = run_phases(config)
    batch = jax.tree.map(lambda x: np.asarray(x[0]), state.batch)
    returns = batch.returns.reshape(3, 8)
    weight = batch.weight.reshape(3, 8)
    np.testing.assert_array_equal(weight, [[1] * 5 + [0] * 3] * 3)
    np.testing.assert_allclose(returns[:, :5], [[15, 14, 12, 9, 5]] * 3)
    assert float(metrics['rl/avg_return'][0]) == 15.0
    assert int(metrics['rl/new_interactions'][0]) == 15
    assert int(metrics['rl/n_interactions'][0]) == 15
    assert int(metrics['rl/n_trajectories'][0]) == 3


def test_interactions_mode_an_unfinished_episode_waits_for_the_epoch_it_ends_in():
    """Cut-off rule: steps of an episode still running when the epoch's window
    closes are not trained on (their return is unknown); they are carried over
    and train, with their full Monte-Carlo return, in the epoch the episode ends.
    Countdown episodes last 5 steps; each epoch plays 3 steps per env."""
    config = pg.Config(env='PgProbe-Countdown', epochs=3, n_envs=2,
                       n_interactions_per_epoch=6, n_trajectories_per_epoch=None,
                       gamma=1.0, hidden_sizes=(4,), n_eval_episodes=0)
    agent, state, history, phases, hp = run_phases(config, epochs=0)

    def batch_rows(state):
        batch = jax.tree.map(lambda x: np.asarray(x[0]), state.batch)
        length = 100 + 3  # the env's time limit (the tail's room) + this epoch's steps
        return batch.returns.reshape(2, length), batch.weight.reshape(2, length)

    state, m1 = phases['collect'](hp, state)  # steps 1-3 of the first episodes
    returns, weight = batch_rows(state)
    assert weight.sum() == 0  # nothing finished: nothing to train on yet
    assert np.isnan(m1['rl/avg_return'][0]) and int(m1['rl/n_trajectories'][0]) == 0
    np.testing.assert_array_equal(np.asarray(state.tail.valid[0]).sum(1), [3, 3])
    state, _ = phases['train'](hp, state)

    state, m2 = phases['collect'](hp, state)  # steps 4-5 end them, step 1 of the next
    returns, weight = batch_rows(state)
    np.testing.assert_array_equal(weight.sum(1), [5, 5])
    # The 3 carried steps and the 2 new ones, with the whole episode's returns.
    np.testing.assert_allclose(returns[:, weight[0] > 0], [[15, 14, 12, 9, 5]] * 2)
    assert float(m2['rl/avg_return'][0]) == 15.0 and int(m2['rl/n_trajectories'][0]) == 2
    np.testing.assert_array_equal(np.asarray(state.tail.valid[0]).sum(1), [1, 1])
    assert int(m2['rl/n_interactions'][0]) == 12 and int(m2['rl/new_interactions'][0]) == 6
    state, _ = phases['train'](hp, state)

    state, m3 = phases['collect'](hp, state)  # steps 2-4 of the second episodes
    returns, weight = batch_rows(state)
    assert weight.sum() == 0
    np.testing.assert_array_equal(np.asarray(state.tail.valid[0]).sum(1), [4, 4])


def test_cut_at_last_done():
    done = jnp.asarray([[0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]], bool)
    valid = jnp.asarray([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
    finished, waiting = pg.cut_at_last_done(done, valid)
    np.testing.assert_array_equal(finished, [[0, 1, 1, 1, 1, 0], [0] * 6])
    np.testing.assert_array_equal(waiting, [[0, 0, 0, 0, 0, 1], [1] * 6])


def test_trax_batch_picks_a_trajectory_uniformly_then_a_step_uniformly():
    # Row 0: an episode of 1 step, then one of 3 steps, then padding; row 1: 2 steps.
    done = jnp.asarray([[1, 0, 0, 1, 0], [0, 1, 0, 0, 0]], bool)
    weight = jnp.asarray([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], jnp.float32)
    lengths = pg.segment_lengths(done, weight)
    np.testing.assert_array_equal(lengths * weight, [[1, 3, 3, 3, 0], [2, 2, 0, 0, 0]])
    index = pg.sample_slices(jax.random.PRNGKey(0), weight.reshape(-1),
                             lengths.reshape(-1), 60000)
    frequency = np.bincount(np.asarray(index), minlength=10) / 60000
    np.testing.assert_allclose(frequency, np.array([3, 1, 1, 1, 0, 1.5, 1.5, 0, 0, 0]) / 9,
                               atol=0.01)
    # The agent's sampled-batch mode trains on such slices.
    config = pg.Config(env='PgProbe-Countdown', epochs=1, n_trajectories_per_epoch=3,
                       max_steps=8, batch_size=16, hidden_sizes=(4,), n_eval_episodes=0)
    agent, state, (metrics,), _, _ = run_phases(config)
    np.testing.assert_allclose(state.batch.episode_length[0].reshape(3, 8)[:, :5], 5)
    assert np.isfinite(metrics['metrics/policy_loss'][0]) and int(state.train_step[0]) == 1
    # Countdown's returns are 15, 14, 12, 9, 5, all equally likely: mean 11.
    assert 8 < float(metrics['metrics/returns_mean'][0]) < 14


def test_box_actions_are_clipped_for_the_env_but_learned_unclipped():
    # A huge initial std: most sampled actions fall outside [-1, 1].
    config = pg.Config(env='PgProbe-BoxEcho', epochs=1, n_trajectories_per_epoch=64,
                       hidden_sizes=(4,), init_log_std=2.0, n_eval_episodes=0)
    agent, state, (metrics,), _, _ = run_phases(config)
    actions = np.asarray(state.batch.action[0, :, 0])
    rewards = np.asarray(state.batch.returns[0])  # one-step episodes: return = reward
    assert np.mean(np.abs(actions) > 1) > 0.5
    np.testing.assert_allclose(rewards, np.clip(actions, -1, 1), rtol=1e-6)


# ---------------------------------------------------------------------------
# Probe environments: the policy must find the known best action.
# ---------------------------------------------------------------------------


def test_one_step_probe_converges_to_the_better_action():
    config = probe_config('PgProbe-OneStep')
    agent, state, history, _, _ = run_phases(config, epochs=config.epochs)
    key = common.return_tag(0.0, 1)
    assert float(history[-1][key][0]) == 1.0
    assert float(history[0]['rl/avg_return'][0]) < 0.6  # it started near uniform
    logits = common.mlp(jax.tree.map(lambda x: x[0], state.params['net']), jnp.ones(2))
    assert float(jax.nn.softmax(logits)[2]) > 0.95


def test_observation_dependent_probe_converges_to_the_best_action_per_state():
    config = probe_config('PgProbe-Match', epochs=40)
    agent, state, history, _, _ = run_phases(config, epochs=config.epochs)
    assert float(history[-1][common.return_tag(0.0, 1)][0]) == 1.0
    net = jax.tree.map(lambda x: x[0], state.params['net'])
    probs = jax.nn.softmax(common.mlp(net, jnp.eye(2)), axis=-1)
    assert float(probs[0, 0]) > 0.9 and float(probs[1, 1]) > 0.9


def test_gaussian_probe_converges_to_the_best_continuous_action():
    config = probe_config('PgProbe-BoxTarget', epochs=60, n_trajectories_per_epoch=64,
                          init_log_std=-0.5)
    agent, state, history, _, _ = run_phases(config, epochs=config.epochs)
    net = jax.tree.map(lambda x: x[0], state.params['net'])
    mean = float(common.mlp(net, jnp.ones(2))[0])  # Box(-1, 1): centre 0, half-width 1
    assert mean == pytest.approx(0.5, abs=0.1)
    assert float(history[-1][common.return_tag(0.0, 1)][0]) > -0.01
    assert float(state.params['log_std'][0, 0]) < -0.5  # it grew more certain


# ---------------------------------------------------------------------------
# The CLI: seeds, determinism, learning, errors.
# ---------------------------------------------------------------------------

SMALL = ['--n-trajectories-per-epoch', '4', '--max-steps', '50', '--n-eval-episodes', '4',
         '--hidden-sizes', '16', '--quiet']


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
    """pg.main's persistent compile cache: a temp dir, not ~/.cache."""
    return ['--compile-cache', str(tmp_path_factory.mktemp('xla_cache'))]


def read_metrics(path):
    return [json.loads(line) for line in open(os.path.join(path, 'metrics.jsonl'))]


def checkpoint_params(path):
    header, leaves = rundir._read_checkpoint(os.path.join(path, 'checkpoint.npz'))
    return [leaf for name, leaf in zip(header['paths'], leaves) if name.startswith('.params')]


def test_num_seeds_give_different_trajectories_and_parameters(tmp_path, cache):
    out = str(tmp_path / 'seeds')
    pg.main(['--num-seeds', '3', '--epochs', '2', '--output-dir', out, *SMALL, *cache])
    records = read_metrics(out)
    assert sorted({r['seed'] for r in records}) == [0, 1, 2]
    epoch1 = [r for r in records if r['epoch'] == 1]
    assert len({r['rl/n_interactions'] for r in epoch1}) == 3  # different episodes
    for leaf in checkpoint_params(out):
        assert leaf.shape[0] == 3
        assert not np.allclose(leaf[0], leaf[1]) and not np.allclose(leaf[1], leaf[2])


def test_same_seed_and_flags_give_identical_results(tmp_path, cache):
    outs = [str(tmp_path / name) for name in ('a', 'b')]
    for out in outs:
        pg.main(['--seed', '5', '--epochs', '3', '--output-dir', out, *SMALL, *cache])
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith('timing/')
                              and k != 'rl/n_interactions_per_second'} for r in records]
    assert strip(read_metrics(outs[0])) == strip(read_metrics(outs[1]))
    chex.assert_trees_all_equal(checkpoint_params(outs[0]), checkpoint_params(outs[1]),
                                strict=True)


def test_defaults_solve_cartpole(tmp_path, cache):
    """`python pg.py --seed 0`: the default config reaches greedy >= 475 on CartPole-v1."""
    out = str(tmp_path / 'cartpole')
    metrics = pg.main(['--seed', '0', '--output-dir', out, '--quiet', *cache])
    key = common.return_tag(0.0, 500)
    assert float(metrics[key][0]) >= 475
    summary = json.load(open(os.path.join(out, 'summary.json')))
    assert summary['algorithm'] == 'pg' and summary['final_eval_key'] == key
    assert summary['final_eval_return'][0] >= 475
    records = read_metrics(out)
    evaluated = [record for record in records if key in record]
    assert evaluated[0][key] < 200  # it learned, it did not start there
    assert {'rl/avg_return', 'rl/n_interactions', 'rl/n_trajectories', 'metrics/policy_loss',
            'metrics/entropy', 'timing/epoch'} <= set(records[-1])


@pytest.mark.parametrize('argv, message', [
    (['--env', 'NoSuchEnv-v0'], 'CartPole-v1'),
    (['--n-interactions-per-epoch', '64'], 'exactly one of'),
    (['--n-trajectories-per-epoch', 'none'], 'exactly one of'),
    (['--gamma', '1.5'], '--gamma'),
    (['--lr', 'abc'], '--lr'),
    (['--adam-b2', '1'], '--adam-b2'),
])
def test_bad_input_exits_2_with_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pg.main([*argv, '--output-dir', str(tmp_path / 'bad'), '--quiet'])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_a2c_and_ppo_point_to_actor_critic(tmp_path, capsys):
    """pg.py is REINFORCE only: --policy-loss a2c or ppo exits 2, one line
    naming actor_critic.py, before anything is compiled or written."""
    for loss in ('a2c', 'ppo'):
        out = tmp_path / loss
        with pytest.raises(SystemExit) as exit_info:
            pg.main(['--policy-loss', loss, '--output-dir', str(out), '--quiet'])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and 'actor_critic.py' in err, err
        assert not out.exists()
    with pytest.raises(common.UsageError, match='actor_critic.py'):
        pg.make_agent(pg.Config(policy_loss='ppo'))


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit):
        pg.main(['--help'])
    out = capsys.readouterr().out
    import dataclasses
    for field in dataclasses.fields(pg.Config):
        assert '--' + field.name.replace('_', '-') in out
        assert field.metadata['help']


def test_gru_brings_its_cartpole_settings_and_a_typed_flag_wins(monkeypatch):
    """--torso gru on CartPole-v1 takes GRU_SETTINGS (a flag typed wins); the
    MLP keeps the defaults, and so does the GRU on another env."""
    from harness import cli
    captured = {}
    monkeypatch.setattr(cli, 'run_experiment', lambda make_agent, config, grid, args, prog,
                        agent=None: captured.update(config=config))
    pg.main(['--torso', 'gru', '--quiet'])
    want = pg.GRU_SETTINGS['CartPole-v1']
    assert {name: getattr(captured['config'], name) for name in want} == want
    assert want['epochs'] != pg.Config.epochs and want['lr'] != pg.Config.lr
    pg.main(['--torso', 'gru', '--lr', '1e-3', '--quiet'])
    assert (captured['config'].lr, captured['config'].epochs) == (1e-3, want['epochs'])
    pg.main(['--quiet'])
    assert (captured['config'].lr, captured['config'].epochs) == (pg.Config.lr, pg.Config.epochs)
    pg.main(['--torso', 'gru', '--env', 'Acrobot-v1', '--quiet'])
    assert captured['config'].epochs == pg.Config.epochs


def test_gru_settings_reach_the_plain_command_line_and_help(monkeypatch, capsys):
    """Without harness/ (a copy) the same table applies, and --help lists it."""
    import fields
    captured = {}
    monkeypatch.setattr(fields, 'plain_run', lambda agent, config, grid, seed, num_seeds,
                        output_dir: captured.update(config=config))
    fields.plain_main(pg.Config, pg.make_agent, pg.settings_table, ['--torso', 'gru'])
    assert captured['config'].epochs == pg.GRU_SETTINGS['CartPole-v1']['epochs']
    with pytest.raises(SystemExit):
        pg.main(['--torso', 'gru', '--help'])
    out = ' '.join(capsys.readouterr().out.split())
    assert 'CartPole-v1: ' + fields.settings_flags(pg.GRU_SETTINGS['CartPole-v1']) in out


# ---------------------------------------------------------------------------
# One epoch on every registered gymnax env.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('env_name', GYMNAX_ENVS)
def test_one_epoch_on_every_gymnax_env(env_name):
    config = pg.Config(env=env_name, epochs=1, n_trajectories_per_epoch=2, max_steps=8,
                       hidden_sizes=(8,), n_eval_episodes=2, eval_steps=(8,))
    try:
        agent = pg.make_agent(config)
    except common.UsageError as error:
        if env_name == 'MNISTBandit-bsuite':
            pytest.skip(f'MNISTBandit-bsuite downloads its data: {error}')
        raise
    hp = common.hyperparameters(config, common.expand_runs(config, {}, 0, 1))

    def epoch(keys, hp):
        return jax.vmap(agent.epoch)(hp, jax.vmap(agent.init)(keys, hp))

    keys = jax.random.PRNGKey(0)[None]
    program = jax.jit(epoch).lower(keys, hp).compile(FAST_COMPILE)
    state, metrics = program(keys, hp)
    assert 1 <= int(metrics['rl/new_interactions'][0]) <= 16
    assert int(metrics['rl/n_trajectories'][0]) == 2
    assert np.isfinite(float(metrics['metrics/policy_loss'][0]))
    assert np.isfinite(float(metrics[common.return_tag(0.0, 8)][0]))
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(state.params))
    assert int(state.train_step[0]) == 1


# ---------------------------------------------------------------------------
# The policies (common.py's, pg.py's spec): gSDE, observation bounds, conv torso.
# ---------------------------------------------------------------------------


def first_run(tree):
    return jax.tree.map(lambda x: x[0], tree)


def numpy_hidden(net, obs):
    """The policy MLP's last hidden features, in numpy."""
    x = np.asarray(obs, np.float64)
    for layer in net[:-1]:
        x = np.maximum(x @ np.asarray(layer['w'], np.float64) + np.asarray(layer['b']), 0.0)
    return x


def test_sde_policy_is_the_gaussian_of_features_times_random_weights():
    """gSDE: action = mean + features @ (exp(log_std) * z), z ~ N(0, 1) per
    weight, so given the state it is N(mean, features^2 @ exp(2 log_std)); the
    log-prob uses that variance, and no gradient reaches the network through it."""
    config = pg.Config(env='PgProbe-BoxTarget', hidden_sizes=(5, 3), n_eval_episodes=0,
                       state_dependent_exploration=True)
    agent = pg.make_agent(config)
    hp = {name: jnp.asarray(value, jnp.float32) for name, value
          in common.expand_runs(config, {}, 0, 1)[0].items() if name != 'seed'}
    state = agent.init(jax.random.PRNGKey(0), hp)
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    params = dict(state.params, log_std=0.3 * jax.random.normal(keys[0], (3, 1)))
    assert state.params['log_std'].shape == (3, 1)  # one per feature x action
    obs = jax.random.normal(keys[1], (4, 2))
    features = numpy_hidden(params['net'], obs)
    last = params['net'][-1]
    mean = features @ np.asarray(last['w'], np.float64) + np.asarray(last['b'])
    variance = features ** 2 @ np.exp(2 * np.asarray(params['log_std'], np.float64))
    got_mean, got_log_std = policies.policy(agent.spec.policy, params, obs)
    np.testing.assert_allclose(got_mean, mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.exp(2 * got_log_std), variance + policies.SDE_VARIANCE_FLOOR,
                               rtol=1e-5)
    z = jax.random.normal(keys[2], (4, 3, 1))
    action, env_action = policies.act(agent.spec.policy, z, params, obs, 1.0)
    expected = mean + np.einsum('nf,nfa->na', features,
                                np.exp(np.asarray(params['log_std'], np.float64)) * z)
    np.testing.assert_allclose(action, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(env_action, np.clip(expected, -1, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(policies.act(agent.spec.policy, z, params, obs, 0.0)[0], mean, rtol=1e-5, atol=1e-7)
    grads = jax.grad(lambda p: policies.policy(agent.spec.policy, p, obs)[1].sum())(params)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads['net']))
    assert float(jnp.abs(grads['log_std']).max()) > 0


def test_observation_bounds_and_normalisation():
    env, env_params = common.make_env('MountainCarContinuous-v0')
    centre, half = policies.observation_bounds(env.observation_space(env_params), (2,))
    np.testing.assert_allclose(centre, [-0.3, 0.0], atol=1e-6)
    np.testing.assert_allclose(half, [0.9, 0.07], rtol=1e-6)
    # CartPole's velocities are unbounded (float32's largest value): left as they are.
    env, env_params = common.make_env('CartPole-v1')
    centre, half = policies.observation_bounds(env.observation_space(env_params), (4,))
    np.testing.assert_allclose(centre, np.zeros(4))
    np.testing.assert_allclose(half, [4.8, 1.0, 0.41887903, 1.0], rtol=1e-6)
    agent = pg.make_agent(pg.Config(env='MountainCarContinuous-v0', normalize_observations=True))
    np.testing.assert_allclose(policies.observe(agent.spec.policy, jnp.array([[-1.2, -0.07], [0.6, 0.07]])),
                               [[-1, -1], [1, 1]], atol=1e-6)
    plain = pg.make_agent(pg.Config(env='MountainCarContinuous-v0'))
    np.testing.assert_array_equal(policies.observe(plain.spec.policy, jnp.array([0.6, 0.07])),
                                  np.float32([0.6, 0.07]))


def test_policy_learns_the_image_probe_through_the_conv_torso():
    """REINFORCE with --torso auto on 5x5x2 images: conv for the policy, which
    must name the lit channel wherever the cell is."""
    probe_envs.register()
    config = probe_config(probe_envs.IMAGE_CHANNEL_PROBE, epochs=40, n_trajectories_per_epoch=32,
                          conv_channels=(4,), lr=0.02, n_eval_episodes=64)
    agent, state, history, _, _ = run_phases(config, epochs=config.epochs)
    net = first_run(state.params['net'])
    assert set(net) == {'conv', 'mlp'} and net['conv'][0]['w'].shape == (3, 3, 2, 4)
    assert float(history[-1][common.return_tag(*agent.eval_tags[0])][0]) == 1.0
    cells = jnp.arange(25)
    obs = jnp.concatenate([jax.vmap(probe_envs.image_observation, (0, None))(cells, 1.0),
                           jax.vmap(probe_envs.image_observation, (0, None))(cells, -1.0)])
    logits = np.asarray(policies.policy(agent.spec.policy, first_run(state.params), obs))
    np.testing.assert_array_equal(np.argmax(logits, -1), [0] * 25 + [1] * 25)
