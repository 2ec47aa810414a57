"""A2C, PPO and AWR after Trax's actor_critic.py (`AdvantageBasedActorCriticAgent`), in pure JAX.

One epoch = collect (temperature 1, gymnax envs, rows of steps per env) ->
train -> evaluation at each (temperature, horizon). Training follows Trax's
order: first a value network V(s), separate from the policy, with its own
Adam (`--value-lr`), trained towards V_target(s) + A on minibatches, A being
the chosen estimator's advantage (common.py's `monte_carlo`, `td_k`,
`td_lambda`, `gae`) over a target copy synced before the first and after each
of `--value-evals-per-epoch` chunks; then the policy, on advantages from the
trained value network normalised per minibatch, with the A2C loss
`-mean(log pi * A)`, PPO's clipped ratio or AWR's
`-mean(log pi * min(exp(A / beta), w_max))`, minus `--entropy-coeff` times the
entropy, over passes of minibatches. A2C and PPO train on the epoch's steps;
AWR, off-policy, on the last `--n-replay-epochs` epochs' (Trax's replay), each
epoch's rows kept as collected and their advantages recomputed with the
current value network. An episode still running at the end of its row
bootstraps from V of its current observation, a time-limit truncation from V
of the true final observation, a termination from nothing.

The defaults are PPO's (GAE, 2048 steps per epoch from 16 envs, minibatch
passes, Adam 0.9/0.999, gradients clipped at norm 0.5): `python
actor_critic.py` solves CartPole-v1. `--policy-loss a2c` and `--policy-loss
awr` bring their own settings (A2C_SETTINGS, AWR_SETTINGS, listed by
`--policy-loss a2c --help`).
Trax's values are in each flag's help; history and tuning notes are in
docs/actor_critic.md.

    python actor_critic.py --num-seeds 8              # CartPole-v1, greedy 500
    python actor_critic.py --env Pendulum-v1 --num-seeds 8    # the env's settings
    python actor_critic.py --policy-loss awr --num-seeds 8    # AWR's settings
    python actor_critic.py --policy-loss a2c --num-seeds 8    # A2C's settings
"""

if __name__ == '__main__':  # a Ctrl-C during the imports: held for main's one line
    try:
        __import__('harness.early_signals')
    except ImportError:  # copied without harness/: fields.plain_main runs it
        pass

import contextlib
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


ESTIMATORS = ('monte_carlo', 'td_k', 'td_lambda', 'gae')


# ---------------------------------------------------------------------------
# The policy objectives: --policy-loss NAME picks POLICY_OBJECTIVES[NAME], a
# pure function (log_probs, old_log_probs, adv, weight, hp) -> (loss to
# minimise, metrics) over a minibatch (steps [N] or sequences [B, L]): adv is
# the advantage (normalised if asked), old_log_probs the collecting policy's
# (zeros for AWR, which replays), weight 0 on padding, hp the run's traced
# hyperparameters. The entropy bonus is subtracted around it. A new objective
# is one function and one entry (docs/actor_critic.md: a KL penalty).
# ---------------------------------------------------------------------------


def a2c_objective(log_probs, old_log_probs, adv, weight, hp):
    return a2c_loss(log_probs, adv, weight), {}


def ppo_objective(log_probs, old_log_probs, adv, weight, hp):
    """PPO's clipped ratio, with how many ratios were clipped and the KL estimate."""
    ratio = jnp.exp(log_probs - old_log_probs)
    return ppo_loss(log_probs, old_log_probs, adv, weight, hp['epsilon']), {
        'metrics/clip_fraction': masked_mean(
            (jnp.abs(ratio - 1.0) > hp['epsilon']).astype(jnp.float32), weight),
        'metrics/approx_kl': masked_mean(old_log_probs - log_probs, weight)}


def awr_objective(log_probs, old_log_probs, adv, weight, hp):
    return awr_loss(log_probs, adv, weight, hp['beta'], hp['w_max']), awr_metrics(
        awr_weights(adv, hp['beta'], hp['w_max']), weight)


POLICY_OBJECTIVES = {'a2c': a2c_objective, 'ppo': ppo_objective, 'awr': awr_objective}
OFF_POLICY = ('awr',)  # objectives that take no old_log_probs: they train on a replay
VALUE_UNDER_JOINT = ('under it the value network trains in the policy\'s steps (--batch-size, '
                     '--train-steps-per-epoch)')


