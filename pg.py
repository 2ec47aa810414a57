"""Policy gradient (REINFORCE) after Trax's `PolicyGradient` (trax/rl/training.py), in pure JAX.

One epoch = collect (temperature 1, gymnax envs) -> train (Monte-Carlo returns
minus the batch's mean return, Trax's `_value_fn`; optional advantage
normalisation) -> evaluation at each (temperature, horizon). Each phase is a
pure function of the state pytree, and so is the whole epoch (`agent.epoch`),
vmapped over runs (seeds x hyperparameter grid) and compiled once; Python only
loops over epochs. Categorical policy for Discrete action spaces, Gaussian
with a learned state-independent log-std for Box ones.

Trax's semantics are all available as flags; the defaults differ where that
makes `python pg.py` solve CartPole-v1 for every seed in 40 epochs (each one
gradient step, as Trax): the batch is every step collected this epoch
(`--batch-size 0`; `--batch-size 64` is Trax's sampling of length-1 slices, a
uniform trajectory then a uniform step), 32 episodes per epoch, gamma 0.995,
Adam without momentum (`--adam-b1 0`: with one step per epoch, momentum keeps
pushing the direction of past policies' gradients and solved runs drift away)
and b2 0.99, and a learning rate 1e-2 decaying linearly to 0 (Trax:
`constant * linear_warmup * rsqrt_decay`).

Episode ends. A time-limit truncation ends an episode like a termination:
REINFORCE has no value to bootstrap from, so a truncated episode's return is
the discounted sum of the rewards it observed (as Trax). With
`--n-interactions-per-epoch`, an episode still running when an epoch's window
closes is not trained on yet: its steps wait (in `State.tail`) and train in the
epoch in which it ends, with its complete Monte-Carlo return.

    python pg.py --seed 0                 # CartPole-v1, greedy return 500
    python pg.py --num-seeds 8            # 8 seeds in one vmapped program
    python pg.py --env Acrobot-v1 --max-steps 1000 --eval-steps 500 --lr 3e-3 --num-seeds 8
    python pg.py --env Pendulum-v1 --gamma 0.95 --epochs 200 --lr 3e-3 --num-seeds 8
"""

import dataclasses
import functools
import math
import sys
from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import common


@dataclasses.dataclass(frozen=True)
class Config:
    env: str = common.option('CartPole-v1', 'gymnax env (Discrete or Box action space)')
    epochs: int = common.option(40, 'total epochs of collect -> train -> evaluate', bounds='[1, inf)')
    n_envs: int = common.option(16, 'parallel envs per run (n_interactions mode)', bounds='[1, inf)')
    n_interactions_per_epoch: Optional[int] = common.option(
        None, 'instead: env steps per epoch and run; episodes carry over epochs and an '
        'unfinished episode\'s steps wait for the epoch in which it ends', bounds='[1, inf)')
    n_trajectories_per_epoch: Optional[int] = common.option(
        32, 'complete fresh episodes per epoch and run (Trax CartPole test: 2)', bounds='[1, inf)')
    max_steps: Optional[int] = common.option(None, 'episode cap (default: the env\'s limit)', bounds='[1, inf)')
    train_steps_per_epoch: int = common.option(
        1, 'gradient steps per epoch on this epoch\'s data (Trax: 1)', bounds='[1, inf)')
    evals_per_epoch: int = common.option(1, 'trainer metric chunks per epoch (reporting only)', bounds='[1, inf)')
    batch_size: int = common.option(
        0, '0: every collected step is the batch; B > 0: Trax\'s B length-1 slices per '
        'step, each from a uniform trajectory, then a uniform step in it (Trax: 64)', bounds='[0, inf)')
    lr: float = common.option(1e-2, 'Adam learning rate: the schedule\'s constant', sweep=True, bounds='(0, inf)')
    lr_schedule: str = common.option(
        'constant * linear_decay',
        'multifactor factors: constant, linear_warmup, rsqrt_decay, decay_every, '
        'linear_decay (to 0 at the last step); Trax: constant * linear_warmup * rsqrt_decay')
    warmup_steps: int = common.option(400, 'linear_warmup / rsqrt_decay steps', bounds='[1, inf)')
    lr_decay_epochs: Optional[int] = common.option(
        None, 'linear_decay reaches 0 after this many epochs (default: --epochs); keep '
        'it when resuming with a larger --epochs so the schedule does not change', bounds='[1, inf)')
    adam_b1: float = common.option(
        0.0, 'Adam first-moment decay (Trax: 0.9); 0: no momentum carried across epochs, '
        'each of which brings a fresh on-policy gradient', sweep=True, bounds='[0, 1)')
    adam_b2: float = common.option(0.99, 'Adam second-moment decay (Trax: 0.999)', sweep=True, bounds='[0, 1)')
    gamma: float = common.option(0.995, 'discount factor in (0, 1] (Trax: 0.99)', sweep=True, bounds='(0, 1]')
    normalize_advantages: bool = common.option(
        True, 'A <- (A - mean A) / (std A + 1e-5) over the batch (Trax: on)')
    entropy_coefficient: float = common.option(
        0.0, 'loss -= this * mean policy entropy (Trax: none, i.e. 0)', sweep=True, bounds='[0, inf)')
    hidden_sizes: tuple[int, ...] = common.option((64, 64), 'policy MLP hidden layer sizes', bounds='[1, inf)')
    init_log_std: float = common.option(
        0.0, 'Box actions: initial log std, in units of half the Box\'s width', sweep=True)
    n_eval_episodes: int = common.option(32, 'episodes per evaluation (0: no evaluation)', bounds='[0, inf)')
    eval_steps: Optional[tuple[int, ...]] = common.option(
        None, 'evaluation horizons, e.g. 200,500 (default: max_steps)', bounds='[1, inf)')
    eval_temperatures: tuple[float, ...] = common.option(
        (0.0,), 'evaluation temperatures: 0 argmax / Gaussian mean, T samples logits / T '
        'or std * T', bounds='[0, inf)')
    checkpoint_every: int = common.option(1, 'epochs between checkpoints (and the last)', bounds='[1, inf)')


