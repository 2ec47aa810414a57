"""REINFORCE after Trax's `PolicyGradient` (trax/rl/training.py), in pure JAX.

One epoch = collect (temperature 1, gymnax envs) -> train (Monte-Carlo returns
minus the batch's mean return, Trax's `_value_fn`; optional advantage
normalisation) -> evaluation at each (temperature, horizon). Each phase is a
pure function of the state pytree, made by `make_agent` from this file's
module-level functions of a static `Spec`; the whole epoch is vmapped over
runs (seeds x hyperparameter grid) and compiled once. Categorical policy for
Discrete actions, Gaussian (or gSDE) for Box ones, from common.py.

Defaults differ from Trax's where that makes `python pg.py` solve CartPole-v1
on every seed in 40 epochs of one gradient step each (docs/pg.md). An episode
still running when an epoch's window closes (`--n-interactions-per-epoch`)
waits in `State.tail` and trains in the epoch in which it ends, with its
complete Monte-Carlo return; a time-limit truncation ends an episode like a
termination (REINFORCE has no value to bootstrap from, as Trax).

A2C and PPO (Trax's actor_critic.py) are in actor_critic.py.

    python pg.py --seed 0                 # CartPole-v1, greedy return 500
    python pg.py --num-seeds 8            # 8 seeds in one vmapped program
    python pg.py --env Pendulum-v1 --gamma 0.95 --epochs 200 --lr 3e-3
"""

if __name__ == '__main__':  # a Ctrl-C during the imports: held for main's one line
    try:
        __import__('harness.early_signals')
    except ImportError:  # copied without harness/: fields.plain_main runs it
        pass

import dataclasses
import functools
import sys
from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

import common
import fields
import policies


POLICY_LOSSES = ('reinforce', 'a2c', 'ppo')  # a2c and ppo only to point to actor_critic.py