@dataclasses.dataclass(frozen=True)
class Config:
    env: str = fields.option('CartPole-v1', 'gymnax env (Discrete or Box action space)')
    epochs: int = fields.option(100, 'total epochs of collect -> train -> evaluate', bounds='[1, inf)')
    n_envs: int = fields.option(16, 'parallel envs per run (n_interactions mode)', bounds='[1, inf)')
    n_interactions_per_epoch: Optional[int] = fields.option(
        2048, 'env steps per epoch and run; episodes carry over epochs', bounds='[1, inf)')
    n_trajectories_per_epoch: Optional[int] = fields.option(
        None, 'instead: complete fresh episodes per epoch and run', bounds='[1, inf)')
    max_steps: Optional[int] = fields.option(None, 'episode cap (default: the env\'s limit)', bounds='[1, inf)')
    train_steps_per_epoch: int = fields.option(
        64, 'policy gradient steps per epoch on this epoch\'s data (Trax: 1)', bounds='[1, inf)')
    evals_per_epoch: int = fields.option(1, 'trainer metric chunks per epoch (reporting only)', bounds='[1, inf)')
    batch_size: int = fields.option(
        128, 'policy minibatch: passes of minibatches over the epoch\'s steps, each pass in '
        'a fresh random order; 0: every step each step', bounds='[0, inf)')
    lr: float = fields.option(1e-3, 'policy Adam learning rate: the schedule\'s constant', sweep=True, bounds='(0, inf)')
    lr_schedule: str = fields.option(
        'constant * linear_decay',
        'multifactor factors: constant, linear_warmup, rsqrt_decay, decay_every, '
        'linear_decay (to 0 at the last step); Trax: constant * linear_warmup * rsqrt_decay')
    warmup_steps: int = fields.option(400, 'linear_warmup / rsqrt_decay steps', bounds='[1, inf)')
    lr_decay_epochs: Optional[int] = fields.option(
        None, 'linear_decay reaches 0 after this many epochs (default: --epochs); keep '
        'it when resuming with a larger --epochs so the schedule does not change', bounds='[1, inf)')
    adam_b1: float = fields.option(0.9, 'policy Adam first-moment decay (Trax: 0.9)', sweep=True, bounds='[0, 1)')
    adam_b2: float = fields.option(0.999, 'policy Adam second-moment decay (Trax: 0.999)', sweep=True, bounds='[0, 1)')
    adam_eps: float = fields.option(
        1e-8, 'policy and value Adam epsilon (Trax, PureJaxRL: 1e-5)', sweep=True,
        bounds='(0, inf)')
    gamma: float = fields.option(0.99, 'discount factor in (0, 1] (Trax: 0.99)', sweep=True, bounds='(0, 1]')
    normalize_advantages: bool = fields.option(
        True, 'factor * (A - mean) / (std + epsilon) per minibatch (Trax: on)',
        aliases=('--advantage-normalization',))
    entropy_coeff: float = fields.option(
        0.01, 'loss -= this * mean policy entropy (Trax: 0.01)', sweep=True, bounds='[0, inf)')
    policy_loss: str = fields.option(
        'ppo', 'a2c, ppo or awr (Trax A2C, PPO, AWR); REINFORCE is pg.py. a2c and awr '
        'bring their own settings (--policy-loss a2c --help lists them); '
        'actor_critic.POLICY_OBJECTIVES holds them', choices=POLICY_OBJECTIVES)
    n_replay_epochs: int = fields.option(
        1, 'the value and policy passes train on the last this many epochs\' steps (Trax: 1; '
        'more only for the off-policy awr, as Trax asserts)', bounds='[1, inf)')
    advantage_estimator: str = fields.option(
        'gae', 'monte_carlo, td_k, td_lambda or gae over the value network (Trax: td_lambda)',
        choices=ESTIMATORS)
    lambda_: float = fields.option(0.95, 'td_lambda\'s and gae\'s lambda (Trax: 0.95)',
                                   sweep=True, bounds='[0, 1]',
                                   acts_with=('advantage_estimator', ('td_lambda', 'gae')))
    added_policy_slice_length: int = fields.option(
        32, 'the estimators\' margin: how many steps past a step its advantage looks '
        '(td_k: k); at least the rows\' length, gae and td_lambda run over the whole row '
        'in one pass; Trax: 0, with which td_lambda and gae give 0', bounds='[0, inf)')
    epsilon: float = fields.option(0.2, 'clip the ratio to [1 - this, 1 + this] (Trax: 0.2)',
                                   sweep=True, bounds='(0, inf)',
                                   acts_with=('policy_loss', ('ppo',)))
    beta: float = fields.option(
        1.0, 'the temperature of the weights exp(A / beta), A normalised (Trax: 1)',
        sweep=True, bounds='(0, inf)', aliases=('--awr-beta',),
        acts_with=('policy_loss', ('awr',)))
    w_max: float = fields.option(
        20.0, 'each weight is capped at this (Trax: 20)', sweep=True, bounds='(0, inf)',
        aliases=('--awr-max-weight',), acts_with=('policy_loss', ('awr',)))
    advantage_normalization_factor: float = fields.option(
        1.0, 'normalised advantages are multiplied by this (Trax: 1)', sweep=True)
    advantage_normalization_epsilon: float = fields.option(
        1e-5, '(A - mean) / (std + this) (Trax: 1e-5)', sweep=True, bounds='(0, inf)')
    max_grad_norm: float = fields.option(
        0.5, 'clip policy and value gradients to this global norm; 0: off (Trax: off)',
        sweep=True, bounds='[0, inf)')
    value_lr: float = fields.option(
        1e-3, 'value network Adam learning rate (the same --lr-schedule factors)', sweep=True,
        bounds='(0, inf)', acts_with=('joint', (False,), 'under it one Adam at --lr trains both'))
    value_batch_size: int = fields.option(
        128, 'value minibatch (0: every step of the epoch; Trax: 64)', bounds='[0, inf)',
        acts_with=('joint', (False,), VALUE_UNDER_JOINT))
    value_train_steps_per_epoch: int = fields.option(
        64, 'value gradient steps per epoch (Trax: 500)', bounds='[1, inf)',
        acts_with=('joint', (False,), VALUE_UNDER_JOINT))
    value_evals_per_epoch: int = fields.option(
        1, 'value chunks per epoch; the target value network is synced before the first '
        'and after each (Trax: 1)', bounds='[1, inf)',
        acts_with=('joint', (False,), VALUE_UNDER_JOINT))
    scale_value_targets: bool = fields.option(
        False, 'the value network predicts V * (1 - gamma) (Trax: off)')
    joint: bool = fields.option(
        False, 'one loss, one Adam (--lr), one step per minibatch: the policy objective + '
        '--value-loss-coeff x the value loss - the entropy bonus (Trax\'s ActorCriticJointAgent; '
        'PureJaxRL); the value network\'s own --value-* steps and optimiser are gone')
    shared_torso: bool = fields.option(
        False, 'the policy and value heads share one torso (Trax\'s joint model); without '
        'it each has its own (PureJaxRL, CleanRL)',
        acts_with=('joint', (True,), 'separate losses need separate networks'))
    value_loss_coeff: float = fields.option(
        0.5, 'the value loss\'s weight in the combined loss (Trax\'s PPOJoint: 0.1; '
        'PureJaxRL: 0.5 on half the squared error)', sweep=True, bounds='[0, inf)',
        acts_with=('joint', (True,)))
    torso: str = fields.option(
        'auto', 'policy and value torso: mlp, conv (3x3 convs, ReLU, flatten), auto (conv '
        'for [height, width, channels] observations, mlp otherwise) or gru: auto\'s layers, '
        'then a GRU whose state carries through each episode; it trains on sequences of '
        '--max-slice-length steps from the state stored at their first step',
        choices=policies.TORSOS)
    gru_size: int = fields.option(64, 'the GRU\'s state size', bounds='[1, inf)',
                                  acts_with=('torso', ('gru',)))
    max_slice_length: Optional[int] = fields.option(
        None, 'steps per training sequence (truncated backpropagation through time; Trax\'s '
        'max_slice_length); must divide the rows\' length and the batch sizes (default: '
        'the rows\' length)', bounds='[1, inf)', acts_with=('torso', ('gru',)))
    conv_channels: tuple[int, ...] = fields.option(
        (16,), 'conv torso: channels of each 3x3 stride-1 conv (MinAtar paper: 16)',
        bounds='[1, inf)')
    hidden_sizes: tuple[int, ...] = fields.option(
        (64, 64), 'policy and value MLP hidden layer sizes', bounds='[1, inf)')
    activation: str = fields.option(
        'relu', 'the hidden layers\' nonlinearity: relu (Trax\'s) or tanh (PureJaxRL\'s PPO)',
        choices=common.ACTIVATIONS)
    init: str = fields.option(
        'glorot', 'weights: glorot (Trax\'s Dense: Glorot-uniform, the heads\' last layer x '
        '0.01) or orthogonal (PureJaxRL\'s PPO, after CleanRL\'s: gain sqrt(2), the policy '
        'head 0.01, the value head 1; the GRU\'s recurrent weights stay Glorot)',
        choices=('glorot', 'orthogonal'))
    clip_value_loss: bool = fields.option(
        False, 'PureJaxRL\'s clipped value loss: max((V - R)^2, (V_old + clip(V - V_old, '
        '-epsilon, epsilon) - R)^2), V_old the value before the epoch\'s steps (Trax: off)')
    normalize_observations: bool = fields.option(
        False, 'map each observation dimension whose Box bounds are finite onto [-1, 1] '
        'before the networks (MountainCar\'s velocity spans only +-0.07)')
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
    n_eval_episodes: int = fields.option(16, 'episodes per evaluation (0: no evaluation)', bounds='[0, inf)')
    eval_steps: Optional[tuple[int, ...]] = fields.option(
        None, 'evaluation horizons, e.g. 200,500 (default: max_steps)', bounds='[1, inf)')
    eval_temperatures: tuple[float, ...] = fields.option(
        (0.0,), 'evaluation temperatures: 0 argmax / Gaussian mean, T samples logits / T '
        'or std * T', bounds='[0, inf)')
    eval_every: Optional[int] = fields.option(
        None, 'epochs between evaluations, and always the last (default: epochs // 20, '
        'about 20 a run); evaluation has its own PRNG stream, so this never changes training',
        bounds='[1, inf)')