class Batch(NamedTuple):
    """The latest epoch's training steps, flat [N]: those with weight 0 are padding
    (after an episode's end, or of an episode not yet finished)."""
    obs: jax.Array
    action: jax.Array
    returns: jax.Array  # Monte-Carlo discounted return from the step to its episode's end
    weight: jax.Array  # 1.0 for a step to train on, else 0.0
    episode_length: jax.Array  # its episode's length in the batch; [0] unless batch_size > 0


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
    batch: Batch
    tail: Optional[Tail]  # None in n_trajectories mode
    env_state: object
    obs: jax.Array
    episode_return: jax.Array  # running undiscounted return of each env
    key: jax.Array
    epoch: jax.Array  # completed epochs
    train_step: jax.Array
    n_interactions: jax.Array
    n_trajectories: jax.Array


# ---------------------------------------------------------------------------
# Pure pieces, importable and tested on their own.
# ---------------------------------------------------------------------------

LOG_2PI = math.log(2 * math.pi)
ROLLOUT_CHUNK = 50  # steps between checks that every episode of a rollout is over


def categorical_log_prob(logits, action):
    """log softmax(logits)[action], over the last axis; `action` is an integer."""
    where = 'categorical_log_prob'
    common.check_args(chex.assert_shape, where, (..., None), logits=logits)
    common.check_args(chex.assert_shape, where, logits.shape[:-1], action=action)
    common.check_args(chex.assert_type, where, int, action=action)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(log_p, action[..., None].astype(jnp.int32), axis=-1)[..., 0]


def categorical_entropy(logits):
    common.check_args(chex.assert_shape, 'categorical_entropy', (..., None), logits=logits)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def categorical_sample(noise, logits, temperature):
    """Trax's Gumbel-max sample argmax(logits + T * gumbel), i.e. a sample of
    softmax(logits / T); T == 0: argmax. `noise` is standard Gumbel, logits' shape."""
    common.check_args(chex.assert_shape, 'categorical_sample', (..., None), logits=logits)
    chex.assert_equal_shape([noise, logits], custom_message='categorical_sample: noise, logits')
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1)
    return jnp.argmax(logits + temperature * noise, axis=-1)


def gaussian_log_prob(mean, log_std, action):
    """log N(action; mean, exp(log_std)^2), summed over the last (action) axis."""
    common.check_args(chex.assert_shape, 'gaussian_log_prob', (..., None), mean=mean)
    chex.assert_equal_shape([mean, log_std, action],
                            custom_message='gaussian_log_prob: mean, log_std, action')
    z = (action - mean) * jnp.exp(-log_std)
    return jnp.sum(-0.5 * z ** 2 - log_std - 0.5 * LOG_2PI, axis=-1)


def gaussian_entropy(log_std):
    common.check_args(chex.assert_shape, 'gaussian_entropy', (..., None), log_std=log_std)
    return jnp.sum(log_std + 0.5 * (LOG_2PI + 1.0), axis=-1)