@dataclasses.dataclass(frozen=True)
class Config:
    env: str = fields.option('CartPole-v1', 'gymnax env (Discrete or Box action space)')
    epochs: int = fields.option(40, 'total epochs of collect -> train -> evaluate', bounds='[1, inf)')
    n_envs: int = fields.option(16, 'parallel envs per run (n_interactions mode)', bounds='[1, inf)')
    n_interactions_per_epoch: Optional[int] = fields.option(
        None, 'instead: env steps per epoch and run; episodes carry over epochs and an '
        'unfinished episode\'s steps wait for the epoch in which it ends', bounds='[1, inf)')
    n_trajectories_per_epoch: Optional[int] = fields.option(
        32, 'complete fresh episodes per epoch and run (Trax CartPole test: 2)', bounds='[1, inf)')
    max_steps: Optional[int] = fields.option(None, 'episode cap (default: the env\'s limit)', bounds='[1, inf)')
    train_steps_per_epoch: int = fields.option(
        1, 'gradient steps per epoch on this epoch\'s data (Trax: 1)', bounds='[1, inf)')
    evals_per_epoch: int = fields.option(1, 'trainer metric chunks per epoch (reporting only)', bounds='[1, inf)')
    batch_size: int = fields.option(
        0, '0: every collected step is the batch; B > 0: Trax\'s B length-1 slices per '
        'step, each from a uniform trajectory, then a uniform step in it (Trax: 64)', bounds='[0, inf)')
    lr: float = fields.option(1e-2, 'Adam learning rate: the schedule\'s constant', sweep=True, bounds='(0, inf)')
    lr_schedule: str = fields.option(
        'constant * linear_decay',
        'multifactor factors: constant, linear_warmup, rsqrt_decay, decay_every, '
        'linear_decay (to 0 at the last step); Trax: constant * linear_warmup * rsqrt_decay')
    warmup_steps: int = fields.option(400, 'linear_warmup / rsqrt_decay steps', bounds='[1, inf)')
    lr_decay_epochs: Optional[int] = fields.option(
        None, 'linear_decay reaches 0 after this many epochs (default: --epochs); keep '
        'it when resuming with a larger --epochs so the schedule does not change', bounds='[1, inf)')
    adam_b1: float = fields.option(
        0.0, 'Adam first-moment decay (Trax: 0.9); 0: no momentum carried across epochs, '
        'each of which brings a fresh on-policy gradient', sweep=True, bounds='[0, 1)')
    adam_b2: float = fields.option(0.99, 'Adam second-moment decay (Trax: 0.999)', sweep=True, bounds='[0, 1)')
    gamma: float = fields.option(0.995, 'discount factor in (0, 1] (Trax: 0.99)', sweep=True, bounds='(0, 1]')
    normalize_advantages: bool = fields.option(
        True, 'A <- (A - mean A) / (std A + 1e-5) over the batch (Trax: on)',
        aliases=('--advantage-normalization',))
    entropy_coeff: float = fields.option(
        0.0, 'loss -= this * mean policy entropy (Trax: none for REINFORCE)', sweep=True,
        bounds='[0, inf)')
    policy_loss: str = fields.option(
        'reinforce', 'reinforce (Trax PolicyGradient), the only one here: A2C and PPO are '
        'in actor_critic.py', choices=POLICY_LOSSES)
    torso: str = fields.option(
        'auto', 'policy torso: mlp, conv (3x3 convs, ReLU, flatten), auto (conv for '
        '[height, width, channels] observations, mlp otherwise) or gru: auto\'s layers, '
        'then a GRU whose state carries through each episode, trained by backpropagation '
        'through whole episodes (needs --batch-size 0; with --help it lists the settings it '
        'brings)', choices=policies.TORSOS)
    gru_size: int = fields.option(64, 'the GRU\'s state size', bounds='[1, inf)',
                                  acts_with=('torso', ('gru',)))
    conv_channels: tuple[int, ...] = fields.option(
        (16,), 'conv torso: channels of each 3x3 stride-1 conv (MinAtar paper: 16)',
        bounds='[1, inf)')
    hidden_sizes: tuple[int, ...] = fields.option(
        (64, 64), 'policy MLP hidden layer sizes', bounds='[1, inf)')
    activation: str = fields.option(
        'relu', 'the hidden layers\' nonlinearity: relu (Trax\'s) or tanh (PureJaxRL\'s PPO)',
        choices=common.ACTIVATIONS)
    init: str = fields.option(
        'glorot', 'weights: glorot (Trax\'s Dense: Glorot-uniform, the heads\' last layer x '
        '0.01) or orthogonal (PureJaxRL\'s PPO, after CleanRL\'s: gain sqrt(2), the policy '
        'head 0.01; the GRU\'s recurrent weights stay Glorot)',
        choices=('glorot', 'orthogonal'))
    normalize_observations: bool = fields.option(
        False, 'map each observation dimension whose Box bounds are finite onto [-1, 1] '
        'before the network (MountainCar\'s velocity spans only +-0.07)')
    init_log_std: float = fields.option(
        0.0, 'Box actions: initial log std, in units of half the Box\'s width (gSDE: of '
        'each noise weight)', sweep=True)
    state_dependent_exploration: bool = fields.option(
        False, 'Box actions: gSDE (Raffin et al. 2022): the noise is the policy\'s last '
        'hidden features times a random weight matrix held for --sde-sample-freq steps')
    sde_sample_freq: int = fields.option(
        0, 'gSDE\'s steps between draws of the noise weights (0: one draw per epoch\'s '
        'rollout, as stable-baselines3\'s -1)', bounds='[0, inf)',
        acts_with=('state_dependent_exploration', (True,)))
    n_eval_episodes: int = fields.option(32, 'episodes per evaluation (0: no evaluation)', bounds='[0, inf)')
    eval_steps: Optional[tuple[int, ...]] = fields.option(
        None, 'evaluation horizons, e.g. 200,500 (default: max_steps)', bounds='[1, inf)')
    eval_temperatures: tuple[float, ...] = fields.option(
        (0.0,), 'evaluation temperatures: 0 argmax / Gaussian mean, T samples logits / T '
        'or std * T', bounds='[0, inf)')
    eval_every: Optional[int] = fields.option(
        None, 'epochs between evaluations, and always the last (default: epochs // 20, '
        'about 20 a run); evaluation has its own PRNG stream, so this never changes training',
        bounds='[1, inf)')