class Rollout(NamedTuple):
    """An epoch's steps as rows [n_envs, steps] (time in order): an episode
    still running at the end of its row bootstraps from V(last_obs). In the
    state, the last n_replay_epochs epochs' rollouts stacked, [n_replay_epochs,
    n_envs, steps, ...]."""
    obs: jax.Array
    action: jax.Array  # as sampled (a Box action unclipped), for its log-prob
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array  # time limit (and not terminated): bootstrap from V(final_obs)
    final_obs: jax.Array  # the observation the step led to, before any auto-reset
    valid: jax.Array  # False: padding after an episode's end (n_trajectories mode)
    last_obs: jax.Array  # [n_envs, ...]: each env's observation after its last step
    # --torso gru: {'policy', 'value'}: the GRU state each step started from
    # [n_envs, steps, H], and after the row's last step [n_envs, H]; else {}.
    memory: dict = {}
    last_memory: dict = {}


class State(NamedTuple):
    params: dict  # the policy's
    opt_state: tuple
    env_state: object
    obs: jax.Array
    episode_return: jax.Array  # running undiscounted return of each env
    memory: dict  # --torso gru: each env's GRU states {'policy', 'value': [n_envs, H]}
    # ('policy' alone with --shared-torso); else {}
    key: jax.Array  # the training stream: split at each use
    eval_key: jax.Array  # the evaluation stream's root, never advanced (common.evaluation_key)
    epoch: jax.Array  # completed epochs
    train_step: jax.Array  # policy gradient steps
    n_interactions: jax.Array
    n_trajectories: jax.Array
    # --joint: the value network (with --shared-torso its head alone, on the
    # policy's torso), trained by opt_state with the policy; no value
    # optimiser, target copy or step count of its own (all ()).
    value_params: list
    value_opt_state: tuple
    target_value_params: list  # the copy the value targets are computed with
    value_train_step: jax.Array
    # The replay: the last n_replay_epochs epochs' rollouts, a ring (epoch e
    # in slot e % n_replay_epochs); slots not yet collected are all invalid.
    replay: Rollout


# ---------------------------------------------------------------------------
# Pure pieces: advantages from common.py's estimators over a value network,
# value targets, the A2C and PPO losses, minibatches.
# ---------------------------------------------------------------------------

masked_mean = policies.masked_mean


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


def whole_row_advantages(estimator, reward, done, valid, values, last_value):
    """step_advantages for a lambda estimator (gae, td_lambda) whose margin
    reaches past the row's end from every step (margin >= T): one backward
    pass over the row, O(T) instead of O(T * margin).

    Past the row's end a slice has reward 0, value V(last_obs) and no
    discount, so its lambda recursion returns exactly what it is given there
    (gae: 0, td_lambda: V(last_obs)); a slice's cut at an episode's end is the
    recursion's own `done` (it multiplies the future by 0). So every slice's
    first step is this pass's value at that step, bitwise (tested).
    `estimator` is built with margin 0; inputs as step_advantages'.
    """
    chex.assert_rank([reward, done, valid, values, last_value], [1, 1, 1, 1, 0])
    chex.assert_equal_shape([reward, done, valid, values])

    def row(x, fill):  # one position past the row's end
        return jnp.concatenate([x, jnp.asarray(fill, x.dtype)[None]])[None]

    reward = jnp.where(valid, reward, 0.0)
    advantages = estimator(row(reward, 0.0), jnp.zeros_like(row(values, 0.0)),
                           row(values, last_value), row(done & valid, False), row(valid, False))
    return advantages[0, :reward.shape[0]]


def row_estimator(name, gamma, margin, lambda_, length):
    """One env's row of `length` steps -> each step's advantage: Trax's slices
    (step_advantages), or one pass over the row where that is the same."""
    if name in ('gae', 'td_lambda') and margin >= length:
        return functools.partial(whole_row_advantages, make_estimator(name, gamma, 0, lambda_))
    return functools.partial(step_advantages, make_estimator(name, gamma, margin, lambda_),
                             margin, name == 'monte_carlo', gamma)


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
    chex.assert_rank(log_probs, {1, 2})  # steps [N], or sequences [B, L]
    chex.assert_equal_shape([log_probs, adv, weight])
    return -masked_mean(log_probs * jax.lax.stop_gradient(adv), weight)


def ppo_loss(log_probs, old_log_probs, adv, weight, epsilon):
    """Trax PPO: ratio = pi / pi_old; -mean_w min(ratio A, clip(ratio, 1 - eps,
    1 + eps) A). Where the clipped term is the smaller one its gradient is 0:
    the update stops pushing a ratio already past the clip in A's direction."""
    chex.assert_rank(log_probs, {1, 2})  # steps [N], or sequences [B, L]
    chex.assert_equal_shape([log_probs, old_log_probs, adv, weight])
    adv = jax.lax.stop_gradient(adv)
    ratio = jnp.exp(log_probs - jax.lax.stop_gradient(old_log_probs))
    objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon) * adv)
    return -masked_mean(objective, weight)


def awr_weights(adv, beta, w_max):
    """AWR's regression weights min(exp(A / beta), w_max) (Trax's `awr_weights`
    without its percentile `thresholds`); constants to the loss. exp may
    overflow to inf, which the cap turns into w_max."""
    return jnp.minimum(jnp.exp(jax.lax.stop_gradient(adv) / beta), w_max)


def awr_loss(log_probs, adv, weight, beta, w_max):
    """Trax's AWRLoss (Peng et al. 2019, advantage-weighted regression):
    -sum(w log pi(a|s) min(exp(A / beta), w_max)) / sum(w). The behaviour
    policy's log-probs play no part, so it trains on replayed epochs."""
    chex.assert_rank(log_probs, {1, 2})  # steps [N], or sequences [B, L]
    chex.assert_equal_shape([log_probs, adv, weight])
    return -masked_mean(log_probs * awr_weights(adv, beta, w_max), weight)


def value_loss(predictions, targets, weight, old=None, epsilon=None):
    """Trax's L2Loss: sum(w (V(s) - target)^2) / sum(w); targets are constants.
    With `old` (V before the epoch's steps): PureJaxRL's clipped loss, each
    step's max((V - target)^2, (old + clip(V - old, -epsilon, epsilon) - target)^2)."""
    chex.assert_rank(predictions, {1, 2})  # steps [N], or sequences [B, L]
    chex.assert_equal_shape([predictions, targets, weight])
    targets = jax.lax.stop_gradient(targets)
    squared = (predictions - targets) ** 2
    if old is not None:
        old = jax.lax.stop_gradient(old)
        clipped = old + jnp.clip(predictions - old, -epsilon, epsilon)
        squared = jnp.maximum(squared, (clipped - targets) ** 2)
    return masked_mean(squared, weight)


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


def flat(x):
    """[n_replay_epochs, n_envs, steps, ...] replayed rows -> [epochs * n_envs *
    steps, ...] steps."""
    return x.reshape((-1,) + x.shape[3:])


def units(spec, x):
    """Replayed rows [n_replay_epochs, n_envs, steps, ...] as minibatches draw
    them: steps [N, ...] (flat), or with the recurrent torso sequences of
    slice_length steps [N / slice_length, slice_length, ...], in order."""
    if not spec.policy.gru_size:
        return flat(x)
    return x.reshape((-1, spec.slice_length) + x.shape[3:])


def resets(rollout):
    """Where the GRU state is zeros after a step: its episode ended (or it is
    padding), as in the rollout."""
    return rollout.terminated | rollout.truncated | ~rollout.valid


def sequence_memory(batch):
    """A minibatch's (GRU states at its sequences' first steps, resets) for
    policies.features_of; None for the memoryless torsos."""
    return (batch['memory'], batch['reset']) if 'memory' in batch else None


