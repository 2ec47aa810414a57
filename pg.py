"""Policy gradients after Trax: REINFORCE (`PolicyGradient`, trax/rl/training.py), A2C and PPO (trax/rl/actor_critic.py), in pure JAX.

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

Actor-critic (`--policy-loss a2c` or `ppo`, Trax's
`AdvantageBasedActorCriticAgent`): a value network V(s), separate from the
policy, with its own Adam and learning rate (`--value-lr`), trained first in
each epoch: `--value-train-steps-per-epoch` L2 steps on minibatches of
`--value-batch-size` towards targets V_target(s) + A, where A is the chosen
estimator's advantage (common.py's `monte_carlo`, `td_k`, `td_lambda`, `gae`,
run on Trax's slices of 1 + `--added-policy-slice-length` steps) over a
target copy of the network, synced before the first and after each of
`--value-evals-per-epoch` chunks. Then the policy: advantages from the same
estimator over the trained value network, normalised per minibatch
(`factor * (A - mean) / (std + epsilon)`), and `--train-steps-per-epoch`
steps of the A2C loss `-mean(log pi * A)` or PPO's clipped
`-mean(min(ratio A, clip(ratio, 1 -+ epsilon) A))`, each minus
`--entropy-coeff` times the mean entropy; `--batch-size B` makes them passes
of minibatches of B over the epoch's steps in a fresh random order, 0 uses
them all each step. Every step trains in the epoch it was collected: an
episode still running at the end of the epoch's rows bootstraps from V of its
current observation. A time-limit truncation bootstraps from V of the true
final observation (`info["final_observation"]`), a termination from nothing;
Trax treats both as terminal.

    python pg.py --seed 0                 # CartPole-v1, greedy return 500
    python pg.py --num-seeds 8            # 8 seeds in one vmapped program
    python pg.py --env Pendulum-v1 --num-seeds 8      # the env's settings: PPO
    python pg.py --env Pendulum-v1 --policy-loss reinforce --gamma 0.95 --epochs 200 --lr 3e-3
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


POLICY_LOSSES = ('reinforce', 'a2c', 'ppo')
ESTIMATORS = ('mean_return', 'monte_carlo', 'td_k', 'td_lambda', 'gae')


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
        True, 'A <- (A - mean A) / (std A + 1e-5) over the batch (Trax: on; a2c/ppo: '
        'factor * (A - mean) / (std + epsilon) per minibatch, Trax\'s '
        '--advantage-normalization)', aliases=('--advantage-normalization',))
    entropy_coeff: float = common.option(
        0.0, 'loss -= this * mean policy entropy (Trax: 0.01 for a2c and ppo, none for '
        'reinforce; here 0 for all three, so a flag means the same for each loss)', sweep=True,
        bounds='[0, inf)')
    policy_loss: str = common.option(
        'reinforce', 'reinforce (Trax PolicyGradient), a2c or ppo (Trax A2C, PPO: with a '
        'value network V(s) trained first each epoch, then the policy)', choices=POLICY_LOSSES)
    advantage_estimator: Optional[str] = common.option(
        None, 'mean_return (the batch\'s mean return as baseline, reinforce only), or with '
        'a value network monte_carlo, td_k, td_lambda, gae (default: mean_return for '
        'reinforce, td_lambda for a2c and ppo, as Trax)', choices=ESTIMATORS)
    lambda_: float = common.option(0.95, 'td_lambda / gae lambda (Trax: 0.95)', sweep=True,
                                    bounds='[0, 1]')
    added_policy_slice_length: int = common.option(
        32, 'a2c/ppo: the estimators\' margin, i.e. how many steps past a step its '
        'advantage looks (td_k: k); Trax: 0, with which td_lambda and gae give 0',
        bounds='[0, inf)')
    epsilon: float = common.option(0.2, 'ppo: clip the ratio to [1 - this, 1 + this] '
                                   '(Trax: 0.2)', sweep=True, bounds='(0, inf)')
    advantage_normalization_factor: float = common.option(
        1.0, 'a2c/ppo: normalised advantages are multiplied by this (Trax: 1)', sweep=True)
    advantage_normalization_epsilon: float = common.option(
        1e-5, 'a2c/ppo: (A - mean) / (std + this) (Trax: 1e-5)', sweep=True,
        bounds='(0, inf)')
    max_grad_norm: float = common.option(
        0.0, 'a2c/ppo: clip policy and value gradients to this global norm; 0: off (Trax: '
        'off)', sweep=True, bounds='[0, inf)')
    value_lr: float = common.option(
        1e-3, 'a2c/ppo: value network Adam learning rate, the schedule\'s constant (the '
        'same --lr-schedule factors)', sweep=True,
        bounds='(0, inf)')
    value_batch_size: int = common.option(
        64, 'a2c/ppo: value minibatch (0: every step of the epoch; Trax: 64)',
        bounds='[0, inf)')
    value_train_steps_per_epoch: int = common.option(
        500, 'a2c/ppo: value gradient steps per epoch (Trax: 500)', bounds='[1, inf)')
    value_evals_per_epoch: int = common.option(
        1, 'a2c/ppo: value chunks per epoch; the target value network is synced before '
        'the first and after each (Trax: 1)', bounds='[1, inf)')
    scale_value_targets: bool = common.option(
        False, 'a2c/ppo: the value network predicts V * (1 - gamma) (Trax: off)')
    torso: str = common.option(
        'auto', 'policy (and value) torso: mlp, conv (3x3 convs, ReLU, flatten) or auto '
        '(conv for [height, width, channels] observations, mlp otherwise)',
        choices=common.TORSOS)
    conv_channels: tuple[int, ...] = common.option(
        (16,), 'conv torso: channels of each 3x3 stride-1 conv (MinAtar paper: 16)',
        bounds='[1, inf)')
    hidden_sizes: tuple[int, ...] = common.option(
        (64, 64), 'policy (and value) MLP hidden layer sizes', bounds='[1, inf)')
    normalize_observations: bool = common.option(
        False, 'map each observation dimension whose Box bounds are finite onto [-1, 1] '
        'before the networks (MountainCar\'s velocity spans only +-0.07)')
    init_log_std: float = common.option(
        0.0, 'Box actions: initial log std, in units of half the Box\'s width (gSDE: of '
        'each noise weight)', sweep=True)
    state_dependent_exploration: bool = common.option(
        False, 'Box actions: gSDE (Raffin et al. 2022): the noise is the policy\'s last '
        'hidden features times a random weight matrix held for --sde-sample-freq steps, '
        'so it is smooth in time; off: fresh Gaussian noise every step')
    sde_sample_freq: int = common.option(
        0, 'gSDE: steps between draws of the noise weights (0: one draw per epoch\'s '
        'rollout, as stable-baselines3\'s -1)', bounds='[0, inf)')
    n_eval_episodes: int = common.option(32, 'episodes per evaluation (0: no evaluation)', bounds='[0, inf)')
    eval_steps: Optional[tuple[int, ...]] = common.option(
        None, 'evaluation horizons, e.g. 200,500 (default: max_steps)', bounds='[1, inf)')
    eval_temperatures: tuple[float, ...] = common.option(
        (0.0,), 'evaluation temperatures: 0 argmax / Gaussian mean, T samples logits / T '
        'or std * T', bounds='[0, inf)')
    checkpoint_every: int = common.option(1, 'epochs between checkpoints (and the last)', bounds='[1, inf)')


# Per-env settings: the fields that differ from the generic defaults above (the
# CartPole-v1 REINFORCE ones), used when --env names the env and the flag is
# not given (a flag on the command line wins). An entry is for the
# --policy-loss it names: `--policy-loss reinforce --env Pendulum-v1` uses
# none of Pendulum's PPO entry. The continuous-control envs take PPO with settings from PureJaxRL's and CleanRL's ppo.py: rollouts of 128
# steps in each of 16 envs, GAE (lambda 0.95), clip 0.2, passes of minibatches
# over each rollout, Adam with gradients clipped at global norm 0.5; ours use
# lr 1e-3 for both networks (theirs 2.5e-4 over 5e5 steps), decaying to 0.
PPO = {'policy_loss': 'ppo', 'advantage_estimator': 'gae', 'n_trajectories_per_epoch': None,
       'n_interactions_per_epoch': 2048, 'adam_b1': 0.9, 'adam_b2': 0.999,
       'max_grad_norm': 0.5, 'lr': 1e-3, 'gamma': 0.99}  # value_lr: the default 1e-3
PPO_BATCH_256 = {'train_steps_per_epoch': 32, 'batch_size': 256, 'value_batch_size': 256,
                 'value_train_steps_per_epoch': 32}
# MinAtar (10x10xC grids, the conv torso by --torso auto, dense 128 as the
# MinAtar paper's network): PPO with Trax's entropy bonus 0.01 and PureJaxRL's
# MinAtar rollouts shrunk to a CPU budget of about 5 minutes for 4 seeds: 32
# envs x 128 steps per epoch, 60 epochs (246k steps per seed; PureJaxRL runs
# 1e7). Untuned: a first setting, run once on seeds 0-3 (docs/results.md).
MINATAR = {**PPO, 'hidden_sizes': (128,), 'n_envs': 32, 'n_interactions_per_epoch': 4096,
           'train_steps_per_epoch': 32, 'batch_size': 512, 'value_batch_size': 512,
           'value_train_steps_per_epoch': 32, 'entropy_coeff': 0.01, 'epochs': 60,
           'n_eval_episodes': 8}
DISCRETE = {**PPO, **PPO_BATCH_256, 'epochs': 50}
ENV_SETTINGS = {
    # Swing up and balance: gamma 0.95 (0.99: slower and worse on seeds 0-3).
    'Pendulum-v1': {**PPO, **PPO_BATCH_256, 'gamma': 0.95, 'epochs': 300},
    # The goal pays 100 after hundreds of steps; each step costs 0.1 a^2. Fresh
    # Gaussian noise every step averages out before the car builds a swing,
    # and every run without gSDE learned to stand still (0) or push one way
    # (-100). gSDE's noise is a smooth function of the state, so a random
    # draw of its weights already rocks the car up the hill; observations
    # mapped onto [-1, 1] (the velocity spans +-0.07) give the features a
    # velocity term to draw from. Tuned on seeds 8-11.
    'MountainCarContinuous-v0': {**PPO, **PPO_BATCH_256, 'epochs': 60,
                                 'normalize_observations': True,
                                 'state_dependent_exploration': True, 'sde_sample_freq': 32},
    # Minibatches of 128, 300 epochs (200: -83.7 on seeds 0-7).
    'Acrobot-v1': {**PPO, 'train_steps_per_epoch': 64, 'batch_size': 128,
                   'value_batch_size': 128, 'value_train_steps_per_epoch': 64, 'epochs': 300},
    # The bsuite and misc grids and bandits: REINFORCE's CartPole defaults learn
    # them slowly (Catch 0.66, FourRooms 0.63 on seeds 0-7); this PPO reaches
    # Catch and FourRooms' 1.0, DeepSea's treasure on 5 of 8 seeds, 1.1 on
    # DiscountingChain. Tuned on seeds 8-15. MountainCar-v0 stays REINFORCE:
    # with these settings PPO never reached the flag either (-200 on every
    # seed); dqn.py is the agent for it.
    **{name: DISCRETE for name in ('DeepSea-bsuite', 'MemoryChain-bsuite',
                                   'BernoulliBandit-misc', 'GaussianBandit-misc', 'MetaMaze-misc')},
    'Catch-bsuite': {**DISCRETE, 'epochs': 30},
    'FourRooms-misc': {**DISCRETE, 'epochs': 100},  # 50: 0.99, worst seed 0.94
    # Each step pays a +-1 distractor, so one episode's return has std 3:
    # 8192 evaluation episodes leave a seed's figure std 0.033 (32: 0.53).
    'UmbrellaChain-bsuite': {**DISCRETE, 'epochs': 100, 'n_eval_episodes': 8192},
    # The 1.1 chain pays at once, the others later: gamma 0.99 over 100
    # epochs settled on a 1.0 chain on one seed of 8, 0.9 on none.
    'DiscountingChain-bsuite': {**DISCRETE, 'gamma': 0.9},
    **{name: MINATAR for name in ('Asterix-MinAtar', 'Breakout-MinAtar', 'Freeway-MinAtar',
                                  'SpaceInvaders-MinAtar', 'Seaquest-MinAtar')},
}


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


class Rollout(NamedTuple):
    """a2c/ppo: the epoch's steps as rows [n_envs, steps] (time in order), each
    step trained in the epoch it was collected: with a value network an episode
    still running at the end of the rows bootstraps from V(last_obs)."""
    obs: jax.Array
    action: jax.Array  # as sampled (a Box action unclipped), for its log-prob
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array  # time limit (and not terminated): bootstrap from V(final_obs)
    final_obs: jax.Array  # the observation the step led to, before any auto-reset
    valid: jax.Array  # False: padding after an episode's end (n_trajectories mode)
    last_obs: jax.Array  # [n_envs, ...]: each env's observation after its last step


class State(NamedTuple):
    params: dict
    opt_state: tuple
    batch: Optional[Batch]  # reinforce's training steps; None for a2c/ppo
    tail: Optional[Tail]  # None in n_trajectories mode and for a2c/ppo
    env_state: object
    obs: jax.Array
    episode_return: jax.Array  # running undiscounted return of each env
    key: jax.Array
    epoch: jax.Array  # completed epochs
    train_step: jax.Array
    n_interactions: jax.Array
    n_trajectories: jax.Array
    # a2c/ppo only (None, i.e. no leaves, for reinforce): the value network, its
    # optimiser, the target copy the value targets are computed with, the
    # epoch's rows.
    value_params: Optional[list] = None
    value_opt_state: Optional[tuple] = None
    target_value_params: Optional[list] = None
    value_train_step: Optional[jax.Array] = None
    rollout: Optional[Rollout] = None


# ---------------------------------------------------------------------------
# Pure pieces, importable and tested on their own.
# ---------------------------------------------------------------------------

LOG_2PI = math.log(2 * math.pi)
SDE_VARIANCE_FLOOR = 1e-6  # added to gSDE's variance (stable-baselines3's epsilon)
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


def observation_bounds(space, obs_shape):
    """(centre, half width) of each observation dimension for
    --normalize-observations: (0, 1), i.e. unchanged, where the Box has no
    finite bounds (gymnax writes 'unbounded' as float32's largest value)."""
    low = np.broadcast_to(np.asarray(getattr(space, 'low', -np.inf), np.float64), obs_shape)
    high = np.broadcast_to(np.asarray(getattr(space, 'high', np.inf), np.float64), obs_shape)
    bounded = (np.abs(low) < 1e30) & (np.abs(high) < 1e30) & (high > low)
    low, high = np.where(bounded, low, -1.0), np.where(bounded, high, 1.0)
    centre = np.where(bounded, (low + high) / 2, 0.0).astype(np.float32)
    half = np.where(bounded, (high - low) / 2, 1.0).astype(np.float32)
    return jnp.asarray(centre), jnp.asarray(half)


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
# Actor-critic pieces (Trax actor_critic.py): advantages from common.py's
# estimators over a value network, value targets, the A2C and PPO losses.
# ---------------------------------------------------------------------------

def estimator_name(config):
    """The configured advantage estimator; by default Trax's for the loss:
    PolicyGradient's mean-return baseline, the actor-critics' td_lambda."""
    if config.advantage_estimator is not None:
        return config.advantage_estimator
    return 'mean_return' if config.policy_loss == 'reinforce' else 'td_lambda'


def make_estimator(name, gamma, margin, lambda_):
    """common.py's estimator, built by its Trax factory signature."""
    if name == 'monte_carlo':
        return common.monte_carlo(gamma, margin)
    if name == 'td_k':
        return common.td_k(gamma, margin)
    if name == 'td_lambda':
        return common.td_lambda(gamma, margin, lambda_)
    if name == 'gae':
        return common.gae(gamma, margin, lambda_)
    raise ValueError(f'no value-network estimator {name!r}')


def bootstrapped_rewards(reward, terminated, truncated, final_values, gamma):
    """r_t + gamma * V(final_obs_t) where step t hit the time limit without
    terminating, r_t elsewhere.

    With the truncation's bootstrap folded into its reward, every episode end
    can be a `done` to the estimators (which then never look past it): a
    termination's value is 0 after it, a truncated episode would have gone on.
    Trax treats both as terminal (its `done`), so a CartPole-v1 episode cut at
    500 steps looks like a failure to its value network; here it does not.
    """
    chex.assert_equal_shape([reward, terminated, truncated, final_values])
    bootstrap = truncated & ~terminated
    return reward + jnp.where(bootstrap, gamma * final_values, 0.0)


def step_advantages(estimator, margin, monte_carlo, gamma, reward, done, valid, values,
                    last_value):
    """One env's row of T steps -> each step's advantage [T], from `estimator`
    (built with this `margin`) run on Trax's slices.

    Step t's slice is steps t..t+margin (Trax: `max_slice_length` 1 plus
    `added_policy_slice_length` = margin; the estimator returns its first
    step). A row holds several episodes, and the estimators assume one per
    slice (td_k's k-step sum does not stop at a `done`), so each slice is cut:
    past its episode's end (a `done`, the truncation bootstrap being already in
    `reward`) rewards and values are 0; past the row's last collected step the
    value is V(last_obs) = `last_value` with no discount (discount mask 0,
    i.e. gamma = lambda = 1 there), so the slice bootstraps from it as a
    shorter one would. Monte Carlo's return is the row's discounted return to
    the episode's end, or to the row's end plus V(last_obs).

    reward, values: [T] floats; done, valid: [T] bools; last_value: scalar.
    """
    chex.assert_rank([reward, done, valid, values, last_value], [1, 1, 1, 1, 0])
    chex.assert_equal_shape([reward, done, valid, values])
    length = reward.shape[0]
    done = done & valid
    reward = jnp.where(valid, reward, 0.0)

    def pad(x, fill):  # margin + 1 positions past the row, for the last slices
        return jnp.concatenate([x, jnp.broadcast_to(jnp.asarray(fill, x.dtype), (margin + 1,))])

    returns = common.discounted_returns(  # to the episode's end, else V(last_obs)
        jnp.concatenate([reward, last_value[None]])[None],
        jnp.concatenate([gamma * (1.0 - done.astype(jnp.float32)), jnp.zeros(1)])[None])[0, :length]
    index = jnp.arange(length)[:, None] + jnp.arange(margin + 1)[None, :]  # [T, margin + 1]
    done_w = pad(done, False)[index]
    # `open_`: no episode end before this position of the slice.
    open_ = jnp.cumsum(done_w, axis=1) - done_w == 0
    live = pad(valid, False)[index] & open_  # a collected step of the slice's episode
    rewards = jnp.where(live, pad(reward, 0.0)[index], 0.0)
    slice_values = jnp.where(open_, pad(values, last_value)[index], 0.0)
    slice_returns = jnp.where(live, pad(returns, 0.0)[index], 0.0)
    # Trax's monte_carlo takes `dones` to mark the step after an episode's end;
    # the others, the episode's last step.
    dones = ~live if monte_carlo else done_w & live
    advantages = estimator(rewards, slice_returns, slice_values, dones, live)
    chex.assert_shape(advantages, (length, 1))
    return advantages[:, 0]


def normalized_advantages(adv, weight, factor, epsilon):
    """Trax's `_preprocess_advantages`: factor * (A - mean A) / (std A + epsilon),
    statistics over the weighted steps of the (mini)batch."""
    chex.assert_equal_shape([adv, weight])
    mean = masked_mean(adv, weight)
    std = jnp.sqrt(masked_mean((adv - mean) ** 2, weight))
    return factor * (adv - mean) / (std + epsilon)


def a2c_loss(log_probs, adv, weight):
    """Trax A2C: -sum(w log pi(a|s) A) / sum(w); A is a constant (the entropy
    bonus is subtracted by the caller)."""
    chex.assert_rank(log_probs, 1)
    chex.assert_equal_shape([log_probs, adv, weight])
    return -masked_mean(log_probs * jax.lax.stop_gradient(adv), weight)


def ppo_loss(log_probs, old_log_probs, adv, weight, epsilon):
    """Trax PPO: ratio = pi / pi_old; -mean_w min(ratio A, clip(ratio, 1 - eps,
    1 + eps) A). Where the clipped term is the smaller one its gradient is 0:
    the update stops pushing a ratio already past the clip in A's direction."""
    chex.assert_rank(log_probs, 1)
    chex.assert_equal_shape([log_probs, old_log_probs, adv, weight])
    adv = jax.lax.stop_gradient(adv)
    ratio = jnp.exp(log_probs - jax.lax.stop_gradient(old_log_probs))
    objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon) * adv)
    return -masked_mean(objective, weight)