class Batch(NamedTuple):
    """The latest epoch's training steps, flat [N]: those with weight 0 are padding
    (after an episode's end, or of an episode not yet finished)."""
    obs: jax.Array
    action: jax.Array
    returns: jax.Array  # Monte-Carlo discounted return from the step to its episode's end
    weight: jax.Array  # 1.0 for a step to train on, else 0.0
    episode_length: jax.Array  # its episode's length in the batch; [0] unless batch_size > 0
    reset: jax.Array  # --torso gru: the GRU state is zeros after this step; else [0]


class Tail(NamedTuple):
    """n_interactions mode: the steps of each env's unfinished episode so far,
    right-aligned in [n_envs, max_steps]; they train in the epoch it ends in."""
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    valid: jax.Array


class State(NamedTuple):
    params: dict
    opt_state: tuple
    batch: Batch  # the epoch's training steps
    tail: Optional[Tail]  # None in n_trajectories mode
    env_state: object
    obs: jax.Array
    episode_return: jax.Array  # running undiscounted return of each env
    memory: dict  # --torso gru: each env's GRU state {'policy': [n_envs, H]}; else {}
    key: jax.Array  # the training stream: split at each use
    eval_key: jax.Array  # the evaluation stream's root, never advanced (common.evaluation_key)
    epoch: jax.Array  # completed epochs
    train_step: jax.Array
    n_interactions: jax.Array
    n_trajectories: jax.Array


# ---------------------------------------------------------------------------
# Pure pieces, importable and tested on their own (the policy distributions
# are common.py's).
# ---------------------------------------------------------------------------


def episode_returns(rewards, dones, valid, gamma):
    """Monte-Carlo discounted returns over [batch, length] rows, Trax's estimator.

    A row may hold several episodes; `dones` marks each episode's last step, so
    the sum never crosses into the next episode. A time-limit truncation is a
    `done` too: REINFORCE has nothing to bootstrap from, so a truncated
    episode's return is the discounted sum of the rewards it observed (Trax's
    behaviour). Returns through `common.monte_carlo(gamma, margin=0)` with
    values 0: in Trax's arrays an episode ends with an extra step (the final
    observation, mask 0, done), which here are the padding steps `~valid`.
    """
    where = 'episode_returns'
    common.check_args(chex.assert_rank, where, 2, rewards=rewards, dones=dones, valid=valid)
    common.check_args(chex.assert_type, where, bool, dones=dones, valid=valid)
    common.check_args(chex.assert_rank, where, 0, gamma=gamma)
    chex.assert_equal_shape([rewards, dones, valid],
                            custom_message=f'{where}: rewards, dones, valid')
    rewards = jnp.where(valid, rewards, 0.0)
    gammas = jnp.where(dones, 0.0, gamma)
    returns = common.discounted_returns(rewards, gammas)
    zeros = jnp.zeros_like(returns)
    return common.monte_carlo(gamma, 0)(rewards, returns, zeros, ~valid, valid)


masked_mean = policies.masked_mean


def advantages(returns, weight, normalize):
    """A = G - b with b the batch's mean return (Trax `_value_fn`), optionally
    normalised to (A - mean A) / (std A + 1e-5); statistics over weighted steps,
    flat [N] as in `Batch`."""
    common.check_args(chex.assert_rank, 'advantages', 1, returns=returns, weight=weight)
    chex.assert_equal_shape([returns, weight], custom_message='advantages: returns, weight')
    baseline = masked_mean(returns, weight)
    adv = returns - baseline
    if normalize:
        mean = masked_mean(adv, weight)
        std = jnp.sqrt(masked_mean((adv - mean) ** 2, weight))
        adv = (adv - mean) / (std + 1e-5)
    return adv, baseline