def gaussian_sample(noise, mean, log_std, temperature):
    """mean + T * std * noise (`noise` standard normal, mean's shape); T == 0: the mean."""
    common.check_args(chex.assert_shape, 'gaussian_sample', (..., None), mean=mean)
    chex.assert_equal_shape([noise, mean, log_std],
                            custom_message='gaussian_sample: noise, mean, log_std')
    if temperature == 0.0:
        return mean
    return mean + temperature * jnp.exp(log_std) * noise


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


def masked_mean(x, weight):
    return jnp.sum(x * weight) / jnp.maximum(jnp.sum(weight), 1e-8)


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
# The agent: policy, collect, train, evaluate.
# ---------------------------------------------------------------------------


def make_agent(config: Config) -> common.Agent:
    """Validate `config` and build the per-run pure functions of REINFORCE."""
    check_config(config)
    env, env_params = common.make_env(config.env, config.max_steps)
    action_space = env.action_space(env_params)
    kind = common.space_kind(action_space)
    max_steps = common.env_max_steps(env_params)
    eval_tags = [(t, h) for t in config.eval_temperatures
                 for h in (config.eval_steps or (max_steps,))]
    obs_shape = tuple(env.observation_space(env_params).shape)
    obs_size = common.flat_obs_size(env, env_params)
    if kind == 'discrete':
        n_outputs, action_shape = int(action_space.n), ()
    else:
        action_shape = tuple(action_space.shape)
        n_outputs = int(np.prod(action_shape))
        low = np.broadcast_to(np.asarray(action_space.low, np.float32), action_shape)
        high = np.broadcast_to(np.asarray(action_space.high, np.float32), action_shape)
        bounded = np.isfinite(low) & np.isfinite(high)
        # The net works in units of half the Box's width around its centre.
        centre = jnp.asarray(np.where(bounded, (low + high) / 2, 0.0).reshape(-1))
        half = jnp.asarray(np.where(bounded, (high - low) / 2, 1.0).reshape(-1))
        low, high = jnp.asarray(low), jnp.asarray(high)
    trajectories = bool(config.n_trajectories_per_epoch)
    if trajectories:
        n_envs, steps = config.n_trajectories_per_epoch, max_steps
        batch_rows, batch_length = n_envs, steps
    else:
        n_envs = config.n_envs
        steps = config.n_interactions_per_epoch // config.n_envs
        batch_rows, batch_length = n_envs, max_steps + steps
    batch_n = batch_rows * batch_length
    chunk_steps = config.train_steps_per_epoch // config.evals_per_epoch
    total_train_steps = (config.lr_decay_epochs or config.epochs) * config.train_steps_per_epoch

    def policy(params, obs):
        """Distribution inputs: logits, or (mean, log_std) in env units."""
        x = obs.reshape(obs.shape[:obs.ndim - len(obs_shape)] + (obs_size,))
        out = common.mlp(params['net'], x.astype(jnp.float32))
        if kind == 'discrete':
            return out
        mean = centre + half * out
        log_std = jnp.broadcast_to(params['log_std'] + jnp.log(half), mean.shape)
        return mean, log_std

    def log_prob_and_entropy(params, obs, action):
        inputs = policy(params, obs)
        if kind == 'discrete':
            return categorical_log_prob(inputs, action), categorical_entropy(inputs)
        mean, log_std = inputs
        flat = action.reshape(action.shape[:action.ndim - len(action_shape)] + (n_outputs,))
        return gaussian_log_prob(mean, log_std, flat), gaussian_entropy(log_std)

    def action_noise(key, shape):
        """Standard Gumbel (discrete) or normal (Box) noise for `shape` actions."""
        if kind == 'discrete':
            return jax.random.gumbel(key, shape + (n_outputs,))
        return jax.random.normal(key, shape + (n_outputs,))

    def act(noise, params, obs, temperature):
        """(action to learn from, action for the env): a Box action is clipped to
        its bounds for the env only; the log-prob is of the sampled action."""
        inputs = policy(params, obs)
        if kind == 'discrete':
            action = categorical_sample(noise, inputs, temperature)
            return action, action
        action = gaussian_sample(noise, *inputs, temperature)
        action = action.reshape(action.shape[:-1] + action_shape)
        return action, jnp.clip(action, low, high)

    def optimizer(hp):
        schedule = common.multifactor(config.lr_schedule, constant=hp['lr'],
                                      warmup_steps=config.warmup_steps,
                                      total_steps=total_train_steps)
        return optax.chain(optax.scale_by_adam(b1=hp['adam_b1'], b2=hp['adam_b2']),
                           optax.scale_by_schedule(lambda s: -schedule(s)))

    def env_step(keys, env_state, action, auto_reset=True):
        step = env.step if auto_reset else functools.partial(common.step_first_episode, env)
        return jax.vmap(step, in_axes=(0, 0, 0, None))(keys, env_state, action, env_params)

    def env_reset(key, count):
        return jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, count), env_params)

    def rollout(key, params, obs, env_state, episode_return, length, temperature, one_episode):
        """`length` steps of `obs.shape[0]` envs; time-major records of each step.
        With `one_episode`, each env plays until its first done (later steps invalid)."""
        count = episode_return.shape[0]

        def step(carry, xs):
            obs, env_state, episode_return, active = carry
            noise, env_keys = xs
            action, env_action = act(noise, params, obs, temperature)
            next_obs, env_state, reward, terminated, truncated, _ = env_step(
                env_keys, env_state, env_action, auto_reset=not one_episode)
            reward = reward.astype(jnp.float32)
            done = terminated | truncated
            episode_return = episode_return + jnp.where(active, reward, 0.0)
            finished = done & active
            record = dict(obs=obs, action=action, reward=reward, done=done, valid=active,
                          finished=finished,
                          finished_return=jnp.where(finished, episode_return, 0.0))
            episode_return = jnp.where(done, 0.0, episode_return)
            if one_episode:
                active = active & ~done
            return (next_obs, env_state, episode_return, active), record

        # All randomness drawn up front in two calls: each random op compiles
        # into its own code, and on CPU that compile time dominates short runs.
        noise_key, env_key = jax.random.split(key)
        carry = (obs, env_state, episode_return, jnp.ones(count, bool))
        if not one_episode:  # episodes continue: every step is needed
            noise = action_noise(noise_key, (length, count))
            env_keys = jax.random.split(env_key, length * count).reshape(length, count, -1)
            return jax.lax.scan(step, carry, (noise, env_keys))
        # One episode per env: play in chunks and stop once every env is done
        # (most of max_steps while the policy is still poor). Records of chunks
        # never played stay zero, i.e. invalid steps.
        chunk = min(length, ROLLOUT_CHUNK)
        n_chunks = -(-length // chunk)
        noise = action_noise(noise_key, (n_chunks, chunk, count))
        env_keys = jax.random.split(env_key, n_chunks * chunk * count).reshape(
            n_chunks, chunk, count, -1)
        in_horizon = (jnp.arange(n_chunks * chunk) < length).reshape(n_chunks, chunk)

        def play_chunk(carry, xs):
            noise, env_keys, in_horizon = xs

            def masked_step(carry, xs):
                *rest, active = carry
                noise, env_keys, ok = xs
                return step((*rest, active & ok), (noise, env_keys))

            return jax.lax.scan(masked_step, carry, (noise, env_keys, in_horizon))

        shapes = jax.eval_shape(play_chunk, carry, (noise[0], env_keys[0], in_horizon[0]))[1]
        records = jax.tree.map(lambda x: jnp.zeros((n_chunks,) + x.shape, x.dtype), shapes)

        def body(loop):
            i, carry, records = loop
            carry, chunk_records = play_chunk(carry, (noise[i], env_keys[i], in_horizon[i]))
            records = jax.tree.map(lambda r, c: r.at[i].set(c), records, chunk_records)
            return i + 1, carry, records

        def more(loop):
            i, (_, _, _, active), _ = loop
            return (i < n_chunks) & jnp.any(active)

        _, carry, records = jax.lax.while_loop(more, body, (0, carry, records))
        records = jax.tree.map(lambda x: x.reshape((n_chunks * chunk,) + x.shape[2:])[:length],
                               records)
        return carry, records

    def empty_batch():
        obs_dtype = jax.eval_shape(lambda k: env.reset(k, env_params)[0],
                                   jax.random.PRNGKey(0)).dtype
        action_dtype = jnp.int32 if kind == 'discrete' else jnp.float32
        return Batch(obs=jnp.zeros((batch_n,) + obs_shape, obs_dtype),
                     action=jnp.zeros((batch_n,) + action_shape, action_dtype),
                     returns=jnp.zeros(batch_n), weight=jnp.zeros(batch_n),
                     episode_length=jnp.ones(batch_n if config.batch_size else 0))

    def init(key, hp):
        net_key, env_key, key = jax.random.split(key, 3)
        params = {'net': common.init_mlp(net_key, [obs_size, *config.hidden_sizes, n_outputs],
                                         last_scale=0.01)}
        if kind == 'box':
            params['log_std'] = jnp.full((n_outputs,), hp['init_log_std'])
        if trajectories:  # collect resets every epoch: placeholders of the right shape
            obs, env_state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                          jax.eval_shape(lambda k: env_reset(k, n_envs), env_key))
        else:
            obs, env_state = env_reset(env_key, n_envs)
        batch = empty_batch()
        tail = None
        if not trajectories:
            tail = Tail(obs=jnp.zeros((n_envs, max_steps) + obs_shape, batch.obs.dtype),
                        action=jnp.zeros((n_envs, max_steps) + action_shape, batch.action.dtype),
                        reward=jnp.zeros((n_envs, max_steps)),
                        valid=jnp.zeros((n_envs, max_steps), bool))
        zero = jnp.zeros((), jnp.int32)
        return State(params=params, opt_state=optimizer(hp).init(params), batch=batch,
                     tail=tail, env_state=env_state, obs=obs, episode_return=jnp.zeros(n_envs),
                     key=key, epoch=zero, train_step=zero, n_interactions=zero,
                     n_trajectories=zero)

    def collect(hp, state):
        """One epoch of temperature-1 experience into `state.batch`."""
        key, reset_key, rollout_key = jax.random.split(state.key, 3)
        if trajectories:
            obs, env_state = env_reset(reset_key, n_envs)
            episode_return = jnp.zeros(n_envs)
        else:
            obs, env_state, episode_return = state.obs, state.env_state, state.episode_return
        (obs, env_state, episode_return, _), rec = rollout(
            rollout_key, state.params, obs, env_state, episode_return, steps, 1.0, trajectories)
        rec = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), rec)  # [n_envs, steps, ...]
        tail = state.tail
        if trajectories:
            # An episode still running at the cap (only if the env's own limit is
            # longer) ends there, truncated.
            done = rec['done'].at[:, -1].set(True)
            data = {name: rec[name] for name in ('obs', 'action', 'reward', 'valid')}
            train_on = data['valid']
        else:
            # Episodes carry over epochs: an episode's steps train in the epoch in
            # which it ends (its full Monte-Carlo return is known only then);
            # until then they wait in `tail`, prepended to the next epoch's steps.
            data = {name: jnp.concatenate([getattr(tail, name), rec[name]], axis=1)
                    for name in ('obs', 'action', 'reward', 'valid')}
            done = jnp.concatenate([jnp.zeros_like(tail.valid), rec['done']], axis=1)
            train_on, waiting = cut_at_last_done(done, data['valid'])
            tail = Tail(**{name: value[:, -max_steps:] for name, value in data.items()
                           if name != 'valid'}, valid=waiting[:, -max_steps:])
        returns = episode_returns(data['reward'], done, data['valid'], hp['gamma'])
        weight = train_on.astype(jnp.float32)
        batch = Batch(obs=data['obs'].reshape((batch_n,) + obs_shape),
                      action=data['action'].reshape((batch_n,) + action_shape),
                      returns=returns.reshape(batch_n), weight=weight.reshape(batch_n),
                      episode_length=segment_lengths(done, weight).reshape(batch_n)
                      if config.batch_size else state.batch.episode_length)

        n_finished = rec['finished'].sum()
        new_interactions = rec['valid'].sum()
        if trajectories:  # an episode cut by the cap counts as finished, truncated
            finished_return = jnp.sum(rec['reward'] * rec['valid'], axis=1)
            n_finished = jnp.asarray(n_envs, n_finished.dtype)
            avg_return = finished_return.mean()
        else:
            avg_return = jnp.where(n_finished > 0, rec['finished_return'].sum()
                                   / jnp.maximum(n_finished, 1), jnp.nan)
        metrics = {
            'rl/avg_return': avg_return,
            'rl/n_interactions': state.n_interactions + new_interactions,
            'rl/n_trajectories': state.n_trajectories + n_finished,
            'rl/new_interactions': new_interactions,
        }
        state = state._replace(batch=batch, tail=tail, env_state=env_state, obs=obs,
                               episode_return=episode_return, key=key,
                               n_interactions=state.n_interactions + new_interactions,
                               n_trajectories=state.n_trajectories + n_finished)
        return state, metrics

    def loss_fn(params, batch, hp):
        log_probs, entropy = log_prob_and_entropy(params, batch.obs, batch.action)
        adv, baseline = advantages(batch.returns, batch.weight, config.normalize_advantages)
        policy_loss = reinforce_loss(log_probs, adv, batch.weight)
        mean_entropy = masked_mean(entropy, batch.weight)
        loss = policy_loss - hp['entropy_coefficient'] * mean_entropy
        raw = batch.returns - baseline
        return loss, {'metrics/policy_loss': policy_loss, 'metrics/entropy': mean_entropy,
                      'metrics/advantage_mean': masked_mean(raw, batch.weight),
                      'metrics/advantage_std': jnp.sqrt(masked_mean(raw ** 2, batch.weight)),
                      'metrics/returns_mean': baseline}

    def train_step(hp, state, key):
        batch = state.batch
        if config.batch_size:
            index = sample_slices(key, batch.weight, batch.episode_length, config.batch_size)
            batch = jax.tree.map(lambda x: x[index], batch)
            batch = batch._replace(weight=(batch.weight > 0).astype(jnp.float32))
        grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params, batch, hp)
        updates, opt_state = optimizer(hp).update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state._replace(params=params, opt_state=opt_state,
                              train_step=state.train_step + 1), metrics

    def train(hp, state):
        """train_steps_per_epoch gradient steps on this epoch's batch, in chunks."""
        key, train_key = jax.random.split(state.key)
        state = state._replace(key=key)

        def chunk(state, chunk_key):
            state, metrics = jax.lax.scan(lambda s, k: train_step(hp, s, k), state,
                                          jax.random.split(chunk_key, chunk_steps))
            return state, jax.tree.map(jnp.mean, metrics)

        state, metrics = jax.lax.scan(chunk, state,
                                      jax.random.split(train_key, config.evals_per_epoch))
        state = state._replace(epoch=state.epoch + 1)
        metrics = jax.tree.map(lambda m: m[-1], metrics)  # the last chunk, as Trax logs
        if kind == 'box':
            metrics['metrics/log_std'] = jnp.mean(state.params['log_std'])
        return state, metrics

    def evaluate(hp, state):
        """Fresh episodes for each (temperature, horizon); never training data."""
        key, eval_key = jax.random.split(state.key)
        metrics = {}
        if config.n_eval_episodes == 0:
            return state._replace(key=key), metrics
        for tag_key, (temperature, horizon) in zip(jax.random.split(eval_key, len(eval_tags)),
                                                   eval_tags):
            reset_key, rollout_key = jax.random.split(tag_key)
            obs, env_state = env_reset(reset_key, config.n_eval_episodes)
            _, rec = rollout(rollout_key, state.params, obs, env_state,
                             jnp.zeros(config.n_eval_episodes), horizon, temperature, True)
            metrics[common.eval_key(temperature, horizon)] = jnp.sum(
                rec['reward'] * rec['valid'], axis=0).mean()
        return state._replace(key=key), metrics

    return common.Agent(name='pg', init=init, collect=collect, train=train, evaluate=evaluate,
                        eval_tags=eval_tags, max_steps=max_steps,
                        memory_flags='--num-seeds (or the grid), --n-trajectories-per-epoch '
                        'or --n-interactions-per-epoch, --max-steps, --batch-size')


