"""DQN after Trax's `ValueAgent` + `DQN` (trax/rl/training.py), in pure JAX.

One epoch = collect (epsilon-greedy, gymnax envs) -> train (double-DQN targets
from a replay of the last epochs: n-step returns, or Trax's other estimators'
lambda- and Monte-Carlo returns, i.e. Q(lambda)) -> greedy evaluation. `make_agent`
derives a static `Spec` from the config; each phase is a module-level pure
function of it, `phase(spec, hp, state) -> (state, metrics)`, and so is the
whole epoch (`agent.epoch`), vmapped over runs (seeds x hyperparameter grid)
and compiled once.

Fixed relative to Trax (why: docs/trax.md section 6; notes: docs/dqn.md):
  - terminal and truncated transitions are regression targets;
  - n-step sums stop at termination, and truncation bootstraps from the
    true final observation;
  - `n_replay_epochs` really keeps that many epochs;
  - the target network syncs exactly every `sync_freq` gradient steps.

    python dqn.py --seed 0                 # CartPole-v1, greedy return 500
    python dqn.py --num-seeds 8            # 8 seeds in one vmapped program
    python dqn.py --lr 1e-3,3e-4 --num-seeds 4   # a 2-point grid x 4 seeds
    python dqn.py --advantage-estimator td_lambda  # Q(lambda) targets
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


# ---------------------------------------------------------------------------
# The targets: --advantage-estimator NAME picks TARGETS[NAME], a pure function
# (spec, hp, params, target_params, batch) -> y [batch], the regression target
# of Q(obs, action) in Q units. A batch holds replay rows: obs, action and
# either an n-step transition (reward_sum, bootstrap_obs, bootstrap_discount)
# or, for a target of `replayed_target`, the `target` replay_targets stored.
# A new target is one function and one entry here (docs/dqn.md: Munchausen).
# ---------------------------------------------------------------------------


def n_step_target(spec, hp, params, target_params, batch):
    """td_k: y = R + discount * Q_target(s', a*), a* = argmax of the online net
    (double DQN) or of the target net, over the batch's n-step transitions."""
    q_next_target = q_values(spec, target_params, batch['bootstrap_obs'], hp)
    q_next_online = q_values(spec, params, batch['bootstrap_obs'], hp) \
        if spec.config.double_dqn else q_next_target
    return td_targets(q_next_target, q_next_online, batch['reward_sum'],
                      batch['bootstrap_discount'], spec.config.double_dqn)


def replayed_target(spec, hp, params, target_params, batch):
    """td_lambda, monte_carlo: the target replay_targets stored for the row at
    the epoch's start (common.py's estimators over each env's slice)."""
    return batch['target']


TARGETS = {'td_k': n_step_target, 'td_lambda': replayed_target,
           'monte_carlo': replayed_target}


@dataclasses.dataclass(frozen=True)
class Config:
    env: str = fields.option('CartPole-v1', 'gymnax env with a Discrete action space')
    epochs: int = fields.option(50, 'total epochs of collect -> train -> evaluate', bounds='[1, inf)')
    n_envs: int = fields.option(16, 'parallel envs per run (n_interactions mode)', bounds='[1, inf)')
    n_interactions_per_epoch: Optional[int] = fields.option(
        512, 'env steps collected per epoch and run; episodes carry over epochs', bounds='[1, inf)')
    n_trajectories_per_epoch: Optional[int] = fields.option(
        None, 'instead: this many complete fresh episodes per epoch (set the other to none)', bounds='[1, inf)')
    max_steps: Optional[int] = fields.option(None, 'episode cap (default: the env\'s limit)', bounds='[1, inf)')
    train_steps_per_epoch: int = fields.option(
        128, 'gradient steps per epoch (Trax value_train_steps_per_epoch: 500)', bounds='[1, inf)')
    evals_per_epoch: int = fields.option(1, 'trainer metric chunks per epoch (reporting only)', bounds='[1, inf)')
    batch_size: int = fields.option(128, 'transitions per gradient step (Trax value_batch_size: 64)', bounds='[1, inf)')
    lr: float = fields.option(
        1e-2, 'Adam learning rate, the schedule\'s constant (Trax: 0.1 * multifactor)', sweep=True, bounds='(0, inf)')
    lr_schedule: str = fields.option(
        'constant * linear_decay',
        'multifactor factors: constant, linear_warmup, rsqrt_decay, decay_every, '
        'linear_decay (to 0 at the last step); Trax: constant * linear_warmup * rsqrt_decay')
    warmup_steps: int = fields.option(400, 'linear_warmup / rsqrt_decay steps', bounds='[1, inf)')
    lr_decay_epochs: Optional[int] = fields.option(
        None, 'linear_decay reaches 0 after this many epochs (default: --epochs); keep '
        'it when resuming with a larger --epochs so the schedule does not change', bounds='[1, inf)')
    gamma: float = fields.option(0.99, 'discount factor in (0, 1]', sweep=True, bounds='(0, 1]')
    max_slice_length: int = fields.option(
        4, 'Trax slice length L >= 2: targets are (L-1)-step returns (Trax: 1, broken)', bounds='[2, inf)')
    advantage_estimator: str = fields.option(
        'td_k', 'targets (Trax\'s DQN advantage_estimator): td_k, n-step returns (n = '
        'max_slice_length - 1); td_lambda, lambda-returns (Q(lambda), as PQN); monte_carlo, '
        'returns to the episode\'s or the block\'s end; the last two by common.py\'s '
        'estimators over each env\'s slice of each replayed epoch, refreshed each epoch '
        'from the target net; dqn.TARGETS holds them', choices=TARGETS)
    lambda_: float = fields.option(
        0.95, 'td_lambda\'s lambda (Trax\'s estimators\' lambda_: 0.95; PQN on MinAtar: '
        '0.65)', sweep=True, bounds='[0, 1]', acts_with=('advantage_estimator', ('td_lambda',)))
    double_dqn: bool = fields.option(True, 'pick a* by the online net (Trax default: off)')
    smoothl1loss: bool = fields.option(True, 'Huber (delta 1) loss; off: L2')
    scale_value_targets: bool = fields.option(
        True, 'the net predicts Q * (1 - gamma) (Trax\'s target scaling)')
    sync_freq: int = fields.option(
        25, 'gradient steps between target-net syncs (Trax: 1000)', sweep=True, bounds='[1, inf)')
    n_replay_epochs: int = fields.option(
        50, 'replay holds the transitions of this many last epochs (Trax: 1)', bounds='[1, inf)')
    exploration_constant: float = fields.option(1.0, 'epsilon at epoch 0', sweep=True, bounds='[0, 1]')
    exploration_decay_factor: float = fields.option(
        0.9, 'epsilon *= this every steps_per_decay epochs (Trax: 0.99)', sweep=True, bounds='(0, 1]')
    exploration_steps_per_decay: int = fields.option(1, 'epochs per epsilon decay', bounds='[1, inf)')
    exploration_minimum: float = fields.option(
        0.01, 'epsilon floor (Trax: 0.1)', sweep=True, bounds='[0, 1]')
    torso: str = fields.option(
        'auto', 'Q-network torso: mlp, conv (3x3 convs, ReLU, flatten) or auto (conv for '
        '[height, width, channels] observations, mlp otherwise)', choices=common.TORSOS)
    conv_channels: tuple[int, ...] = fields.option(
        (16,), 'conv torso: channels of each 3x3 stride-1 conv (MinAtar paper: 16)',
        bounds='[1, inf)')
    hidden_sizes: tuple[int, ...] = fields.option((64, 64), 'Q-network hidden layer sizes', bounds='[1, inf)')
    layer_norm: bool = fields.option(
        False, 'LayerNorm before each hidden ReLU of the Q-network, conv and dense (PQN; '
        'not in Trax)')
    n_eval_episodes: int = fields.option(32, 'episodes per evaluation (0: no evaluation)', bounds='[0, inf)')
    eval_steps: Optional[tuple[int, ...]] = fields.option(
        None, 'evaluation horizons, e.g. 200,500 (default: max_steps)', bounds='[1, inf)')
    eval_temperatures: tuple[float, ...] = fields.option(
        (0.0,), 'evaluation temperatures: 0 greedy, 1 epsilon-greedy, else softmax(Q/T)', bounds='[0, inf)')
    eval_every: Optional[int] = fields.option(
        None, 'epochs between evaluations, and always the last (default: epochs // 20, '
        'about 20 a run); evaluation has its own PRNG stream, so this never changes training',
        bounds='[1, inf)')


class Replay(NamedTuple):
    """Ring of `n_replay_epochs` blocks, one per epoch; `count` valid rows each.

    A row is an n-step transition: obs, action, the discounted reward sum up to
    the bootstrap point, the observation to bootstrap from and its discount
    (gamma^k, 0 if the episode terminated inside the window). A block's rows
    are time-major, [steps, n_envs] flattened. The estimators' targets
    (td_lambda, monte_carlo) store one-step rows (n = 1) and two more fields;
    td_k has None there, so its state is as it always was.
    """
    obs: jax.Array
    action: jax.Array
    reward_sum: jax.Array
    bootstrap_obs: jax.Array
    bootstrap_discount: jax.Array
    count: jax.Array
    done: Optional[jax.Array] = None  # the row's step ended its episode (any cause)
    target: Optional[jax.Array] = None  # its estimator target, refreshed each epoch


class State(NamedTuple):
    params: list
    target_params: list
    opt_state: tuple
    replay: Replay
    env_state: object
    obs: jax.Array
    episode_return: jax.Array  # running undiscounted return of each env
    key: jax.Array  # the training stream: split at each use
    eval_key: jax.Array  # the evaluation stream's root, never advanced (common.evaluation_key)
    epoch: jax.Array  # completed epochs
    train_step: jax.Array
    n_interactions: jax.Array
    n_trajectories: jax.Array


@dataclasses.dataclass(frozen=True)
class Spec:
    """What make_agent derives from the config, fixed for the whole run: the
    first argument of every phase below. Plain Python values, never traced."""
    config: Config  # its static fields: hidden_sizes, double_dqn, smoothl1loss, ...
    env: object  # the gymnax env
    env_params: object
    obs_shape: tuple
    obs_dtype: object  # observations' dtype in the replay
    n_actions: int
    torso: str  # 'mlp' or 'conv' (--torso auto resolved)
    n_envs: int  # envs stepped per epoch and run
    steps: int  # steps of each env per epoch
    block_size: int  # replay rows per epoch: n_envs * steps
    n_step: int  # max_slice_length - 1 (td_k), else 1: one-step rows
    estimator_targets: bool  # a replayed_target's (td_lambda, monte_carlo): replay_targets' rows
    chunk_steps: int  # gradient steps per metrics chunk
    total_train_steps: int  # the learning-rate schedule's length
    eval_tags: tuple  # ((temperature, horizon), ...) evaluated each epoch
    max_steps: int  # the episode cap actually used
    fresh_episodes: bool  # n_trajectories mode: every env plays one fresh episode an epoch


# ---------------------------------------------------------------------------
# Pure pieces, importable and tested on their own.
# ---------------------------------------------------------------------------


def exploration_rate(epoch, constant, decay_factor, steps_per_decay, minimum):
    """Trax: max(minimum, constant * decay_factor ** (epoch // steps_per_decay))."""
    return jnp.maximum(minimum, constant * decay_factor ** (epoch // steps_per_decay))


def n_step_transitions(reward, terminated, done, next_obs, gamma, n):
    """n-step windows over time-major [T, ...] arrays of one env.

    From each step t sum up to n discounted rewards, stopping after the step
    that ends the episode and at the end of the block (a shorter window is
    still a correct target). Bootstrap from the next observation of the last
    step taken; its discount is 0 only if that step terminated, so time-limit
    truncation bootstraps from the true final observation.
    Returns (reward_sum, bootstrap_obs, bootstrap_discount), each [T, ...].
    """
    where = 'n_step_transitions'
    common.check_args(chex.assert_rank, where, 1, reward=reward, terminated=terminated,
                      done=done)
    common.check_args(chex.assert_type, where, bool, terminated=terminated, done=done)
    common.check_args(chex.assert_rank, where, 0, gamma=gamma)
    chex.assert_equal_shape_prefix([reward, terminated, done, next_obs], 1, custom_message=(
        f'{where}: reward, terminated, done, next_obs share the time axis'))
    steps = reward.shape[0]
    reward_sum = jnp.zeros_like(reward)
    discount = jnp.ones_like(reward)
    bootstrap_obs = next_obs
    bootstrap_terminated = terminated
    window_open = jnp.ones(steps, bool)
    for i in range(min(n, steps)):  # past the block's end no window takes a step
        index = jnp.minimum(jnp.arange(steps) + i, steps - 1)
        take = window_open & (jnp.arange(steps) + i < steps)
        reward_sum = reward_sum + jnp.where(take, discount * reward[index], 0.0)
        discount = jnp.where(take, discount * gamma, discount)
        expand = take.reshape((steps,) + (1,) * (next_obs.ndim - 1))
        bootstrap_obs = jnp.where(expand, next_obs[index], bootstrap_obs)
        bootstrap_terminated = jnp.where(take, terminated[index], bootstrap_terminated)
        window_open = take & ~done[index]
    return reward_sum, bootstrap_obs, discount * (1.0 - bootstrap_terminated)


def td_targets(q_target_next, q_online_next, reward_sum, bootstrap_discount, double_dqn):
    """y = R + discount * Q_tgt(s', a*), a* = argmax of Q_online (double) or Q_tgt;
    the Qs are [batch, n_actions], the rest [batch]."""
    where = 'td_targets'
    common.check_args(chex.assert_rank, where, 2, q_target_next=q_target_next,
                      q_online_next=q_online_next)
    common.check_args(chex.assert_rank, where, 1, reward_sum=reward_sum,
                      bootstrap_discount=bootstrap_discount)
    chex.assert_equal_shape([q_target_next, q_online_next],
                            custom_message=f'{where}: q_target_next, q_online_next')
    chex.assert_equal_shape_prefix(
        [q_target_next, reward_sum, bootstrap_discount], 1,
        custom_message=f'{where}: q_target_next, reward_sum, bootstrap_discount share the batch')
    chooser = q_online_next if double_dqn else q_target_next
    best = jnp.argmax(chooser, axis=-1)
    bootstrap = jnp.take_along_axis(q_target_next, best[..., None], axis=-1)[..., 0]
    return reward_sum + bootstrap_discount * bootstrap


def slice_targets(estimator, gamma, lambda_, reward, done, bootstrap_discount, next_value):
    """One env's slice of T steps (time-major [T]) -> each step's target [T],
    from common.py's `estimator` ('td_lambda' or 'monte_carlo').

    next_value[t] is the value of step t's next observation (the true final
    one if t ended the episode). The estimators take values of states s_0..s_T
    and treat a `done` as the end (they never look past it), so: s_{t+1} is
    step t's next observation (values = [0, next_value]); at a done step its
    bootstrap, bootstrap_discount * next_value (gamma through truncation, 0
    at termination), joins its reward; the block's end bootstraps from
    next_value[T - 1]. The estimator returns target - value; the value is
    added back (monte_carlo subtracts none at a done step).
    """
    where = 'slice_targets'
    common.check_args(chex.assert_rank, where, 1, reward=reward, done=done,
                      bootstrap_discount=bootstrap_discount, next_value=next_value)
    chex.assert_equal_shape([reward, done, bootstrap_discount, next_value],
                            custom_message=f'{where}: the slice\'s arrays share one shape')
    reward = reward + jnp.where(done, bootstrap_discount * next_value, 0.0)
    rewards = jnp.append(reward, 0.0)[None]
    dones = jnp.append(done, False)[None]
    values = jnp.append(0.0, next_value)[None]
    live = jnp.ones_like(dones)
    if estimator == 'td_lambda':
        advantage = common.td_lambda(gamma, 1, lambda_)(rewards, rewards, values, dones, live)
        return (advantage + values[:, :-1])[0]
    # Monte-Carlo returns to the episode's end, or the block's (bootstrapped).
    returns = common.discounted_returns(rewards.at[:, -1].set(values[:, -1]),
                                        gamma * (1.0 - dones))
    advantage = common.monte_carlo(gamma, 1)(rewards, returns, values, dones, live)
    return (advantage + jnp.where(dones, 0.0, values)[:, :-1])[0]


def value_loss(predicted, target, smoothl1loss):
    """Huber (delta 1) or L2 between predicted Q(s, a) and the fixed target, [batch]."""
    common.check_args(chex.assert_rank, 'value_loss', 1, predicted=predicted, target=target)
    chex.assert_equal_shape([predicted, target], custom_message='value_loss: predicted, target')
    error = predicted - jax.lax.stop_gradient(target)
    if smoothl1loss:
        return jnp.mean(optax.huber_loss(error, delta=1.0))
    return jnp.mean(error ** 2)  # Trax's L2Loss: mean squared error


def sample_indices(key, count, shape):
    """Uniform (block, row) pairs over the valid rows of every replay block."""
    common.check_args(chex.assert_rank, 'sample_indices', 1, count=count)
    common.check_args(chex.assert_type, 'sample_indices', int, count=count)
    ends = jnp.cumsum(count)
    flat = jax.random.randint(key, shape, 0, ends[-1])
    block = jnp.searchsorted(ends, flat, side='right', method='compare_all')
    return block, flat - (ends - count)[block]


# ---------------------------------------------------------------------------
# The phases: pure functions of (spec, hp, state), where hp holds the run's
# traced hyperparameters; then make_agent, which binds the spec to them.
# ---------------------------------------------------------------------------


def value_scale(spec, hp):
    """Network output * scale = Q (Trax's scale_value_targets)."""
    return 1.0 / (1.0 - hp['gamma']) if spec.config.scale_value_targets else 1.0


def q_values(spec, params, obs, hp):
    return common.network(params, obs, spec.obs_shape) * value_scale(spec, hp)


def replay_targets(spec, hp, params, target_params, replay):
    """Every replay row's estimator target [n_replay_epochs, block_size]: the
    value of each next observation by the target net (its own argmax, or the
    online net's for double DQN), then slice_targets over each env's slice
    of each block. Unfilled blocks give targets that are never sampled."""
    q_target = q_values(spec, target_params, replay.bootstrap_obs, hp)
    q_select = q_values(spec, params, replay.bootstrap_obs, hp) if spec.config.double_dqn \
        else q_target
    best = jnp.argmax(q_select, axis=-1)[..., None]
    next_value = jnp.take_along_axis(q_target, best, axis=-1)[..., 0]
    by_env = lambda x: x.reshape((-1, spec.steps, spec.n_envs))  # [blocks, T, envs]
    per_slice = functools.partial(slice_targets, spec.config.advantage_estimator, hp['gamma'],
                                  hp['lambda_'])
    per_block = jax.vmap(per_slice, in_axes=1, out_axes=1)  # over envs
    targets = jax.vmap(per_block)(by_env(replay.reward_sum), by_env(replay.done),
                                  by_env(replay.bootstrap_discount), by_env(next_value))
    return targets.reshape(next_value.shape)


def optimizer(spec, hp):
    config = spec.config
    schedule = common.multifactor(config.lr_schedule, constant=hp['lr'],
                                  warmup_steps=config.warmup_steps,
                                  total_steps=spec.total_train_steps)
    return optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(lambda s: -schedule(s)))


def epsilon(spec, hp, epoch):
    return exploration_rate(epoch, hp['exploration_constant'], hp['exploration_decay_factor'],
                            spec.config.exploration_steps_per_decay, hp['exploration_minimum'])


def act(spec, noise, params, obs, hp, temperature, eps):
    """temperature 1: epsilon-greedy; 0: greedy; else softmax(Q / T).

    `noise` is uniform [..., 1 + n_actions]: the first number decides whether
    to explore, the others pick the action (the argmax of uniforms is a
    uniform action; that of Gumbel-perturbed Q / T a softmax sample).
    """
    q = q_values(spec, params, obs, hp)
    greedy = jnp.argmax(q, axis=-1)
    if temperature == 0.0:
        return greedy
    if temperature == 1.0:
        random_action = jnp.argmax(noise[..., 1:], axis=-1)
        return jnp.where(noise[..., 0] < eps, random_action, greedy)
    gumbel = -jnp.log(-jnp.log(noise[..., 1:]))
    return jnp.argmax(q / temperature + gumbel, axis=-1)


def action_noise(spec, key, shape):
    # Drawn for a whole rollout in one call, never per step: every random
    # call site compiles into its own code, and on CPU that compile time
    # dominates short runs. tiny keeps the Gumbel transform finite.
    return jax.random.uniform(key, shape + (1 + spec.n_actions,),
                              minval=jnp.finfo(jnp.float32).tiny)


def env_keys(key, steps, count):
    return jax.random.split(key, steps * count).reshape(steps, count, -1)


def env_step(spec, keys, env_state, action, auto_reset=True):
    step = spec.env.step if auto_reset else functools.partial(common.step_first_episode, spec.env)
    return jax.vmap(step, in_axes=(0, 0, 0, None))(keys, env_state, action, spec.env_params)


def env_reset(spec, key, count):
    return jax.vmap(spec.env.reset, in_axes=(0, None))(jax.random.split(key, count),
                                                        spec.env_params)


def init(spec, key, hp):
    config = spec.config
    eval_key, net_key, env_key, key = jax.random.split(key, 4)
    params = common.init_network(net_key, spec.obs_shape, config.hidden_sizes, spec.n_actions,
                                 spec.torso, config.conv_channels, layer_norm=config.layer_norm)
    obs, env_state = env_reset(spec, env_key, spec.n_envs)
    rows = (config.n_replay_epochs, spec.block_size)
    replay = Replay(obs=jnp.zeros(rows + spec.obs_shape, spec.obs_dtype),
                    action=jnp.zeros(rows, jnp.int32),
                    reward_sum=jnp.zeros(rows),
                    bootstrap_obs=jnp.zeros(rows + spec.obs_shape, spec.obs_dtype),
                    bootstrap_discount=jnp.zeros(rows),
                    count=jnp.zeros((config.n_replay_epochs,), jnp.int32))
    if spec.estimator_targets:
        replay = replay._replace(done=jnp.zeros(rows, bool), target=jnp.zeros(rows))
    zero = jnp.zeros((), jnp.int32)
    return State(params=params, target_params=params,
                 opt_state=optimizer(spec, hp).init(params), replay=replay,
                 env_state=env_state, obs=obs, episode_return=jnp.zeros(spec.n_envs), key=key,
                 eval_key=eval_key, epoch=zero, train_step=zero, n_interactions=zero,
                 n_trajectories=zero)


def collect(spec, hp, state):
    """One epoch of epsilon-greedy experience into the replay ring: play, store."""
    eps = epsilon(spec, hp, state.epoch + 1)  # Trax's epochs are 1-based
    key, reset_key, noise_key, env_key = jax.random.split(state.key, 4)
    (obs, env_state, episode_return), records = play(spec, hp, state, eps, reset_key,
                                                     noise_key, env_key)
    replay, new_interactions = store(spec, hp, state.replay, state.epoch, records)
    n_finished = records['finished'].sum()
    metrics = {
        'rl/avg_return': jnp.where(n_finished > 0, records['finished_return'].sum()
                                   / jnp.maximum(n_finished, 1), jnp.nan),
        'rl/n_interactions': state.n_interactions + new_interactions,
        'rl/n_trajectories': state.n_trajectories + n_finished,
        'rl/new_interactions': new_interactions,
        'metrics/exploration_rate': eps,
    }
    state = state._replace(replay=replay, env_state=env_state, obs=obs,
                           episode_return=episode_return, key=key,
                           n_interactions=state.n_interactions + new_interactions,
                           n_trajectories=state.n_trajectories + n_finished)
    return state, metrics


def play(spec, hp, state, eps, reset_key, noise_key, env_key):
    """Playing: `spec.steps` epsilon-greedy steps of every env, on from where the
    last epoch left off (or from fresh episodes). Returns the envs' carry
    (obs, env_state, episode_return) and play_step's records, each [steps, n_envs]."""
    if spec.fresh_episodes:
        obs, env_state = env_reset(spec, reset_key, spec.n_envs)
        episode_return = jnp.zeros(spec.n_envs)
    else:
        obs, env_state, episode_return = state.obs, state.env_state, state.episode_return
    carry = (obs, env_state, episode_return, jnp.ones(spec.n_envs, bool))
    (obs, env_state, episode_return, _), records = jax.lax.scan(
        functools.partial(play_step, spec, hp, state.params, eps), carry,
        (action_noise(spec, noise_key, (spec.steps, spec.n_envs)),
         env_keys(env_key, spec.steps, spec.n_envs)))
    return (obs, env_state, episode_return), records


def play_step(spec, hp, params, eps, carry, xs):
    """One epsilon-greedy step of every env. `active` is False once an env's
    fresh episode has ended (fresh_episodes mode): its later steps are padding."""
    obs, env_state, episode_return, active = carry
    noise, keys = xs
    action = act(spec, noise, params, obs, hp, 1.0, eps)
    next_obs, env_state, reward, terminated, truncated, info = env_step(
        spec, keys, env_state, action, auto_reset=not spec.fresh_episodes)
    done = terminated | truncated
    episode_return = episode_return + reward
    finished = done & active
    record = dict(obs=obs, action=action, reward=reward.astype(jnp.float32),
                  terminated=terminated, done=done, final_obs=info['final_observation'],
                  valid=active, finished=finished,
                  finished_return=jnp.where(finished, episode_return, 0.0))
    episode_return = jnp.where(done, 0.0, episode_return)
    if spec.fresh_episodes:  # each env plays exactly one episode
        active = active & ~done
    return (next_obs, env_state, episode_return, active), record


def store(spec, hp, replay, epoch, records):
    """Storing: the n-step transitions of play's records, as one block, into ring
    slot epoch % n_replay_epochs. Returns the new replay and the block's count
    of valid rows (all of them but fresh_episodes' padding)."""
    # n-step windows per env, over the time axis.
    reward_sum, bootstrap_obs, bootstrap_discount = jax.vmap(
        n_step_transitions, in_axes=(1, 1, 1, 1, None, None), out_axes=1)(
        records['reward'], records['terminated'], records['done'], records['final_obs'],
        hp['gamma'], spec.n_step)
    rows = dict(obs=records['obs'].astype(replay.obs.dtype), action=records['action'],
                reward_sum=reward_sum, bootstrap_discount=bootstrap_discount,
                bootstrap_obs=bootstrap_obs.astype(replay.obs.dtype))
    if spec.estimator_targets:
        rows['done'] = records['done']
    rows = {name: value.reshape((spec.block_size,) + value.shape[2:])
            for name, value in rows.items()}
    valid = records['valid'].reshape(spec.block_size)
    if spec.fresh_episodes:  # move the valid rows to the front of the block
        order = jnp.argsort(~valid, stable=True)
        rows = {name: value[order] for name, value in rows.items()}
    slot = epoch % spec.config.n_replay_epochs
    count = valid.sum()
    replay = replay._replace(**{name: getattr(replay, name).at[slot].set(rows[name])
                                for name in rows}, count=replay.count.at[slot].set(count))
    return replay, count


def loss_fn(spec, params, target_params, batch, hp):
    target = TARGETS[spec.config.advantage_estimator](spec, hp, params, target_params, batch)
    # The loss sees values in network units: Q / scale.
    q = q_values(spec, params, batch['obs'], hp)
    q_taken = jnp.take_along_axis(q, batch['action'][:, None], axis=-1)[:, 0]
    scale = value_scale(spec, hp)
    loss = value_loss(q_taken / scale, target / scale, spec.config.smoothl1loss)
    return loss, {'metrics/value_loss': loss, 'metrics/value_mean': q_taken.mean(),
                  'metrics/returns_mean': target.mean()}


def train_step(spec, hp, state, indices):
    """One gradient step on the replay rows `indices` = (block, row) [batch];
    the target network syncs when the step count reaches a multiple of sync_freq."""
    block, row = indices
    replay = state.replay
    columns = ('obs', 'action', 'target') if spec.estimator_targets else (
        'obs', 'action', 'reward_sum', 'bootstrap_obs', 'bootstrap_discount')
    batch = {name: getattr(replay, name)[block, row] for name in columns}
    grads, metrics = jax.grad(functools.partial(loss_fn, spec), has_aux=True)(
        state.params, state.target_params, batch, hp)
    updates, opt_state = optimizer(spec, hp).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    step = state.train_step + 1
    sync = step % hp['sync_freq'].astype(jnp.int32) == 0
    target_params = jax.tree.map(lambda new, old: jnp.where(sync, new, old),
                                 params, state.target_params)
    return state._replace(params=params, opt_state=opt_state,
                          target_params=target_params, train_step=step), metrics


def train(spec, hp, state):
    """train_steps_per_epoch gradient steps, in evals_per_epoch chunks; first,
    for the estimators, every replay row's target from the target net."""
    config = spec.config
    if spec.estimator_targets:
        replay = state.replay._replace(target=replay_targets(
            spec, hp, state.params, state.target_params, state.replay))
        state = state._replace(replay=replay)
    key, sample_key = jax.random.split(state.key)
    state = state._replace(key=key)
    # The replay does not change while training: sample every batch at once.
    indices = sample_indices(sample_key, state.replay.count,
                             (config.evals_per_epoch, spec.chunk_steps, config.batch_size))

    def chunk(state, chunk_indices):
        state, metrics = jax.lax.scan(lambda s, i: train_step(spec, hp, s, i), state,
                                      chunk_indices)
        return state, jax.tree.map(jnp.mean, metrics)

    state, metrics = jax.lax.scan(chunk, state, indices)
    state = state._replace(epoch=state.epoch + 1)
    return state, jax.tree.map(lambda m: m[-1], metrics)  # the last chunk, as Trax logs


def evaluate(spec, hp, state):
    """Fresh episodes for each (temperature, horizon); never enter the replay.
    The state comes back as it was: evaluating never moves training."""
    if spec.config.n_eval_episodes == 0:
        return state, {}
    tag_keys = jax.random.split(common.evaluation_key(state), 3 * len(spec.eval_tags))
    eps = epsilon(spec, hp, state.epoch)
    metrics = {}
    for i, (temperature, horizon) in enumerate(spec.eval_tags):
        returns = evaluation_returns(spec, hp, state.params, eps, temperature, horizon,
                                     *tag_keys[3 * i:3 * i + 3])
        metrics[common.return_tag(temperature, horizon)] = returns.mean()
    return state, metrics


def evaluation_returns(spec, hp, params, eps, temperature, horizon, reset_key, noise_key,
                       env_key):
    """The return of each of n_eval_episodes fresh episodes, cut at `horizon` steps."""
    count = spec.config.n_eval_episodes
    obs, env_state = env_reset(spec, reset_key, count)
    noise = action_noise(spec, noise_key, (horizon, count)) if temperature else None
    keys = env_keys(env_key, horizon, count)

    def step(loop):
        t, obs, env_state, total, active = loop
        action = act(spec, None if noise is None else noise[t], params, obs, hp,
                     temperature, eps)
        obs, env_state, reward, terminated, truncated, _ = env_step(
            spec, keys[t], env_state, action, auto_reset=False)
        total = total + jnp.where(active, reward, 0.0)
        return t + 1, obs, env_state, total, active & ~(terminated | truncated)

    def running(loop):  # stop once every episode has ended
        t, *_, active = loop
        return (t < horizon) & jnp.any(active)

    _, _, _, total, _ = jax.lax.while_loop(
        running, step, (0, obs, env_state, jnp.zeros(count), jnp.ones(count, bool)))
    return total


def make_agent(config: Config, given=None) -> common.Agent:
    """Check `config` as the command line does (fields.check_grid, then the
    fields that cannot act: fields.check_inert, `given` its fields set by a
    command line), derive its Spec and bind the Spec to DQN's phases."""
    fields.check_grid(config, {}, check_runs)
    env, env_params = common.make_env(config.env, config.max_steps)
    if common.space_kind(env.action_space(env_params)) != 'discrete':
        raise common.UsageError(f'{config.env} has a continuous (Box) action space; DQN '
                                'needs Discrete actions: use pg.py (REINFORCE) or '
                                'actor_critic.py (PPO) for this env')
    max_steps = common.env_max_steps(env_params)
    obs_shape = env.observation_space(env_params).shape
    torso = common.resolve_torso(config.torso, obs_shape)
    if torso == 'conv':
        common.conv_output_shape(obs_shape, config.conv_channels)  # refuses too small
    estimator_targets = TARGETS[config.advantage_estimator] is replayed_target
    n_step = 1 if estimator_targets else config.max_slice_length - 1
    fresh_episodes = bool(config.n_trajectories_per_epoch)
    if fresh_episodes:
        n_envs, steps = config.n_trajectories_per_epoch, max_steps
    else:
        n_envs = config.n_envs
        steps = config.n_interactions_per_epoch // config.n_envs
    check_block_length(n_step, steps)
    env_steps = fields.env_steps_factors(config, n_envs, steps, max_steps)
    # The counters and the replay's row index.
    fields.check_int32_products(fields.step_products(config, env_steps) + [
        ('replay rows', [('--n-replay-epochs', config.n_replay_epochs), *env_steps])])
    fields.check_inert(config, {**fields.shared_inert(config, torso, env_params),
                                **inert_fields(config)}, given)
    spec = Spec(
        config=config, env=env, env_params=env_params, obs_shape=obs_shape,
        obs_dtype=storage_dtype(config, env, env_params), n_actions=env.action_space(env_params).n,
        torso=torso, n_envs=n_envs, steps=steps, block_size=n_envs * steps, n_step=n_step,
        estimator_targets=estimator_targets,
        chunk_steps=config.train_steps_per_epoch // config.evals_per_epoch,
        total_train_steps=(config.lr_decay_epochs or config.epochs) * config.train_steps_per_epoch,
        eval_tags=tuple((t, h) for t in config.eval_temperatures
                        for h in (config.eval_steps or (max_steps,))),
        max_steps=max_steps, fresh_episodes=fresh_episodes)
    return common.Agent(name='dqn', init=functools.partial(init, spec),
                        collect=functools.partial(collect, spec),
                        train=functools.partial(train, spec),
                        evaluate=functools.partial(evaluate, spec),
                        eval_tags=list(spec.eval_tags), max_steps=max_steps,
                        memory_flags='--num-seeds (or the grid), --n-replay-epochs, '
                        '--n-interactions-per-epoch, --batch-size, --train-steps-per-epoch',
                        spec=spec, config=config, check_runs=check_runs, obs_shape=obs_shape)


def storage_dtype(config, env, env_params):
    """Replay dtype of observations: the env's own, except MinAtar's 0/1 channels,
    which gymnax hands out as float32 and which are stored losslessly as bool
    (4x less memory)."""
    if config.env.endswith('-MinAtar'):
        return jnp.bool_
    # The dtype reset returns, found by tracing it (nothing runs).
    obs, _ = jax.eval_shape(lambda: env.reset(jax.random.PRNGKey(0), env_params))
    return obs.dtype


# ---------------------------------------------------------------------------
# Per-env settings: the fields that differ from the generic defaults (the
# CartPole-v1 ones), used when --env names the env and the flag is not given
# (a flag on the command line wins). Why each value: docs/dqn.md.
# ---------------------------------------------------------------------------

# PQN (Gallici et al. 2024, "Simplifying Deep Temporal Difference Learning")
# as DQN settings: its MinAtar recipe, github.com/mttga/purejaxql,
# purejaxql/config/alg/pqn_minatar.yaml: 128 envs x 32 steps an update, then
# 2 passes of 32 minibatches (64 steps of 128) over that rollout alone,
# lambda-returns (lambda 0.65, gamma 0.99) from the network that played it
# (no target network), LayerNorm after the conv and the dense layer, lr 5e-4
# decaying linearly to 0, L2 loss, epsilon 1 -> 0.05 over the first 10% of
# its 1e7 steps, greedy tests on 128 envs. Ours decays epsilon geometrically
# (x 0.9878 an epoch reaches 0.05 at the same epoch, 244 of 2441) and samples
# minibatches with replacement; what else differs, and its command: docs/dqn.md.

PQN_MINATAR = {
    'advantage_estimator': 'td_lambda', 'lambda_': 0.65, 'gamma': 0.99,
    'n_envs': 128, 'n_interactions_per_epoch': 128 * 32, 'epochs': 2441,
    'train_steps_per_epoch': 2 * 32, 'batch_size': 128 * 32 // 32,
    'n_replay_epochs': 1, 'sync_freq': 1, 'double_dqn': False,
    'layer_norm': True, 'conv_channels': (16,), 'hidden_sizes': (128,),
    'lr': 5e-4, 'smoothl1loss': False,  # lr_schedule: the default, constant * linear_decay
    'scale_value_targets': False, 'exploration_constant': 1.0,
    'exploration_decay_factor': 0.9878, 'exploration_minimum': 0.05, 'n_eval_episodes': 128,
}


ENV_SETTINGS = {
    # 1e-2 overshoots on Catch's 50 inputs.
    'Catch-bsuite': {'epochs': 60, 'lr': 3e-3},
    # A return's std is 3 whatever the policy: 32 episodes cannot tell solved from not.
    'UmbrellaChain-bsuite': {'n_eval_episodes': 8192},
    # At gamma 0.99 the five chains' Q-values lie within 0.1: half the nets rank them wrong.
    'DiscountingChain-bsuite': {'gamma': 0.7, 'lr': 3e-3},
    # Sparse goal, slippery moves: 5-step returns, lower gamma, slower epsilon decay.
    'FourRooms-misc': {'epochs': 150, 'max_slice_length': 6, 'lr': 3e-3, 'gamma': 0.95,
                       'exploration_decay_factor': 0.97},
    # Twice the gradient steps per env step and a wider net: -76.4 (defaults: -93).
    'Acrobot-v1': {'epochs': 110, 'train_steps_per_epoch': 256, 'lr': 2e-3,
                   'hidden_sizes': (128, 128)},
    # At gamma 0.99 the nets overrate the risky arm.
    'GaussianBandit-misc': {'gamma': 0.9, 'lr': 3e-3},
    # Sparse: slower epsilon decay and 5-step returns.
    'MountainCar-v0': {'epochs': 100, 'max_slice_length': 6, 'lr': 3e-3,
                       'exploration_decay_factor': 0.97},
    # MinAtar: PQN's recipe at its 1e7 steps (above), the better agent at 10M on
    # Breakout and Freeway; on SpaceInvaders PPO is (actor_critic.py's settings;
    # docs/results.md).
    **{f'{game}-MinAtar': PQN_MINATAR
       for game in ('Asterix', 'Breakout', 'Freeway', 'SpaceInvaders', 'Seaquest')},
}


def check_runs(config: Config, runs):
    """The rules that tie fields together (each field's own constraint is
    fields.check_fields'), on every run's values of the swept ones."""
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
    if not config.conv_channels:
        raise error('--conv-channels needs at least one layer', field='conv_channels')
    if TARGETS[config.advantage_estimator] is replayed_target and \
            config.n_trajectories_per_epoch:
        raise error(f'--advantage-estimator {config.advantage_estimator} needs each env\'s '
                    'steps in order in the replay: use --n-interactions-per-epoch (not '
                    '--n-trajectories-per-epoch, whose blocks keep only the valid rows)',
                    field='advantage_estimator')
    common.schedule_factors(config.lr_schedule)
    for run in runs:
        if run['gamma'] == 1 and config.scale_value_targets:
            raise error('--gamma 1 needs --no-scale-value-targets (scale 1/(1-gamma))',
                        field='gamma')


def inert_fields(config):
    """{field: why it cannot act} of DQN's own fields (fields.check_inert)."""
    if TARGETS[config.advantage_estimator] is not replayed_target:
        return {}
    return {'max_slice_length': f'has no effect with --advantage-estimator '
            f'{config.advantage_estimator}: its targets run over whole slices of one-step '
            'rows (it sets the n of td_k\'s n-step rows)'}


def check_block_length(n_step, steps):
    """An n-step window never reaches past its epoch's block of `steps` steps per
    env, so a longer one would train on exactly the same targets (and unroll
    for nothing): refuse it."""
    if n_step > steps:
        raise common.UsageError(
            f'--max-slice-length must be at most {steps + 1} (an epoch\'s {steps} steps per '
            f'env + 1; n-step windows stop at the end of the block), got {n_step + 1}')


def main(argv=None):
    """The full command line (harness/), or without it fields.plain_main."""
    try:  # `import dqn` alone needs neither
        from harness import cli
    except ImportError as error:  # none, or a project's own `harness` package
        if error.name not in ('harness', 'harness.cli'):
            raise
        return fields.plain_main(Config, make_agent, ENV_SETTINGS, argv)
    return cli.main(Config, make_agent, check_runs, 'dqn.py', __doc__.split('\n\n')[0], argv,
                    env_settings=ENV_SETTINGS)


if __name__ == '__main__':
    sys.exit(0 if main() is not None else 1)