def reinforce_loss(log_probs, adv, weight):
    """-(1/N) sum_t w_t A_t log pi(a_t | s_t), N = sum of weights; A is a constant.
    Flat [N] arrays, as in `Batch`."""
    common.check_args(chex.assert_rank, 'reinforce_loss', 1, log_probs=log_probs, adv=adv,
                      weight=weight)
    chex.assert_equal_shape([log_probs, adv, weight],
                            custom_message='reinforce_loss: log_probs, adv, weight')
    return -masked_mean(jax.lax.stop_gradient(adv) * log_probs, weight)


def cut_at_last_done(done, valid):
    """Split [n_envs, length] rows at each row's last finished step.

    Returns (finished, unfinished): steps of episodes that end inside the row,
    and the steps after the row's last `done` (an episode still running).
    """
    index = jnp.arange(done.shape[-1])
    last_done = jnp.max(jnp.where(done & valid, index, -1), axis=-1, keepdims=True)
    return valid & (index <= last_done), valid & (index > last_done)


def segment_lengths(done, weight):
    """For each step of [batch, length] rows, the total weight of its episode
    (episodes end at `done`), i.e. its episode's length in the batch."""
    rows, length = done.shape
    done = done.astype(jnp.int32)
    episode = jnp.cumsum(done, axis=-1) - done  # 0, 0, 0 | 1, 1 | 2 ...
    ids = (episode + (length + 1) * jnp.arange(rows)[:, None]).reshape(-1)
    sums = jax.ops.segment_sum(weight.reshape(-1), ids, num_segments=rows * (length + 1))
    return sums[ids].reshape(rows, length)


def sample_slices(key, weight, episode_length, batch_size):
    """Trax's batch: `batch_size` step indices, each drawn by picking an episode
    uniformly and then one of its steps uniformly (p = 1 / (n_episodes * length)),
    by inverse CDF."""
    p = jnp.where(weight > 0, 1.0 / jnp.maximum(episode_length, 1.0), 0.0)
    cdf = jnp.cumsum(p)
    u = jax.random.uniform(key, (batch_size,)) * cdf[-1]
    return jnp.minimum(jnp.searchsorted(cdf, u, side='right'), weight.shape[0] - 1)


# ---------------------------------------------------------------------------
# The phases: functions of the static Spec, made per-run by make_agent.
# ---------------------------------------------------------------------------


class Spec(NamedTuple):
    """What make_agent derives from the config: static, shared by every run."""
    config: Config
    policy: policies.PolicySpec  # env, observation and action shapes, networks
    eval_tags: tuple  # ((temperature, horizon), ...) evaluated each epoch
    fresh_episodes: bool  # n_trajectories mode: each epoch plays fresh episodes
    n_envs: int  # envs per run (trajectories per epoch in that mode)
    steps: int  # env steps per env and epoch
    batch_n: int  # rows of `Batch` (n_envs x its row length)
    chunk_steps: int  # gradient steps per metric chunk
    total_train_steps: int  # the schedule's length


def optimizer(spec, hp):
    config = spec.config
    schedule = common.multifactor(config.lr_schedule, constant=hp['lr'],
                                  warmup_steps=config.warmup_steps,
                                  total_steps=spec.total_train_steps)
    return optax.chain(optax.scale_by_adam(b1=hp['adam_b1'], b2=hp['adam_b2']),
                       optax.scale_by_schedule(lambda s: -schedule(s)))