def with_memory(spec, data, replay, name):
    """data (units) plus, with the recurrent torso, network `name`'s stored
    GRU state at each sequence's first step and the resets."""
    if not spec.policy.gru_size:
        return data
    return {**data, 'memory': units(spec, replay.memory[name])[:, 0],
            'reset': units(spec, resets(replay))}


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
    steps: int  # env steps per env and epoch: the rows' length
    estimator: str
    margin: int  # the estimators' look-ahead (--added-policy-slice-length)
    slice_length: int  # --torso gru: steps per training sequence; else 1
    chunk_steps: int  # policy steps per metric chunk
    value_chunk_steps: int  # value steps per chunk (between target syncs)
    total_train_steps: int  # the policy schedule's length
    total_value_steps: int  # the value schedule's length


def optimizer(spec, hp):
    schedule = common.multifactor(spec.config.lr_schedule, constant=hp['lr'],
                                  warmup_steps=spec.config.warmup_steps,
                                  total_steps=spec.total_train_steps)
    return optax.chain(optax.scale_by_adam(b1=hp['adam_b1'], b2=hp['adam_b2'],
                                           eps=hp['adam_eps']),
                       optax.scale_by_schedule(lambda s: -schedule(s)))


def value_optimizer(spec, hp):
    """Trax gives the value trainer its own optimiser and schedule; Adam with
    its usual moments."""
    schedule = common.multifactor(spec.config.lr_schedule, constant=hp['value_lr'],
                                  warmup_steps=spec.config.warmup_steps,
                                  total_steps=spec.total_value_steps)
    return optax.chain(optax.scale_by_adam(eps=hp['adam_eps']),
                       optax.scale_by_schedule(lambda s: -schedule(s)))


def value_scale(spec, hp):
    return 1.0 / (1.0 - hp['gamma']) if spec.config.scale_value_targets else 1.0


def value_net(spec, value_params, obs, memory=None):
    """The network's output, V / scale, for [..., *obs_shape] observations
    (with the recurrent torso, sequences [B, L, ...] and their `memory`)."""
    features = policies.features_of(spec.policy, value_params, obs, memory)
    return policies.network_head(value_params, features)[..., 0]


def recurrent_values(spec, value_params, rows):
    """With the recurrent torso: (V(s), V(final_obs), V(last_obs)) / scale of
    rows [R, T]: the value network over each row's sequences from their stored
    GRU states; V(final_obs_t) steps the GRU once more from the state after
    step t (before its reset), V(last_obs) from the row's last state."""
    policy, net, name = spec.policy, value_params, value_memory_name(spec)
    sequence = lambda x: policies.sequences(x, spec.slice_length)
    after = policies.features_of(policy, net, sequence(rows.obs),
                                 (sequence(rows.memory[name])[:, 0], sequence(resets(rows))))
    after = after.reshape(rows.reward.shape + (-1,))  # [R, T, H]: the state after each step

    def value_from(hidden, obs):  # one more GRU step, then the head
        inputs = policies.gru_inputs(net, policies.observe(policy, obs), policy.obs_shape,
                                     policy.activation)
        return policies.network_head(net, policies.gru_step(net['gru'], hidden, inputs))[..., 0]

    return (policies.network_head(net, after)[..., 0], value_from(after, rows.final_obs),
            value_from(rows.last_memory[name], rows.last_obs))


def value_memory_name(spec):
    """Whose GRU states the value network runs from: its own, or with
    --shared-torso the policy's (one torso, one GRU)."""
    return 'policy' if spec.config.shared_torso else 'value'


def with_head(net, head):
    """init_network's params `net` with its last layer replaced by `head`."""
    if policies.is_recurrent(net):
        return {**net, 'head': [head]}
    if isinstance(net, dict) and 'conv' in net:
        return {**net, 'mlp': net['mlp'][:-1] + [head]}
    return net[:-1] + [head]


def value_network(spec, params, value_params):
    """The value network's params as value_net reads them: its own, or with
    --shared-torso the policy's torso under the value head (`value_params`),
    so the value loss's gradient reaches the shared torso."""
    if not spec.config.shared_torso:
        return value_params
    return with_head(params['net'], value_params)


def init_value_params(spec, key):
    """A separate value network (Trax's n_shared_layers 0), or with
    --shared-torso a head on the policy's features; its last layer small as
    the policy's, so early targets are about the rewards' scale (orthogonal
    init: gain 1, PureJaxRL's critic head)."""
    policy = spec.policy
    scale = 1.0 if policy.init == 'orthogonal' else 0.01
    if spec.config.shared_torso:
        head = common.init_mlp(key, [policy.latent_size, 1], last_scale=scale)
        return (policies.orthogonal(key, head, scale) if policy.init == 'orthogonal'
                else head)[0]
    return policies.init_network(key, policy.obs_shape, policy.hidden_sizes, 1, policy.torso,
                                 policy.conv_channels, last_scale=scale,
                                 gru_size=policy.gru_size, init=policy.init)


def init_optimizers(spec, hp, params, value_params):
    """{State field: initial value} of the optimisers: the policy's and the
    value network's, or with --joint one over both and () for the value's
    own (its target copy and step count too)."""
    zero = jnp.zeros((), jnp.int32)
    if spec.config.joint:
        return dict(opt_state=optimizer(spec, hp).init({'policy': params, 'value': value_params}),
                    value_opt_state=(), target_value_params=(), value_train_step=())
    return dict(opt_state=optimizer(spec, hp).init(params),
                value_opt_state=value_optimizer(spec, hp).init(value_params),
                target_value_params=value_params, value_train_step=zero)


def init(spec, key, hp):
    policy = spec.policy
    eval_key, key = jax.random.split(key)
    params, obs, env_state, key = policies.init_policy(policy, key, hp, spec.n_envs,
                                                     spec.fresh_episodes)
    zero = jnp.zeros((), jnp.int32)
    value_key, key = jax.random.split(key)
    value_params = init_value_params(spec, value_key)
    memory = policies.initial_memory(policy, dict.fromkeys(['policy', value_memory_name(spec)]),
                                     spec.n_envs)
    slots = (spec.config.n_replay_epochs, spec.n_envs)
    rows = lambda shape, dtype: jnp.zeros(slots + (spec.steps,) + shape, dtype)
    obs_dtype = policy.obs_dtype
    action_dtype = jnp.int32 if policy.kind == 'discrete' else jnp.float32
    replay = Rollout(obs=rows(policy.obs_shape, obs_dtype),
                     action=rows(policy.action_shape, action_dtype),
                     reward=rows((), jnp.float32), terminated=rows((), bool),
                     truncated=rows((), bool), final_obs=rows(policy.obs_shape, obs_dtype),
                     valid=rows((), bool),  # all invalid: nothing collected yet
                     last_obs=jnp.zeros(slots + policy.obs_shape, obs_dtype),
                     memory=jax.tree.map(lambda h: rows(h.shape[1:], h.dtype), memory),
                     last_memory=jax.tree.map(lambda h: jnp.zeros(slots + h.shape[1:]), memory))
    return State(params=params, env_state=env_state, obs=obs,
                 episode_return=jnp.zeros(spec.n_envs), memory=memory, key=key,
                 eval_key=eval_key, epoch=zero, train_step=zero, n_interactions=zero, n_trajectories=zero,
                 value_params=value_params, replay=replay,
                 **init_optimizers(spec, hp, params, value_params))