def check_config(config: Config):
    """Each field's declared constraint, then the rules that tie fields together."""
    common.check_fields(config)
    error = common.UsageError
    if (config.n_trajectories_per_epoch is None) == (config.n_interactions_per_epoch is None):
        raise error('exactly one of --n-trajectories-per-epoch or --n-interactions-per-epoch '
                    'must be set (the other to none)')
    if config.n_interactions_per_epoch and config.n_interactions_per_epoch % config.n_envs:
        raise error(f'--n-interactions-per-epoch ({config.n_interactions_per_epoch}) must be a '
                    f'multiple of --n-envs ({config.n_envs})')
    if config.train_steps_per_epoch % config.evals_per_epoch:
        raise error(f'--train-steps-per-epoch ({config.train_steps_per_epoch}) must be '
                    f'divisible by --evals-per-epoch ({config.evals_per_epoch})')
    common.multifactor(config.lr_schedule)  # validates the factor names


def check_hyperparameters(config, runs):
    """Cross-field rules on swept values (each value's range: common.check_fields)."""


def main(argv=None):
    return common.main(Config, make_agent, check_hyperparameters, 'pg.py',
                       __doc__.split('\n\n')[0], argv)


if __name__ == '__main__':
    sys.exit(0 if main() is not None else 1)