def init(spec, key, hp):
    policy, n = spec.policy, spec.batch_n
    eval_key, key = jax.random.split(key)
    params, obs, env_state, key = policies.init_policy(policy, key, hp, spec.n_envs,
                                                     spec.fresh_episodes)
    action_dtype = jnp.int32 if policy.kind == 'discrete' else jnp.float32
    batch = Batch(obs=jnp.zeros((n,) + policy.obs_shape, policy.obs_dtype),
                  action=jnp.zeros((n,) + policy.action_shape, action_dtype),
                  returns=jnp.zeros(n), weight=jnp.zeros(n),
                  episode_length=jnp.ones(n if spec.config.batch_size else 0),
                  reset=jnp.ones(n if policy.gru_size else 0, bool))
    tail = None
    if not spec.fresh_episodes:
        rows = (spec.n_envs, policy.max_steps)
        tail = Tail(obs=jnp.zeros(rows + policy.obs_shape, policy.obs_dtype),
                    action=jnp.zeros(rows + policy.action_shape, action_dtype),
                    reward=jnp.zeros(rows), valid=jnp.zeros(rows, bool))
    zero = jnp.zeros((), jnp.int32)
    return State(params=params, opt_state=optimizer(spec, hp).init(params), batch=batch,
                 tail=tail, env_state=env_state, obs=obs, episode_return=jnp.zeros(spec.n_envs),
                 memory=policies.initial_memory(policy, ['policy'], spec.n_envs), key=key, eval_key=eval_key, epoch=zero, train_step=zero, n_interactions=zero,
                 n_trajectories=zero)


def episodes_to_train(spec, tail, rec):
    """The rollout's rows [n_envs, length] -> (data, done, train_on, tail):
    the steps of episodes that ended, and what waits for a later epoch."""
    names = ('obs', 'action', 'reward', 'valid')
    if spec.fresh_episodes:
        # An episode still running at the cap (only if the env's own limit is
        # longer) ends there, truncated.
        data = {name: rec[name] for name in names}
        return data, rec['done'].at[:, -1].set(True), data['valid'], tail
    # Episodes carry over epochs: an episode's steps train in the epoch in
    # which it ends (its full Monte-Carlo return is known only then); until
    # then they wait in `tail`, prepended to the next epoch's steps.
    data = {name: jnp.concatenate([getattr(tail, name), rec[name]], axis=1) for name in names}
    done = jnp.concatenate([jnp.zeros_like(tail.valid), rec['done']], axis=1)
    train_on, waiting = cut_at_last_done(done, data['valid'])
    max_steps = spec.policy.max_steps
    tail = Tail(**{name: value[:, -max_steps:] for name, value in data.items()
                   if name != 'valid'}, valid=waiting[:, -max_steps:])
    return data, done, train_on, tail


def collect(spec, hp, state):
    """One epoch of temperature-1 experience into `state.batch`."""
    key, carry, rec = policies.collect_rollout(spec.policy, state, spec.n_envs, spec.steps,
                                             spec.fresh_episodes)
    data, done, train_on, tail = episodes_to_train(spec, state.tail, rec)
    returns = episode_returns(data['reward'], done, data['valid'], hp['gamma'])
    weight = train_on.astype(jnp.float32)
    n, policy = spec.batch_n, spec.policy
    batch = Batch(obs=data['obs'].reshape((n,) + policy.obs_shape),
                  action=data['action'].reshape((n,) + policy.action_shape),
                  returns=returns.reshape(n), weight=weight.reshape(n),
                  episode_length=segment_lengths(done, weight).reshape(n)
                  if spec.config.batch_size else state.batch.episode_length,
                  # A row's episodes each start from the GRU's zero state: the
                  # waiting tail's first step too (padding before it resets).
                  reset=(done | ~data['valid']).reshape(n)
                  if policy.gru_size else state.batch.reset)
    state, metrics = policies.finish_collect(state, key, carry, rec, spec.fresh_episodes)
    return state._replace(batch=batch, tail=tail), metrics


def log_probs_of(spec, params, batch):
    """Each step's (log pi(a|s), entropy), flat [N]; the recurrent torso runs
    over the batch's rows [n_envs, row length] whole, from its zero state."""
    policy = spec.policy
    if not policy.gru_size:
        return policies.log_prob_and_entropy(policy, params, batch.obs, batch.action)
    rows = lambda x: x.reshape((spec.n_envs, -1) + x.shape[1:])
    memory = (jnp.zeros((spec.n_envs, policy.gru_size)), rows(batch.reset))
    return jax.tree.map(lambda x: x.reshape(-1), policies.log_prob_and_entropy(
        policy, params, rows(batch.obs), rows(batch.action), memory))