def collect(spec, hp, state):
    """One epoch of temperature-1 experience into its slot of `state.replay`."""
    nets = {}
    if spec.policy.gru_size:  # each GRU steps: the policy's, the value network's own
        nets = {'policy': state.params['net'],
                **({} if spec.config.shared_torso else {'value': state.value_params})}
    key, carry, rec = policies.collect_rollout(spec.policy, state, spec.n_envs, spec.steps,
                                             spec.fresh_episodes, final_obs=True, nets=nets)
    # An episode cut by the row's end in n_trajectories mode (only if the
    # env's own limit is longer) is truncated there.
    truncated = rec['truncated']
    if spec.fresh_episodes:
        truncated = truncated.at[:, -1].set(rec['valid'][:, -1] & ~rec['done'][:, -1])
    rollout = Rollout(obs=rec['obs'], action=rec['action'], reward=rec['reward'],
                      terminated=rec['terminated'] & rec['valid'],
                      truncated=truncated & rec['valid'], final_obs=rec['final_obs'],
                      valid=rec['valid'], last_obs=carry[0], memory=rec['memory'],
                      last_memory=carry[3])
    slot = state.epoch % spec.config.n_replay_epochs  # overwrites the oldest epoch's
    replay = jax.tree.map(lambda buffer, new: buffer.at[slot].set(new), state.replay, rollout)
    state, metrics = policies.finish_collect(state, key, carry, rec, spec.fresh_episodes)
    return state._replace(replay=replay), metrics


def advantages_of(spec, hp, value_params, replay):
    """(advantages, values), each [n_replay_epochs, n_envs, steps]: the
    estimator over the value network `value_params`, one env's row of one
    epoch at a time (each row bootstraps from its own last_obs)."""
    shape = replay.reward.shape
    rollout = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), replay)  # rows
    scale = value_scale(spec, hp)
    if spec.policy.gru_size:
        values, final_values, last_values = jax.tree.map(
            lambda v: scale * v, recurrent_values(spec, value_params, rollout))
    else:  # one pass over V(s), V(final_obs), V(last_obs): fewer, larger programs
        steps = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731  rows -> steps
        n = rollout.reward.size
        every = scale * value_net(spec, value_params, jnp.concatenate(
            [steps(rollout.obs), steps(rollout.final_obs), rollout.last_obs]))
        values, final_values = (v.reshape(rollout.reward.shape) for v in (every[:n],
                                                                          every[n:2 * n]))
        last_values = every[2 * n:]
    reward = bootstrapped_rewards(rollout.reward, rollout.terminated, rollout.truncated,
                                  final_values, hp['gamma'])
    done = rollout.terminated | rollout.truncated
    row_advantages = row_estimator(spec.estimator, hp['gamma'], spec.margin, hp['lambda_'],
                                   reward.shape[1])
    adv = jax.vmap(row_advantages)(reward, done, rollout.valid, values, last_values)
    return adv.reshape(shape), values.reshape(shape)


def minibatches(spec, key, weight, n_steps, batch_size):
    """-> step index -> that step's minibatch of indices (None: every step)
    into `weight`'s units: steps, or with the recurrent torso sequences
    (batch_size / slice_length of them; a sequence counts if any of its
    steps does). Every pass's order is drawn up front where every collected
    step is weighted (the n_interactions mode), so the minibatch steps sort
    nothing: as many passes as the fewest weighted units need, one epoch's
    (the replay may not be full yet)."""
    if not batch_size:
        return lambda i: None
    if weight.ndim == 2:  # sequences
        weight, batch_size = weight.max(axis=1), batch_size // spec.slice_length
    one_epoch = spec.n_envs * spec.steps // spec.slice_length
    orders = (None if spec.fresh_episodes
              else pass_orders(key, weight, passes_needed(n_steps, batch_size, one_epoch)))
    return lambda i: minibatch_indices(key, weight, batch_size, i, orders)


def value_step(spec, hp, data, minibatch, carry, i):
    """One L2 step of the value network on step i's minibatch of `data`."""
    value_params, opt_state, n = carry
    index = minibatch(i)
    batch = data if index is None else jax.tree.map(lambda x: x[index], data)
    # Sequences stay [B, L]: flattened, the loss's sum rounds differently for
    # one run than in a vmapped grid on XLA CPU.
    loss, grads = jax.value_and_grad(lambda p: value_loss(
        value_net(spec, p, batch['obs'], sequence_memory(batch)), batch['targets'],
        batch['weight'], batch.get('old_values'), hp['epsilon']))(value_params)
    grads = clip_by_global_norm(grads, hp['max_grad_norm'])
    updates, opt_state = value_optimizer(spec, hp).update(grads, opt_state, value_params)
    return (optax.apply_updates(value_params, updates), opt_state, n + 1), loss


def value_chunk(spec, hp, state, key):
    """One value trainer chunk: targets V_target(s) + A from the target
    network (fixed through the chunk), value_chunk_steps steps of L2 on
    target / scale, then the target network is synced to the trained one."""
    replay = state.replay
    adv, values = advantages_of(spec, hp, state.target_value_params, replay)
    weight = units(spec, replay.valid).astype(jnp.float32)
    targets = units(spec, values + adv) / value_scale(spec, hp)
    data = with_memory(spec, {'obs': units(spec, replay.obs), 'targets': targets,
                              'weight': weight, **old_values(spec, hp, values)}, replay, 'value')
    minibatch = minibatches(spec, key, weight, spec.value_chunk_steps,
                            spec.config.value_batch_size)
    step = functools.partial(value_step, spec, hp, data, minibatch)
    (value_params, opt_state, n), losses = jax.lax.scan(
        step, (state.value_params, state.value_opt_state, state.value_train_step),
        jnp.arange(spec.value_chunk_steps))
    metrics = {'metrics/value_loss': losses.mean(),
               'metrics/value_mean': masked_mean(units(spec, values), weight),
               'metrics/returns_mean': masked_mean(targets * value_scale(spec, hp), weight)}
    return state._replace(value_params=value_params, value_opt_state=opt_state,
                          value_train_step=n, target_value_params=value_params), metrics


def awr_metrics(weights, weight):
    """Trax's awr_weight_mean, _std, _min, _max over the minibatch's weighted steps."""
    mean = masked_mean(weights, weight)
    counted = weight > 0
    return {'metrics/awr_weight_mean': mean,
            'metrics/awr_weight_std': jnp.sqrt(masked_mean((weights - mean) ** 2, weight)),
            'metrics/awr_weight_min': jnp.min(jnp.where(counted, weights, jnp.inf)),
            'metrics/awr_weight_max': jnp.max(jnp.where(counted, weights, -jnp.inf))}


def policy_objective(spec, params, batch, hp):
    """(the --policy-loss objective minus the entropy bonus, metrics) on a minibatch."""
    log_probs, entropy = policies.log_prob_and_entropy(
        spec.policy, params, batch['obs'], batch['action'], sequence_memory(batch))
    adv, old_log_probs, weight = (batch[name] for name in ('adv', 'old_log_probs', 'weight'))
    if spec.config.normalize_advantages:  # per minibatch, as Trax's policy loss layer
        adv = normalized_advantages(adv, weight, hp['advantage_normalization_factor'],
                                    hp['advantage_normalization_epsilon'])
    policy_loss, metrics = POLICY_OBJECTIVES[spec.config.policy_loss](
        log_probs, old_log_probs, adv, weight, hp)
    mean_entropy = masked_mean(entropy, weight)
    metrics = {**metrics, 'metrics/policy_loss': policy_loss, 'metrics/entropy': mean_entropy}
    return policy_loss - hp['entropy_coeff'] * mean_entropy, metrics