def value_loss(predictions, targets, weight):
    """Trax's L2Loss: sum(w (V(s) - target)^2) / sum(w); targets are constants."""
    chex.assert_rank(predictions, 1)
    chex.assert_equal_shape([predictions, targets, weight])
    return masked_mean((predictions - jax.lax.stop_gradient(targets)) ** 2, weight)


def pass_order(key, weight, index):
    """Pass `index`'s random order of the steps, the weighted ones first: the
    argsort of uniforms drawn from fold_in(key, index)."""
    noise = jax.random.uniform(jax.random.fold_in(key, index), weight.shape)
    return jnp.argsort(jnp.where(weight > 0, noise, 2.0))


def pass_orders(key, weight, n_passes):
    """[n_passes, N]: pass_order of passes 0..n_passes-1, drawn together once."""
    return jax.vmap(lambda index: pass_order(key, weight, index))(jnp.arange(n_passes))


def minibatch_indices(key, weight, batch_size, step, orders=None):
    """Step `step`'s minibatch of `batch_size` indices: passes over the weighted
    steps, each pass a fresh random order (PPO's epochs of minibatches), so
    every step is used once per pass. A pass whose last minibatch runs past
    the steps wraps to its first ones.

    `orders` (pass_orders, when the number of passes is known before
    training: every step weighted) holds each pass's order; without it each
    minibatch step recomputes its pass's order (a sort of all the steps, so
    costly) rather than storing as many orders as there are steps. Both give
    the same indices.
    """
    chex.assert_rank(weight, 1)
    n_valid = jnp.maximum(jnp.sum(weight > 0), 1)
    per_pass = (n_valid + batch_size - 1) // batch_size
    order = (pass_order(key, weight, step // per_pass) if orders is None
             else orders[step // per_pass])
    return order[((step % per_pass) * batch_size + jnp.arange(batch_size)) % n_valid]


def passes_needed(n_steps, batch_size, n_rows):
    """How many passes n_steps minibatch steps make over n_rows steps, all weighted."""
    per_pass = -(-n_rows // batch_size)
    return -(-n_steps // per_pass)


def clip_by_global_norm(grads, max_norm):
    """grads scaled to global norm <= max_norm; max_norm 0: unchanged (traced)."""
    norm = optax.tree.norm(grads)
    scale = jnp.where(max_norm > 0, jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12)), 1.0)
    return jax.tree.map(lambda g: g * scale, grads)


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
    torso = common.resolve_torso(config.torso, obs_shape)
    if torso == 'conv':
        common.conv_output_shape(obs_shape, config.conv_channels)  # refuses too small
    obs_centre, obs_half = observation_bounds(env.observation_space(env_params), obs_shape)
    sde = config.state_dependent_exploration and kind == 'box'
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
    latent_size = (config.hidden_sizes[-1] if config.hidden_sizes else
                   int(np.prod(common.conv_output_shape(obs_shape, config.conv_channels)
                               if torso == 'conv' else obs_shape)))
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
    actor_critic = config.policy_loss != 'reinforce'
    estimator = estimator_name(config)
    margin = config.added_policy_slice_length
    value_chunk_steps = config.value_train_steps_per_epoch // config.value_evals_per_epoch
    total_value_steps = ((config.lr_decay_epochs or config.epochs)
                         * config.value_train_steps_per_epoch)

    def observe(obs):
        """Observations as both networks take them."""
        x = obs.astype(jnp.float32)
        if config.normalize_observations:
            x = (x - obs_centre) / obs_half
        return x

    def policy_and_features(params, obs):
        """(distribution inputs: logits, or (mean, log_std) in env units; the
        features the policy's last layer reads)."""
        features = common.network_features(params['net'], observe(obs), obs_shape)
        out = common.network_head(params['net'], features)
        if kind == 'discrete':
            return out, features
        mean = centre + half * out
        if sde:
            # gSDE's noise is features @ W, W ~ N(0, exp(log_std)^2) entrywise:
            # given the state that is N(0, features^2 @ exp(2 log_std)) per
            # action dimension. As in gSDE, no gradient reaches the features
            # through the noise's scale.
            variance = jax.lax.stop_gradient(features) ** 2 @ jnp.exp(2.0 * params['log_std'])
            log_std = 0.5 * jnp.log(variance + SDE_VARIANCE_FLOOR) + jnp.log(half)
        else:
            log_std = jnp.broadcast_to(params['log_std'] + jnp.log(half), mean.shape)
        return (mean, log_std), features

    def policy(params, obs):
        return policy_and_features(params, obs)[0]

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

    def rollout_noise(key, length, shape):
        """(gSDE's weight draws or None, per-step noise of `shape` = (steps...,
        count)): action_noise's, or for gSDE each step's index into the draws,
        a fresh draw every sde_sample_freq steps (0: one for the rollout)."""
        if not sde:
            return None, action_noise(key, shape)
        every = config.sde_sample_freq or length
        n_draws = -(-length // every)
        draws = jax.random.normal(key, (n_draws, shape[-1], latent_size, n_outputs))
        steps = int(np.prod(shape[:-1]))
        index = jnp.minimum(jnp.arange(steps) // every, n_draws - 1)
        return draws, jnp.broadcast_to(index.reshape(shape[:-1] + (1,)), shape)

    def act(noise, params, obs, temperature):
        """(action to learn from, action for the env): a Box action is clipped to
        its bounds for the env only; the log-prob is of the sampled action.
        gSDE's `noise` is the standard-normal weights [..., features, actions]."""
        inputs, features = policy_and_features(params, obs)
        if kind == 'discrete':
            action = categorical_sample(noise, inputs, temperature)
            return action, action
        if sde:
            weights = jnp.exp(params['log_std']) * noise
            mean = inputs[0]
            action = mean + temperature * half * jnp.einsum(
                '...f,...fa->...a', jax.lax.stop_gradient(features), weights)
        else:
            action = gaussian_sample(noise, *inputs, temperature)
        action = action.reshape(action.shape[:-1] + action_shape)
        return action, jnp.clip(action, low, high)

    def optimizer(hp):
        schedule = common.multifactor(config.lr_schedule, constant=hp['lr'],
                                      warmup_steps=config.warmup_steps,
                                      total_steps=total_train_steps)
        return optax.chain(optax.scale_by_adam(b1=hp['adam_b1'], b2=hp['adam_b2']),
                           optax.scale_by_schedule(lambda s: -schedule(s)))

    def value_optimizer(hp):
        # Trax gives the value trainer its own optimiser and schedule; Adam
        # with its usual moments (the policy's b1 0 is for one step per epoch).
        schedule = common.multifactor(config.lr_schedule, constant=hp['value_lr'],
                                      warmup_steps=config.warmup_steps,
                                      total_steps=total_value_steps)
        return optax.chain(optax.scale_by_adam(),
                           optax.scale_by_schedule(lambda s: -schedule(s)))

    def value_scale(hp):
        return 1.0 / (1.0 - hp['gamma']) if config.scale_value_targets else 1.0

    def value_net(value_params, obs):
        """The network's output, V / scale, for [..., *obs_shape] observations."""
        return common.network(value_params, observe(obs), obs_shape)[..., 0]

    def env_step(keys, env_state, action, auto_reset=True):
        step = env.step if auto_reset else functools.partial(common.step_first_episode, env)
        return jax.vmap(step, in_axes=(0, 0, 0, None))(keys, env_state, action, env_params)

    def env_reset(key, count):
        return jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, count), env_params)

    def rollout(key, params, obs, env_state, episode_return, length, temperature, one_episode):
        """`length` steps of `obs.shape[0]` envs; time-major records of each step.
        With `one_episode`, each env plays until its first done (later steps invalid)."""
        count = episode_return.shape[0]

        # All randomness drawn up front in two calls: each random op compiles
        # into its own code, and on CPU that compile time dominates short runs.
        noise_key, env_key = jax.random.split(key)
        carry = (obs, env_state, episode_return, jnp.ones(count, bool))
        chunk = min(length, ROLLOUT_CHUNK)
        n_chunks = -(-length // chunk)
        draws, noise = rollout_noise(
            noise_key, length, (length, count) if not one_episode else (n_chunks, chunk, count))

        def step(carry, xs):
            obs, env_state, episode_return, active = carry
            noise, env_keys = xs
            if draws is not None:  # gSDE: this step's weights, per env
                noise = draws[noise, jnp.arange(count)]
            action, env_action = act(noise, params, obs, temperature)
            next_obs, env_state, reward, terminated, truncated, info = env_step(
                env_keys, env_state, env_action, auto_reset=not one_episode)
            reward = reward.astype(jnp.float32)
            done = terminated | truncated
            episode_return = episode_return + jnp.where(active, reward, 0.0)
            finished = done & active
            record = dict(obs=obs, action=action, reward=reward, done=done, valid=active,
                          finished=finished,
                          finished_return=jnp.where(finished, episode_return, 0.0))
            if actor_critic:  # a value network bootstraps a truncation from V(final obs)
                record.update(terminated=terminated, truncated=truncated,
                              final_obs=info['final_observation'])
            episode_return = jnp.where(done, 0.0, episode_return)
            if one_episode:
                active = active & ~done
            return (next_obs, env_state, episode_return, active), record

        if not one_episode:  # episodes continue: every step is needed
            env_keys = jax.random.split(env_key, length * count).reshape(length, count, -1)
            return jax.lax.scan(step, carry, (noise, env_keys))
        # One episode per env: play in chunks and stop once every env is done
        # (most of max_steps while the policy is still poor). Records of chunks
        # never played stay zero, i.e. invalid steps.
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
        params = {'net': common.init_network(net_key, obs_shape, config.hidden_sizes, n_outputs,
                                             torso, config.conv_channels, last_scale=0.01)}
        if kind == 'box':  # gSDE: one log std per noise weight
            params['log_std'] = jnp.full((latent_size, n_outputs) if sde else (n_outputs,),
                                         hp['init_log_std'])
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
        state = State(params=params, opt_state=optimizer(hp).init(params), batch=batch,
                      tail=tail, env_state=env_state, obs=obs, episode_return=jnp.zeros(n_envs),
                      key=key, epoch=zero, train_step=zero, n_interactions=zero,
                      n_trajectories=zero)
        if not actor_critic:
            return state
        # A separate value network (Trax's n_shared_layers 0), its last layer
        # small as the policy's, so early targets are about the rewards' scale.
        value_key, key = jax.random.split(key)
        value_params = common.init_network(value_key, obs_shape, config.hidden_sizes, 1, torso,
                                           config.conv_channels, last_scale=0.01)
        rows = lambda shape, dtype: jnp.zeros((n_envs, steps) + shape, dtype)
        rollout = Rollout(obs=rows(obs_shape, batch.obs.dtype),
                          action=rows(action_shape, batch.action.dtype),
                          reward=rows((), jnp.float32), terminated=rows((), bool),
                          truncated=rows((), bool), final_obs=rows(obs_shape, batch.obs.dtype),
                          valid=rows((), bool),
                          last_obs=jnp.zeros((n_envs,) + obs_shape, batch.obs.dtype))
        return state._replace(batch=None, tail=None, key=key, value_params=value_params,
                              value_opt_state=value_optimizer(hp).init(value_params),
                              target_value_params=value_params, value_train_step=zero,
                              rollout=rollout)

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
        batch = None
        if actor_critic:
            # Every step trains now: an episode still running at the end of its
            # row bootstraps from V(obs), so none waits for a later epoch. An
            # episode cut by the row's end in n_trajectories mode (only if the
            # env's own limit is longer) is truncated there.
            truncated = rec['truncated']
            if trajectories:
                truncated = truncated.at[:, -1].set(rec['valid'][:, -1] & ~rec['done'][:, -1])
            rollout_rows = Rollout(obs=rec['obs'], action=rec['action'], reward=rec['reward'],
                                   terminated=rec['terminated'] & rec['valid'],
                                   truncated=truncated & rec['valid'], final_obs=rec['final_obs'],
                                   valid=rec['valid'], last_obs=obs)
        elif trajectories:
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
        if not actor_critic:
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
        if actor_critic:
            state = state._replace(rollout=rollout_rows)
        return state, metrics

    def loss_fn(params, batch, hp):
        log_probs, entropy = log_prob_and_entropy(params, batch.obs, batch.action)
        adv, baseline = advantages(batch.returns, batch.weight, config.normalize_advantages)
        policy_loss = reinforce_loss(log_probs, adv, batch.weight)
        mean_entropy = masked_mean(entropy, batch.weight)
        loss = policy_loss - hp['entropy_coeff'] * mean_entropy
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

    # -- a2c / ppo: Trax's AdvantageBasedActorCriticAgent.train_epoch --------

    def flat(x):  # [n_envs, steps, ...] rows -> [n_envs * steps, ...] steps
        return x.reshape((-1,) + x.shape[2:])

    def minibatch_orders(key, weight, n_steps, batch_size):
        """Every pass's order up front where every step is weighted (the
        n_interactions mode), so its minibatch steps sort nothing; None otherwise."""
        if trajectories or not batch_size:
            return None
        return pass_orders(key, weight, passes_needed(n_steps, batch_size, weight.shape[0]))

    def ac_advantages(hp, value_params, rollout):
        """(advantages, values), each [n_envs, steps]: the estimator over the
        value network `value_params`, one env's row at a time."""
        scale = value_scale(hp)
        values = scale * value_net(value_params, rollout.obs)
        final_values = scale * value_net(value_params, rollout.final_obs)
        last_values = scale * value_net(value_params, rollout.last_obs)
        reward = bootstrapped_rewards(rollout.reward, rollout.terminated, rollout.truncated,
                                      final_values, hp['gamma'])
        done = rollout.terminated | rollout.truncated
        row_advantages = functools.partial(
            step_advantages, make_estimator(estimator, hp['gamma'], margin, hp['lambda_']),
            margin, estimator == 'monte_carlo', hp['gamma'])
        adv = jax.vmap(row_advantages)(reward, done, rollout.valid, values, last_values)
        return adv, values

    def value_chunk(hp, state, key):
        """One value trainer chunk: targets V_target(s) + A from the target
        network (fixed through the chunk), value_chunk_steps steps of L2 on
        target / scale, then the target network is synced to the trained one."""
        adv, values = ac_advantages(hp, state.target_value_params, state.rollout)
        weight = flat(state.rollout.valid).astype(jnp.float32)
        obs, targets = flat(state.rollout.obs), flat(values + adv) / value_scale(hp)

        orders = minibatch_orders(key, weight, value_chunk_steps, config.value_batch_size)

        def step(carry, i):
            value_params, opt_state, n = carry
            batch_obs, batch_targets, batch_weight = obs, targets, weight
            if config.value_batch_size:
                index = minibatch_indices(key, weight, config.value_batch_size, i, orders)
                batch_obs, batch_targets, batch_weight = obs[index], targets[index], weight[index]
            loss, grads = jax.value_and_grad(
                lambda p: value_loss(value_net(p, batch_obs), batch_targets, batch_weight))(
                    value_params)
            grads = clip_by_global_norm(grads, hp['max_grad_norm'])
            updates, opt_state = value_optimizer(hp).update(grads, opt_state, value_params)
            return (optax.apply_updates(value_params, updates), opt_state, n + 1), loss

        (value_params, opt_state, n), losses = jax.lax.scan(
            step, (state.value_params, state.value_opt_state, state.value_train_step),
            jnp.arange(value_chunk_steps))
        metrics = {'metrics/value_loss': losses.mean(),
                   'metrics/value_mean': masked_mean(flat(values), weight),
                   'metrics/returns_mean': masked_mean(targets * value_scale(hp), weight)}
        return state._replace(value_params=value_params, value_opt_state=opt_state,
                              value_train_step=n, target_value_params=value_params), metrics

    def ac_policy_loss(params, batch, hp):
        obs, action, adv, old_log_probs, weight = batch
        log_probs, entropy = log_prob_and_entropy(params, obs, action)
        if config.normalize_advantages:  # per minibatch, as Trax's policy loss layer
            adv = normalized_advantages(adv, weight, hp['advantage_normalization_factor'],
                                        hp['advantage_normalization_epsilon'])
        metrics = {}
        if config.policy_loss == 'ppo':
            policy_loss = ppo_loss(log_probs, old_log_probs, adv, weight, hp['epsilon'])
            ratio = jnp.exp(log_probs - old_log_probs)
            metrics['metrics/clip_fraction'] = masked_mean(
                (jnp.abs(ratio - 1.0) > hp['epsilon']).astype(jnp.float32), weight)
            metrics['metrics/approx_kl'] = masked_mean(old_log_probs - log_probs, weight)
        else:
            policy_loss = a2c_loss(log_probs, adv, weight)
        mean_entropy = masked_mean(entropy, weight)
        metrics.update({'metrics/policy_loss': policy_loss, 'metrics/entropy': mean_entropy})
        return policy_loss - hp['entropy_coeff'] * mean_entropy, metrics

    def ac_policy_chunks(hp, state, key):
        """train_steps_per_epoch policy steps (evals_per_epoch chunks) on the
        epoch's steps, advantages from the value network just trained."""
        adv, _ = ac_advantages(hp, state.value_params, state.rollout)
        weight = flat(state.rollout.valid).astype(jnp.float32)
        obs, action, adv = flat(state.rollout.obs), flat(state.rollout.action), flat(adv)
        # The collecting policy's log-probs (Trax keeps its dist_inputs in the
        # trajectory): the policy has not changed since it collected.
        old_log_probs = jax.lax.stop_gradient(log_prob_and_entropy(state.params, obs, action)[0])
        data = (obs, action, adv, old_log_probs, weight)
        raw = {'metrics/advantage_mean': masked_mean(adv, weight),
               'metrics/advantage_std': jnp.sqrt(masked_mean(
                   (adv - masked_mean(adv, weight)) ** 2, weight))}

        orders = minibatch_orders(key, weight, config.train_steps_per_epoch, config.batch_size)

        def step(state, i):
            batch = data
            if config.batch_size:
                index = minibatch_indices(key, weight, config.batch_size, i, orders)
                batch = jax.tree.map(lambda x: x[index], data)
            grads, metrics = jax.grad(ac_policy_loss, has_aux=True)(state.params, batch, hp)
            grads = clip_by_global_norm(grads, hp['max_grad_norm'])
            updates, opt_state = optimizer(hp).update(grads, state.opt_state, state.params)
            return state._replace(params=optax.apply_updates(state.params, updates),
                                  opt_state=opt_state, train_step=state.train_step + 1), metrics

        def chunk(state, steps):
            state, metrics = jax.lax.scan(step, state, steps)
            return state, jax.tree.map(jnp.mean, metrics)

        steps = jnp.arange(config.train_steps_per_epoch).reshape(config.evals_per_epoch,
                                                                  chunk_steps)
        state, metrics = jax.lax.scan(chunk, state, steps)
        return state, {**jax.tree.map(lambda m: m[-1], metrics), **raw}

    def train_ac(hp, state):
        """Value training first, then the policy (Trax's order)."""
        key, value_key, policy_key = jax.random.split(state.key, 3)
        # Trax syncs the target network before value training, too.
        state = state._replace(key=key, target_value_params=state.value_params)
        state, value_metrics = jax.lax.scan(
            lambda s, k: value_chunk(hp, s, k), state,
            jax.random.split(value_key, config.value_evals_per_epoch))
        state, metrics = ac_policy_chunks(hp, state, policy_key)
        state = state._replace(epoch=state.epoch + 1)
        metrics.update(jax.tree.map(lambda m: m[-1], value_metrics))  # the last chunk's
        if kind == 'box':
            metrics['metrics/log_std'] = jnp.mean(state.params['log_std'])
        return state, metrics

    agent = common.Agent(name='pg', init=init, collect=collect,
                         train=train_ac if actor_critic else train, evaluate=evaluate,
                         eval_tags=eval_tags, max_steps=max_steps,
                         memory_flags='--num-seeds (or the grid), --n-trajectories-per-epoch '
                         'or --n-interactions-per-epoch, --max-steps, --batch-size')
    # The actor-critic's pieces, for tests: (hp, state[, key]) -> ...
    agent.value_chunk, agent.ac_advantages, agent.value_net = value_chunk, ac_advantages, value_net
    agent.policy, agent.act, agent.observe = policy, act, observe
    return agent


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
    estimator = estimator_name(config)
    if config.policy_loss == 'reinforce' and estimator != 'mean_return':
        raise error(f'--advantage-estimator {estimator} needs a value network: use it with '
                    '--policy-loss a2c or ppo (reinforce takes mean_return)')
    if config.policy_loss != 'reinforce' and estimator == 'mean_return':
        raise error(f'--policy-loss {config.policy_loss} trains a value network: its '
                    '--advantage-estimator is one of monte_carlo, td_k, td_lambda, gae')
    if estimator in ('td_k', 'td_lambda', 'gae') and config.added_policy_slice_length < 1:
        raise error(f'--advantage-estimator {estimator} needs --added-policy-slice-length >= 1 '
                    '(with 0 it looks no step ahead: td_k has no k, td_lambda and gae give 0)')
    if config.value_train_steps_per_epoch % config.value_evals_per_epoch:
        raise error(f'--value-train-steps-per-epoch ({config.value_train_steps_per_epoch}) must '
                    f'be divisible by --value-evals-per-epoch ({config.value_evals_per_epoch})')


def check_hyperparameters(config, runs):
    """Cross-field rules on swept values (each value's range: common.check_fields)."""
    for run in runs:
        if config.scale_value_targets and run['gamma'] == 1:
            raise common.UsageError('--scale-value-targets divides by 1 - gamma: it needs '
                                    '--gamma < 1')


def main(argv=None):
    from harness import cli  # the command line; `import pg` alone does not need it
    return cli.main(Config, make_agent, check_hyperparameters, 'pg.py',
                       __doc__.split('\n\n')[0], argv, env_settings=ENV_SETTINGS,
                       settings_mode_field='policy_loss')


if __name__ == '__main__':
    sys.exit(0 if main() is not None else 1)