def loss_fn(spec, params, batch, hp):
    log_probs, entropy = log_probs_of(spec, params, batch)
    adv, baseline = advantages(batch.returns, batch.weight, spec.config.normalize_advantages)
    policy_loss = reinforce_loss(log_probs, adv, batch.weight)
    mean_entropy = masked_mean(entropy, batch.weight)
    loss = policy_loss - hp['entropy_coeff'] * mean_entropy
    raw = batch.returns - baseline
    return loss, {'metrics/policy_loss': policy_loss, 'metrics/entropy': mean_entropy,
                  'metrics/advantage_mean': masked_mean(raw, batch.weight),
                  'metrics/advantage_std': jnp.sqrt(masked_mean(raw ** 2, batch.weight)),
                  'metrics/returns_mean': baseline}


def train_step(spec, hp, state, key):
    batch = state.batch
    if spec.config.batch_size:
        index = sample_slices(key, batch.weight, batch.episode_length, spec.config.batch_size)
        batch = jax.tree.map(lambda x: x[index] if x.shape[0] else x, batch)  # reset is [0]
        batch = batch._replace(weight=(batch.weight > 0).astype(jnp.float32))
    grads, metrics = jax.grad(functools.partial(loss_fn, spec), has_aux=True)(
        state.params, batch, hp)
    updates, opt_state = optimizer(spec, hp).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state._replace(params=params, opt_state=opt_state,
                          train_step=state.train_step + 1), metrics


def train(spec, hp, state):
    """train_steps_per_epoch gradient steps on this epoch's batch, in chunks."""
    key, train_key = jax.random.split(state.key)
    state = state._replace(key=key)

    def chunk(state, chunk_key):
        state, metrics = jax.lax.scan(lambda s, k: train_step(spec, hp, s, k), state,
                                      jax.random.split(chunk_key, spec.chunk_steps))
        return state, jax.tree.map(jnp.mean, metrics)

    state, metrics = jax.lax.scan(chunk, state,
                                  jax.random.split(train_key, spec.config.evals_per_epoch))
    state = state._replace(epoch=state.epoch + 1)
    metrics = jax.tree.map(lambda m: m[-1], metrics)  # the last chunk, as Trax logs
    if spec.policy.kind == 'box':
        metrics['metrics/log_std'] = jnp.mean(state.params['log_std'])
    return state, metrics


def evaluate(spec, hp, state):
    """Fresh episodes for each (temperature, horizon); never training data."""
    return policies.evaluate_policy(spec.policy, state, spec.eval_tags,
                                  spec.config.n_eval_episodes)


def make_agent(config: Config, given=None) -> common.Agent:
    """Check `config` as the command line does (fields.check_grid, then the
    fields that cannot act: fields.check_inert, `given` its fields set by a
    command line), derive its Spec and build REINFORCE's per-run phases."""
    fields.check_grid(config, {}, check_runs)
    policy = policies.policy_spec(config)
    fields.check_inert(config, {**fields.shared_inert(config, policies.feature_torso(
        policy.torso, policy.obs_shape), policy.env_params), **policies.inert_fields(
        config, policy)}, given)
    max_steps = policy.max_steps
    fresh = bool(config.n_trajectories_per_epoch)
    if fresh:
        n_envs, steps = config.n_trajectories_per_epoch, max_steps
        row_length = steps
    else:
        n_envs = config.n_envs
        steps = config.n_interactions_per_epoch // config.n_envs
        row_length = max_steps + steps  # the waiting tail, then the epoch's steps
    env_steps = fields.env_steps_factors(config, n_envs, steps, max_steps)
    # The counters and the batch's row index.
    fields.check_int32_products(fields.step_products(config, env_steps) + [
        ('batch steps', env_steps if fresh else
         [('--n-envs', n_envs), (f'(the episode cap {max_steps} + {steps} steps an epoch)',
                                 row_length)])])
    spec = Spec(
        config=config, policy=policy,
        eval_tags=tuple((t, h) for t in config.eval_temperatures
                        for h in (config.eval_steps or (max_steps,))),
        fresh_episodes=fresh, n_envs=n_envs, steps=steps, batch_n=n_envs * row_length,
        chunk_steps=config.train_steps_per_epoch // config.evals_per_epoch,
        total_train_steps=(config.lr_decay_epochs or config.epochs)
        * config.train_steps_per_epoch)
    return common.Agent(
        name='pg', init=functools.partial(init, spec), collect=functools.partial(collect, spec),
        train=functools.partial(train, spec), evaluate=functools.partial(evaluate, spec),
        eval_tags=list(spec.eval_tags), max_steps=max_steps, spec=spec, config=config,
        check_runs=check_runs, obs_shape=policy.obs_shape,
        memory_flags='--num-seeds (or the grid), --n-trajectories-per-epoch '
        'or --n-interactions-per-epoch, --max-steps, --batch-size')