def joint_objective(spec, nets, batch, hp):
    """--joint's one loss on a minibatch: the policy objective (entropy bonus
    included) + value_loss_coeff * the value network's L2 loss. `nets`:
    {'policy': params, 'value': value_params}."""
    loss, metrics = policy_objective(spec, nets['policy'], batch, hp)
    net = value_network(spec, nets['policy'], nets['value'])
    memory = ((batch['value_memory'], batch['reset']) if 'value_memory' in batch
              else sequence_memory(batch))  # separate GRUs, or the shared one
    value_loss_ = value_loss(value_net(spec, net, batch['obs'], memory), batch['targets'],
                             batch['weight'], batch.get('old_values'), hp['epsilon'])
    metrics = {**metrics, 'metrics/value_loss': value_loss_}
    return loss + hp['value_loss_coeff'] * value_loss_, metrics


def policy_step(spec, hp, data, minibatch, state, i):
    """One gradient step on step i's minibatch of `data`: of the policy's
    objective, or with --joint of the combined loss over both networks."""
    index = minibatch(i)
    batch = data if index is None else jax.tree.map(lambda x: x[index], data)
    if spec.config.joint:
        objective, params = joint_objective, {'policy': state.params, 'value': state.value_params}
    else:
        objective, params = policy_objective, state.params
    with (common.transposed_weight_gradients() if spec.config.joint
          else contextlib.nullcontext()):  # --joint's numbers only: see common.dense
        grads, metrics = jax.grad(functools.partial(objective, spec), has_aux=True)(
            params, batch, hp)
    grads = clip_by_global_norm(grads, hp['max_grad_norm'])
    updates, opt_state = optimizer(spec, hp).update(grads, state.opt_state, params)
    params = optax.apply_updates(params, updates)
    if spec.config.joint:
        state = state._replace(params=params['policy'], value_params=params['value'])
    else:
        state = state._replace(params=params)
    return state._replace(opt_state=opt_state, train_step=state.train_step + 1), metrics


def old_values(spec, hp, values):
    """--clip-value-loss: {'old_values': V / scale before the steps}, else {}."""
    if not spec.config.clip_value_loss:
        return {}
    return {'old_values': units(spec, values) / value_scale(spec, hp)}


def joint_data(spec, hp, data, replay, adv, values):
    """--joint: the policy's minibatch data plus the value targets V + A
    (value_chunk's, from the network before this epoch's steps) and, with
    separate GRUs, the value network's stored states -> (data, metrics)."""
    scale = value_scale(spec, hp)
    targets = units(spec, values + adv) / scale
    data = {**data, 'targets': targets, **old_values(spec, hp, values)}
    if spec.policy.gru_size and not spec.config.shared_torso:
        data['value_memory'] = units(spec, replay.memory['value'])[:, 0]
    weight = data['weight']
    return data, {'metrics/value_mean': masked_mean(units(spec, values), weight),
                  'metrics/returns_mean': masked_mean(targets * scale, weight)}


def policy_chunks(spec, hp, state, key):
    """train_steps_per_epoch policy steps (evals_per_epoch chunks) on the
    replay's steps, advantages from the value network just trained (--joint:
    from the one about to train with the policy, its targets fixed too)."""
    replay = state.replay
    adv, values = advantages_of(spec, hp, value_network(spec, state.params, state.value_params),
                                replay)
    weight = units(spec, replay.valid).astype(jnp.float32)
    data = with_memory(spec, {'obs': units(spec, replay.obs),
                              'action': units(spec, replay.action), 'adv': units(spec, adv),
                              'weight': weight}, replay, 'policy')
    raw = {}
    if spec.config.joint:
        data, raw = joint_data(spec, hp, data, replay, adv, values)
    adv = data['adv']
    # The collecting policy's log-probs (Trax keeps its dist_inputs in the
    # trajectory): the policy has not changed since it collected (PPO and A2C
    # replay one epoch, the latest; AWR does not use them).
    data['old_log_probs'] = (jnp.zeros_like(adv) if spec.config.policy_loss in OFF_POLICY else
                             jax.lax.stop_gradient(policies.log_prob_and_entropy(
                                 spec.policy, state.params, data['obs'], data['action'],
                                 sequence_memory(data))[0]))
    raw.update({'metrics/advantage_mean': masked_mean(adv, weight),
                'metrics/advantage_std': jnp.sqrt(masked_mean(
                    (adv - masked_mean(adv, weight)) ** 2, weight))})
    config = spec.config
    minibatch = minibatches(spec, key, weight, config.train_steps_per_epoch, config.batch_size)
    step = functools.partial(policy_step, spec, hp, data, minibatch)

    def chunk(state, steps):
        state, metrics = jax.lax.scan(step, state, steps)
        return state, jax.tree.map(jnp.mean, metrics)

    steps = jnp.arange(config.train_steps_per_epoch).reshape(config.evals_per_epoch,
                                                              spec.chunk_steps)
    state, metrics = jax.lax.scan(chunk, state, steps)
    return state, {**jax.tree.map(lambda m: m[-1], metrics), **raw}


def train(spec, hp, state):
    """Value training first, then the policy (Trax's order); --joint: both in
    the policy's steps, on one loss."""
    key, value_key, policy_key = jax.random.split(state.key, 3)
    if spec.config.joint:
        state, metrics = policy_chunks(spec, hp, state._replace(key=key), policy_key)
        return finish_train(spec, state, metrics)
    # Trax syncs the target network before value training, too.
    state = state._replace(key=key, target_value_params=state.value_params)
    state, value_metrics = jax.lax.scan(
        lambda s, k: value_chunk(spec, hp, s, k), state,
        jax.random.split(value_key, spec.config.value_evals_per_epoch))
    state, metrics = policy_chunks(spec, hp, state, policy_key)
    metrics.update(jax.tree.map(lambda m: m[-1], value_metrics))  # the last chunk's
    return finish_train(spec, state, metrics)


def finish_train(spec, state, metrics):
    state = state._replace(epoch=state.epoch + 1)
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
    command line), derive its Spec and build A2C's, PPO's or AWR's phases."""
    fields.check_grid(config, {}, check_runs)
    policy = policies.policy_spec(config)
    fields.check_inert(config, {**fields.shared_inert(config, policies.feature_torso(
        policy.torso, policy.obs_shape), policy.env_params), **policies.inert_fields(
        config, policy)}, given)
    max_steps = policy.max_steps
    fresh = bool(config.n_trajectories_per_epoch)
    n_envs = config.n_trajectories_per_epoch if fresh else config.n_envs
    steps = max_steps if fresh else config.n_interactions_per_epoch // config.n_envs
    check_slices(config, policy, steps)
    epochs = config.lr_decay_epochs or config.epochs
    env_steps = fields.env_steps_factors(config, n_envs, steps, max_steps)
    value = [] if config.joint else [  # --joint: the value net trains in the policy's steps
        ('value gradient steps', [('--epochs', config.epochs), ('--value-train-steps-per-epoch',
                                                                config.value_train_steps_per_epoch)])]
    value_lr = [] if config.joint else [
        ("the value learning-rate schedule's steps",
         [('--lr-decay-epochs', epochs),
          ('--value-train-steps-per-epoch', config.value_train_steps_per_epoch)])]
    fields.check_int32_products([  # the counters and the replay's row index
        ('policy gradient steps', [('--epochs', config.epochs),
                                   ('--train-steps-per-epoch', config.train_steps_per_epoch)]),
        *value,
        ('env steps', [('--epochs', config.epochs), *env_steps]),
        ("the learning-rate schedule's steps",
         [('--lr-decay-epochs', epochs), ('--train-steps-per-epoch', config.train_steps_per_epoch)]),
        *value_lr,
        ('replay steps', [('--n-replay-epochs', config.n_replay_epochs), *env_steps])])
    spec = Spec(
        config=config, policy=policy,
        eval_tags=tuple((t, h) for t in config.eval_temperatures
                        for h in (config.eval_steps or (max_steps,))),
        fresh_episodes=fresh, n_envs=n_envs,
        steps=steps,
        estimator=config.advantage_estimator, margin=config.added_policy_slice_length,
        slice_length=(config.max_slice_length or steps) if policy.gru_size else 1,
        chunk_steps=config.train_steps_per_epoch // config.evals_per_epoch,
        value_chunk_steps=config.value_train_steps_per_epoch // config.value_evals_per_epoch,
        total_train_steps=epochs * config.train_steps_per_epoch,
        total_value_steps=epochs * config.value_train_steps_per_epoch)
    return common.Agent(
        name='actor_critic', init=functools.partial(init, spec),
        collect=functools.partial(collect, spec), train=functools.partial(train, spec),
        evaluate=functools.partial(evaluate, spec), eval_tags=list(spec.eval_tags),
        max_steps=max_steps, spec=spec, config=config, check_runs=check_runs,
        obs_shape=policy.obs_shape, memory_flags='--num-seeds (or the grid), '
        '--n-trajectories-per-epoch or --n-interactions-per-epoch, --max-steps')


