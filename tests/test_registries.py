"""Extension points are data (issue 36): dqn.TARGETS and
actor_critic.POLICY_OBJECTIVES map a flag's value to a pure function. The two
examples of docs/dqn.md (Munchausen-DQN) and docs/actor_critic.md (a KL
penalty) are run here as written there, each added with one function and one
entry: the flag takes the new value, --help lists it, the function computes
its formula, and a short run trains with it.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import actor_critic as ac  # noqa: E402
import common  # noqa: E402
import fields  # noqa: E402
import dqn  # noqa: E402
from harness import flags  # noqa: E402

SMALL = {
    dqn: ['--n-envs', '4', '--n-interactions-per-epoch', '64', '--train-steps-per-epoch', '16',
          '--batch-size', '32', '--n-replay-epochs', '2', '--hidden-sizes', '16',
          '--n-eval-episodes', '2', '--eval-steps', '40', '--epochs', '2'],
    ac: ['--n-envs', '4', '--n-interactions-per-epoch', '64', '--batch-size', '16',
         '--value-batch-size', '16', '--train-steps-per-epoch', '4',
         '--value-train-steps-per-epoch', '4', '--n-eval-episodes', '2', '--eval-steps', '40',
         '--hidden-sizes', '16', '--epochs', '2'],
}


def docs_example(name, heading):
    """The python block under `heading` in docs/`name`."""
    text = open(os.path.join(ROOT, 'docs', name)).read()
    return text[text.index(heading):].split('```python\n', 1)[1].split('```', 1)[0]


@pytest.fixture
def added(request):
    """Run a docs example in its module's namespace, as if pasted into the
    file; remove what it added afterwards."""
    module, registry, name, doc, heading = request.param
    before = set(vars(module))
    exec(docs_example(doc, heading), vars(module))
    yield module, getattr(module, registry)[name]
    getattr(module, registry).pop(name)
    for new in set(vars(module)) - before:
        delattr(module, new)


def short_run(module, argv):
    """The flags as both command lines parse them -> common.run_sweep's metrics."""
    typed, _ = fields.parse_flags(module.Config, argv)
    config, grid = fields.config_and_grid(module.Config, typed)
    _, state, metrics = common.run_sweep(module.make_agent(config), config, num_seeds=2)
    return config, metrics


MUNCHAUSEN = (dqn, 'TARGETS', 'munchausen', 'dqn.md', '## Adding a target: Munchausen')
KL = (ac, 'POLICY_OBJECTIVES', 'ppo_kl', 'actor_critic.md', '## Adding a policy objective')


@pytest.mark.parametrize('added', [MUNCHAUSEN], indirect=True)
def test_munchausen_target_is_its_formula_and_trains(added):
    module, target = added
    config, metrics = short_run(dqn, [*SMALL[dqn], '--advantage-estimator', 'munchausen',
                                      '--max-slice-length', '2'])
    assert config.advantage_estimator == 'munchausen'
    assert np.all(np.isfinite(metrics['metrics/value_loss']))
    parser = flags.build_parser(dqn.Config, 'dqn.py', '')
    assert 'munchausen' in parser.format_help()

    agent = dqn.make_agent(config)
    hp = {name: jnp.float32(getattr(config, name)) for name in common.sweep_fields(config)}
    params = agent.init(jax.random.PRNGKey(0), hp).params
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    batch = {'obs': jax.random.normal(keys[0], (5, 4)), 'action': jnp.arange(5) % 2,
             'bootstrap_obs': jax.random.normal(keys[1], (5, 4)),
             'reward_sum': jnp.linspace(0.0, 1.0, 5),
             'bootstrap_discount': jnp.asarray([0.99, 0.0, 0.99, 0.99, 0.5])}
    tau, alpha = 0.03, 0.9
    q = np.asarray(dqn.q_values(agent.spec, params, batch['obs'], hp), np.float64)
    q_next = np.asarray(dqn.q_values(agent.spec, params, batch['bootstrap_obs'], hp), np.float64)

    def log_softmax(x):
        x = x / tau
        return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(
            -1, keepdims=True))
    pi_next = np.exp(log_softmax(q_next))
    soft = (pi_next * (q_next - tau * log_softmax(q_next))).sum(-1)
    taken = log_softmax(q)[np.arange(5), np.asarray(batch['action'])]
    want = (np.asarray(batch['reward_sum']) + alpha * np.clip(tau * taken, -1.0, 0.0)
            + np.asarray(batch['bootstrap_discount']) * soft)
    got = target(agent.spec, hp, params, params, batch)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('added', [KL], indirect=True)
def test_kl_penalty_objective_is_its_formula_and_trains(added):
    module, objective = added
    config, metrics = short_run(ac, [*SMALL[ac], '--policy-loss', 'ppo_kl'])
    assert config.policy_loss == 'ppo_kl'
    assert np.all(np.isfinite(metrics['metrics/policy_loss']))
    assert 'metrics/approx_kl' in metrics and 'metrics/clip_fraction' not in metrics
    assert 'ppo_kl' in flags.build_parser(ac.Config, 'actor_critic.py', '').format_help()

    old = jnp.log(jnp.asarray([0.5, 0.25, 0.1, 0.8]))
    new = old + jnp.asarray([0.1, -0.2, 0.0, 0.05])
    adv, weight = jnp.asarray([1.0, -2.0, 0.5, 3.0]), jnp.asarray([1.0, 1.0, 0.0, 1.0])
    loss, info = objective(new, old, adv, weight, {})
    ratio, w = np.exp(np.asarray(new - old)), np.asarray(weight)
    kl = np.sum(w * np.asarray(old - new)) / w.sum()
    np.testing.assert_allclose(float(info['metrics/approx_kl']), kl, rtol=1e-5)
    np.testing.assert_allclose(float(loss), kl - np.sum(w * ratio * np.asarray(adv)) / w.sum(),
                               rtol=1e-5)
    grad = jax.grad(lambda lp: objective(lp, old, adv, weight, {})[0])(new)
    np.testing.assert_allclose(np.asarray(grad), (-1.0 - ratio * np.asarray(adv)) * w / w.sum(),
                               rtol=1e-5)


def test_the_registries_are_the_flags_choices():
    """Each flag takes exactly its registry's keys, an entry added later too."""
    for module, field, registry in ((dqn, 'advantage_estimator', dqn.TARGETS),
                                    (ac, 'policy_loss', ac.POLICY_OBJECTIVES)):
        typed, _ = fields.parse_flags(module.Config, [fields.flag(field), 'nope'])
        with pytest.raises(common.UsageError, match='must be one of ' + ', '.join(registry)):
            fields.check_fields(module.Config(**typed))
        registry['nope'] = next(iter(registry.values()))
        try:
            fields.check_fields(module.Config(**typed))
        finally:
            registry.pop('nope')