# Per-env settings: none. The PPO settings that pg.py once held for Pendulum,
# MountainCarContinuous, Acrobot, the bsuite/misc grids and MinAtar are
# actor_critic.py's ENV_SETTINGS.
ENV_SETTINGS = {}

# --torso gru brings settings of its own on CartPole-v1. With the MLP's (lr
# 1e-2 over 40 epochs, 32 episodes an epoch) 3 of tuning seeds 0-31 ended
# oscillating below 400 after reaching 500; lr 3e-3 over 60 epochs left one
# run of 128 (seeds 0-63, both compile modes) below 400; with 64 episodes an
# epoch, a gradient of half the variance, none (docs/pg.md).
GRU_SETTINGS = {'CartPole-v1': {'torso': 'gru', 'epochs': 60, 'lr': 3e-3,
                                'n_trajectories_per_epoch': 64}}


def settings_table(typed):
    """The per-env settings for the flags typed: --torso gru's own, else ENV_SETTINGS."""
    return GRU_SETTINGS if typed.get('torso') == 'gru' else ENV_SETTINGS


NOT_HERE = ('pg.py is REINFORCE (Trax PolicyGradient); A2C and PPO are in actor_critic.py: '
            'python actor_critic.py --policy-loss ppo')


def check_runs(config: Config, runs):
    """The rules that tie fields together (each field's own constraint is
    fields.check_fields'); none is swept."""
    if config.policy_loss != 'reinforce':
        raise common.UsageError(NOT_HERE)
    error = common.UsageError
    if (config.n_trajectories_per_epoch is None) == (config.n_interactions_per_epoch is None):
        raise error('exactly one of --n-trajectories-per-epoch or --n-interactions-per-epoch '
                    'must be set (the other to none)')
    if config.n_interactions_per_epoch and config.n_interactions_per_epoch % config.n_envs:
        raise error(f'--n-interactions-per-epoch ({config.n_interactions_per_epoch}) must be a '
                    f'multiple of --n-envs ({config.n_envs})', field='n_interactions_per_epoch')
    if config.train_steps_per_epoch % config.evals_per_epoch:
        raise error(f'--train-steps-per-epoch ({config.train_steps_per_epoch}) must be '
                    f'divisible by --evals-per-epoch ({config.evals_per_epoch})',
                    field='train_steps_per_epoch')
    common.schedule_factors(config.lr_schedule)
    if config.torso == 'gru' and config.batch_size:
        raise error(f'--torso gru trains on whole episodes: it needs --batch-size 0, not '
                    f'{config.batch_size} (Trax\'s length-1 slices have no past to remember)',
                    field='torso')


def main(argv=None):
    """The full command line (harness/), or without it fields.plain_main."""
    try:  # `import pg` alone needs neither
        from harness import cli
    except ImportError as error:  # none, or a project's own `harness` package
        if error.name not in ('harness', 'harness.cli'):
            raise
        return fields.plain_main(Config, make_agent, settings_table, argv)
    return cli.main(Config, make_agent, check_runs, 'pg.py', __doc__.split('\n\n')[0], argv,
                    env_settings=settings_table)


if __name__ == '__main__':
    sys.exit(0 if main() is not None else 1)