# Per-env settings: the fields that differ from the defaults above (PPO on
# CartPole-v1 but for its init), used when --env names the env and the flag is
# not given (a flag on the command line wins). Each entry was tuned for PPO (learning
# rates 1e-3, 32 evaluation episodes) and names it: with --policy-loss a2c
# none of it applies. Tuning notes: docs/actor_critic.md.
PPO = {'policy_loss': 'ppo', 'n_eval_episodes': 32}
BATCH_256 = {'entropy_coeff': 0.0, 'train_steps_per_epoch': 32, 'batch_size': 256,
             'value_batch_size': 256, 'value_train_steps_per_epoch': 32}
DISCRETE = {**PPO, **BATCH_256}
# MinAtar: the conv torso (--torso auto), dense 128, PureJaxRL's rollouts
# shrunk to about 5 CPU minutes for 4 seeds. Untuned.
MINATAR = {**PPO, 'hidden_sizes': (128,), 'n_envs': 32, 'n_interactions_per_epoch': 4096,
           'train_steps_per_epoch': 32, 'batch_size': 512, 'value_batch_size': 512,
           'value_train_steps_per_epoch': 32, 'epochs': 60, 'n_eval_episodes': 8}
# gymnax-blines' MinAtar PPO at its 1e7 steps (github.com/RobertTLange/gymnax-blines,
# agents/ppo configs): an MLP of 2 x 256 over the flattened grid, 64 envs x 128
# steps an update, 4 x 8 minibatches of 1024, lr 5e-4, gamma 0.999. At 10M it
# beats PQN on SpaceInvaders (168.5 against 164.0), so that env's settings; on
# Breakout and Freeway PQN wins (`python dqn.py --env <game>`; docs/results.md).
BLINES_MINATAR = {'policy_loss': 'ppo', 'torso': 'mlp', 'hidden_sizes': (256, 256),
                  'n_envs': 64, 'n_interactions_per_epoch': 8192, 'batch_size': 1024,
                  'value_batch_size': 1024, 'train_steps_per_epoch': 32,
                  'value_train_steps_per_epoch': 32, 'lr': 5e-4, 'value_lr': 5e-4,
                  'gamma': 0.999, 'entropy_coeff': 0.01, 'epochs': 1221,
                  'n_eval_episodes': 128}
ENV_SETTINGS = {
    # PureJaxRL's orthogonal initialisation: with Glorot's, 7 of tuning seeds
    # 32-95 ended oscillating (120-250); with it all 64 end at 500, both compile
    # modes (docs/actor_critic.md). The other envs were tuned with Glorot's.
    'CartPole-v1': {'policy_loss': 'ppo', 'init': 'orthogonal'},
    'Pendulum-v1': {**PPO, **BATCH_256, 'gamma': 0.95, 'epochs': 300},  # 0.99: worse
    # gSDE's smooth noise rocks the car up the hill; fresh noise stands still.
    'MountainCarContinuous-v0': {**PPO, **BATCH_256, 'epochs': 60,
                                 'normalize_observations': True,
                                 'state_dependent_exploration': True, 'sde_sample_freq': 32},
    'Acrobot-v1': {**PPO, 'entropy_coeff': 0.0, 'epochs': 300},  # 200: -83.7
    **{name: {**DISCRETE, 'epochs': 50} for name in ('DeepSea-bsuite', 'GaussianBandit-misc')},
    # The envs that need memory: the GRU torso, tuned on seeds 8-15, checked on
    # 0-7 (docs/actor_critic.md, "Policies with memory"). MemoryChain: 1.0 on both.
    'MemoryChain-bsuite': {**DISCRETE, 'epochs': 50, 'torso': 'gru'},
    # Whole episodes as rows and sequences (100 and 200 steps), 800-step
    # minibatches, the entropy bonus kept (0.01). Bandit: 89.0 on both seed
    # sets (an oracle expects 90). MetaMaze, seeds 8-15: 51.3, worst 38.4 (80
    # epochs: 47.1, worst 20.0); its step count (0-200) mapped onto [-1, 1]
    # is what makes it learn.
    'BernoulliBandit-misc': {**PPO, 'torso': 'gru', 'epochs': 50, 'n_envs': 32,
                             'n_interactions_per_epoch': 3200, 'max_slice_length': 100,
                             'batch_size': 800, 'value_batch_size': 800,
                             'train_steps_per_epoch': 16, 'value_train_steps_per_epoch': 16,
                             'n_eval_episodes': 64, 'eval_every': 10},
    'MetaMaze-misc': {**PPO, 'torso': 'gru', 'normalize_observations': True, 'epochs': 120,
                      'n_interactions_per_epoch': 3200, 'max_slice_length': 200,
                      'batch_size': 800, 'value_batch_size': 800, 'train_steps_per_epoch': 16,
                      'value_train_steps_per_epoch': 16, 'eval_every': 20},
    # Learning rates 2e-3 (1e-3 not tried; 4e-3 learnt slower); 150 epochs.
    'PointRobot-misc': {'policy_loss': 'ppo', 'n_eval_episodes': 32, 'torso': 'gru',
                        'lr': 2e-3, 'value_lr': 2e-3,
                        'epochs': 150, 'n_envs': 32, 'n_interactions_per_epoch': 3200,
                        'max_slice_length': 100, 'batch_size': 800, 'value_batch_size': 800,
                        'train_steps_per_epoch': 32, 'value_train_steps_per_epoch': 32,
                        'eval_every': 25},
    'Catch-bsuite': {**DISCRETE, 'epochs': 30},
    'FourRooms-misc': DISCRETE,  # 100 epochs; 50: 0.99, worst seed 0.94
    # 8192 evaluation episodes: each step pays a +-1 distractor (return std 3).
    'UmbrellaChain-bsuite': {**DISCRETE, 'n_eval_episodes': 8192},  # 100 epochs
    'DiscountingChain-bsuite': {**DISCRETE, 'epochs': 50, 'gamma': 0.9},  # 0.99: settles on a 1.0 chain
    **{name: MINATAR for name in ('Asterix-MinAtar', 'Breakout-MinAtar', 'Freeway-MinAtar',
                                  'Seaquest-MinAtar')},
    'SpaceInvaders-MinAtar': BLINES_MINATAR,  # the better agent there at 10M (above)
}


# A mode's settings (--policy-loss a2c or awr), for every env: a mode brings
# settings tuned for it, never PPO's entries above. MODE_ENV_SETTINGS holds the
# envs that need more than the mode's own. Tuning notes: docs/actor_critic.md.
#
# A2C is on-policy without PPO's clip: each gradient step after the first on
# the same steps follows a policy that no longer collected them, so PPO's 64
# minibatch steps an epoch collapse it (greedy 9 on CartPole). Its settings
# take few full-batch policy steps on each epoch's steps (Trax's A2C: one),
# with the value network trained as PPO's. Tuned on CartPole-v1 seeds 0-15.
A2C_SETTINGS = {'policy_loss': 'a2c', 'n_interactions_per_epoch': 1024,
                'train_steps_per_epoch': 2, 'batch_size': 0, 'value_train_steps_per_epoch': 32,
                'epochs': 150}
# AWR: tuned on CartPole-v1 seeds 8-15, confirmed on 0-7, with the learning
# rates and epochs that were then the defaults.
AWR_SETTINGS = {'policy_loss': 'awr', 'n_replay_epochs': 10, 'entropy_coeff': 0.0,
                'lr': 2e-3, 'value_lr': 2e-3, 'epochs': 40}
MODE_SETTINGS = {'a2c': A2C_SETTINGS, 'awr': AWR_SETTINGS}
MODE_ENV_SETTINGS = {
    'a2c': {},
    'awr': {
        # Tuned on seeds 8-11: minibatches of 256, gamma 0.95 as PPO's entry found.
        'Pendulum-v1': {'gamma': 0.95, 'epochs': 150, 'lr': 1e-3, 'value_lr': 1e-3,
                        'n_eval_episodes': 32, 'train_steps_per_epoch': 32, 'batch_size': 256,
                        'value_batch_size': 256, 'value_train_steps_per_epoch': 32},
    },
}


# The value network's own trainer (Trax's value_* settings): under --joint
# it trains in the policy's steps, so these cannot act there.
VALUE_ONLY = tuple(field.name for field in dataclasses.fields(Config)
                   if (field.metadata['acts_with'] or ())[:2] == ('joint', (False,)))


# --joint brings settings of its own on CartPole-v1: PureJaxRL's PPO config
# (github.com/luchris429/purejaxrl, ppo.py, CartPole-v1: 4 envs x 128 steps,
# 4 epochs x 4 minibatches, lr 2.5e-4 annealed, gae 0.95, clip 0.2, entropy
# 0.01, value coefficient 0.5, gradient norm 0.5, Adam eps 1e-5, 5e5 steps)
# and two of ours: --scale-value-targets and gae over the whole row
# (--added-policy-slice-length 128). On seeds 0-15 every seed ends at 500 in
# both compile modes, with and without --shared-torso (value coefficient
# 0.5 and 0.1 alike: 0.5 kept), so one entry serves both (docs/actor_critic.md).
JOINT_SETTINGS = {'CartPole-v1': {
    'policy_loss': 'ppo', 'n_envs': 4, 'n_interactions_per_epoch': 512, 'epochs': 976,
    'train_steps_per_epoch': 16, 'batch_size': 128, 'lr': 2.5e-4, 'entropy_coeff': 0.01,
    'value_loss_coeff': 0.5, 'max_grad_norm': 0.5, 'lambda_': 0.95, 'epsilon': 0.2,
    'adam_eps': 1e-5, 'advantage_estimator': 'gae', 'added_policy_slice_length': 128,
    'scale_value_targets': True}}


def env_settings(policy_loss, env, joint=False):
    """The per-env settings table for a command line asking for `policy_loss`
    and `env`: ENV_SETTINGS (PPO's entries) for ppo; for a2c and awr, the
    mode's settings for `env` and each env of its MODE_ENV_SETTINGS, that
    env's entry over them. `joint`: without the VALUE_ONLY fields, and
    JOINT_SETTINGS' entries in place of the separate networks' ones."""
    if policy_loss not in MODE_SETTINGS:
        table = {**ENV_SETTINGS, **JOINT_SETTINGS} if joint else ENV_SETTINGS
    else:
        own, per_env = MODE_SETTINGS[policy_loss], MODE_ENV_SETTINGS[policy_loss]
        table = {name: {**own, **per_env.get(name, {})}
                 for name in dict.fromkeys([env, *per_env])}
    if not joint:
        return table
    return {name: {k: v for k, v in entry.items() if k not in VALUE_ONLY}
            for name, entry in table.items()}


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
    common.schedule_factors(config.lr_schedule)
    estimator = config.advantage_estimator
    if estimator in ('td_k', 'td_lambda', 'gae') and config.added_policy_slice_length < 1:
        raise error(f'--advantage-estimator {estimator} needs --added-policy-slice-length >= 1 '
                    '(with 0 it looks no step ahead: td_k has no k, td_lambda and gae give 0)',
                    field='advantage_estimator')
    if config.n_replay_epochs > 1 and config.policy_loss not in OFF_POLICY:
        raise error(f'--n-replay-epochs {config.n_replay_epochs} needs the off-policy '
                    f'--policy-loss awr: {config.policy_loss} trains on the policy that '
                    'collected its steps (Trax asserts 1 for it too)', field='n_replay_epochs')
    if config.value_train_steps_per_epoch % config.value_evals_per_epoch:
        raise error(f'--value-train-steps-per-epoch ({config.value_train_steps_per_epoch}) must '
                    f'be divisible by --value-evals-per-epoch ({config.value_evals_per_epoch})',
                    field='value_train_steps_per_epoch')
    check_mode_fields(config, runs)


def check_slices(config, policy, steps):
    """--torso gru's sequences tile the rows and the minibatches."""
    error = common.UsageError
    if not policy.gru_size:
        return
    length = config.max_slice_length or steps
    if steps % length:
        raise error(f'--max-slice-length {length} must divide the rows\' length, {steps} '
                    'steps (--n-interactions-per-epoch / --n-envs, or the episode cap)',
                    field='max_slice_length')
    for name in ('batch_size',) if config.joint else ('batch_size', 'value_batch_size'):
        if getattr(config, name) % length:  # (--joint: no value minibatches of their own)
            raise error(f'{fields.flag(name)} ({getattr(config, name)}) must be a '
                        f'multiple of the sequences\' length ({length}): minibatches are '
                        'whole sequences')


def check_mode_fields(config, runs):
    """gamma 1 with scaled values (what acts in which mode: the fields' acts_with)."""
    for run in runs:
        if config.scale_value_targets and run['gamma'] == 1:
            raise common.UsageError('--scale-value-targets divides by 1 - gamma: it needs '
                                    '--gamma < 1', field='scale_value_targets')


def settings_table(typed):
    """The per-env settings for the flags typed: the loss asked for picks the table."""
    return env_settings(typed.get('policy_loss', Config.policy_loss),
                        typed.get('env', Config.env), typed.get('joint', Config.joint))


def main(argv=None):
    """The full command line (harness/), or without it fields.plain_main."""
    try:  # `import actor_critic` alone needs neither
        from harness import cli
    except ImportError as error:  # none, or a project's own `harness` package
        if error.name not in ('harness', 'harness.cli'):
            raise
        return fields.plain_main(Config, make_agent, settings_table, argv, 'policy_loss')
    return cli.main(Config, make_agent, check_runs, 'actor_critic.py',
                    __doc__.split('\n\n')[0], argv, env_settings=settings_table,
                    settings_mode_field='policy_loss')


if __name__ == '__main__':
    sys.exit(0 if main() is not None else 1)
