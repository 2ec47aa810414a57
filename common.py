"""What the algorithm files (dqn.py, pg.py, actor_critic.py) share: Trax's
advantage estimators and its `remaining_evals` helper, gymnax envs by name,
the MLP, conv and GRU (recurrent) networks, the policies of pg.py and
actor_critic.py (Categorical, Gaussian, gSDE; their rollouts and evaluation), `multifactor`
schedules, config fields (`option`), the `Agent` record and `run_sweep`, which
runs seeds x a grid of hyperparameters for some epochs in one compiled program.

Copy this file together with an algorithm file and you have the whole
algorithm; the command line (flags, resume, checkpoints, TensorBoard,
processes) lives in the `harness` package, which only each script's `main()`
imports. Importing this file compiles nothing.
"""

import dataclasses
import functools
import importlib
import itertools
import math
import os
import sys
import types
import typing

import chex
import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------
# Advantage estimators: trax/rl/advantages.py, same signatures and numerics,
# rewritten with jnp/lax so they jit and vmap (Trax wrote into numpy arrays).
# Every array is [batch, length]; a result is [batch, length - margin].
# Inputs are checked with chex, as rlax does, while tracing: free at run time.
# td_lambda and gae also have an associative_scan form for GPU/TPU (`scan`).
# ---------------------------------------------------------------------------


def check_args(assertion, function, expected, **arrays):
    """chex `assertion(array, expected)` on each keyword array; its message names
    the argument that fails (chex's own numbers each call's inputs from 0)."""
    for name, array in arrays.items():
        assertion(array, expected, custom_message=f'argument `{name}` of {function}')


def _check_estimator_inputs(function, rewards, returns, values, dones, discount_mask):
    arrays = dict(rewards=rewards, returns=returns, values=values, dones=dones,
                  discount_mask=discount_mask)
    check_args(chex.assert_rank, function, 2, **arrays)
    chex.assert_equal_shape(list(arrays.values()), custom_message=f'{function}: rewards, '
                            'returns, values, dones, discount_mask share one shape')


def mask_discount(discount, discount_mask):
    """Per-step discount: `discount` (a scalar) where the mask is set, 1 elsewhere;
    elementwise, so the mask may have any shape."""
    check_args(chex.assert_rank, 'mask_discount', 0, discount=discount)
    return jnp.where(discount_mask, discount, 1.0)


def discounted_returns(rewards, gammas):
    """G_t = r_t + gamma_t * G_{t+1}, summed from the end of each row; `gammas`
    is [batch, length] or one scalar."""
    check_args(chex.assert_rank, 'discounted_returns', 2, rewards=rewards)
    check_args(chex.assert_rank, 'discounted_returns', {0, 2}, gammas=gammas)
    if jnp.ndim(gammas) == 2:
        chex.assert_equal_shape([rewards, gammas], custom_message='discounted_returns: '
                                'rewards, gammas')
    def step(future, reward_and_gamma):
        reward, gamma = reward_and_gamma
        current = reward + gamma * future
        return current, current

    rewards = jnp.asarray(rewards)
    gammas = jnp.broadcast_to(jnp.asarray(gammas, rewards.dtype), rewards.shape)
    _, returns = jax.lax.scan(step, jnp.zeros_like(rewards[:, 0]),
                              (rewards.T, gammas.T), reverse=True)
    return returns.T


def monte_carlo(gamma, margin):
    """Empirical return minus value; at a terminal step the return is its reward."""
    del gamma

    def estimator(rewards, returns, values, dones, discount_mask):
        _check_estimator_inputs('monte_carlo estimator', rewards, returns, values, dones,
                                discount_mask)
        del discount_mask
        length = returns.shape[1]
        returns = jnp.where(dones, rewards, returns)
        values = jnp.where(dones, jnp.zeros_like(values), values)
        return (returns - values)[:, :length - margin]

    return estimator


def td_k(gamma, margin):
    """k-step TD advantage, k = margin > 0: sum of k discounted rewards plus the
    discounted value k steps ahead, minus the value now."""
    if margin < 1:
        raise ValueError(f'td_k needs margin >= 1, got {margin}')
    k = margin

    def estimator(rewards, returns, values, dones, discount_mask):
        _check_estimator_inputs('td_k estimator', rewards, returns, values, dones,
                                discount_mask)
        del returns
        gammas = mask_discount(gamma, discount_mask)
        length = values.shape[1] - k
        advantages = jnp.zeros_like(values[:, k:])
        discount = jnp.ones_like(advantages)
        for i in range(k):
            advantages += discount * rewards[:, i:i + length]
            discount *= gammas[:, i:i + length]
        advantages += discount * values[:, k:]
        advantages = jnp.where(dones[:, :-k], rewards[:, :-k], advantages)
        return advantages - values[:, :-k]

    return estimator


SCANS = ('auto', 'sequential', 'associative')


def resolve_scan(scan):
    """'auto' -> 'associative' on a GPU/TPU backend, 'sequential' on CPU: a lax.scan
    is cheap on CPU but runs its steps one kernel after another on an accelerator
    (rlax PR #168: 4.5x at batch x time 1024 x 16); the CPU keeps the sequential
    form, so CPU results stay what they were."""
    if scan not in SCANS:
        raise ValueError(f'scan must be one of {SCANS}, got {scan!r}')
    if scan == 'auto':
        return 'sequential' if jax.default_backend() == 'cpu' else 'associative'
    return scan


def reverse_affine_scan(a, b):
    """x[:, t] = a[:, t] * x[:, t + 1] + b[:, t] along axis 1, from the end (x
    past the end is 0), in O(log length) depth: each step is the affine map
    x -> a x + b, and maps compose associatively, earlier after later:
    (a1, b1) o (a2, b2) = (a1 a2, a1 b2 + b1)."""
    def compose(later, earlier):  # reverse=True hands the later (accumulated) map first
        (a_later, b_later), (a_earlier, b_earlier) = later, earlier
        return a_earlier * a_later, a_earlier * b_later + b_earlier

    return jax.lax.associative_scan(compose, (a, b), reverse=True, axis=1)[1]


def _lambda_estimator_inputs(gamma, lambda_, values, dones, discount_mask):
    gammas = mask_discount(gamma, discount_mask).astype(values.dtype)
    lambdas = mask_discount(lambda_, discount_mask).astype(values.dtype)
    not_done = 1.0 - jnp.asarray(dones).astype(values.dtype)
    return gammas, lambdas, not_done


def td_lambda(gamma, margin, lambda_=0.95, scan='auto'):
    """TD(lambda) return minus value, computed backwards from the last value;
    `scan` as `resolve_scan`."""
    resolve_scan(scan)  # fails now on a bad name, not at trace time

    def estimator(rewards, returns, values, dones, discount_mask):
        _check_estimator_inputs('td_lambda estimator', rewards, returns, values, dones,
                                discount_mask)
        gammas, lambdas, not_done = _lambda_estimator_inputs(
            gamma, lambda_, values, dones, discount_mask)
        length = returns.shape[1]
        if resolve_scan(scan) == 'associative':
            # G_i = a_i G_{i+1} + b_i; the appended map (0, V_last) sets G's last column.
            discount = not_done[:, :-1] * gammas[:, :-1]
            bootstrap = rewards[:, :-1] + discount * (1 - lambdas[:, :-1]) * values[:, 1:]
            a = jnp.concatenate([discount * lambdas[:, :-1], jnp.zeros_like(values[:, -1:])], 1)
            b = jnp.concatenate([bootstrap, values[:, -1:]], 1)
            return (reverse_affine_scan(a, b) - values)[:, :length - margin]

        def step(next_return, xs):
            reward, cont, g, lam, next_value = xs
            current = reward + cont * g * ((1 - lam) * next_value + lam * next_return)
            return current, current

        xs = (rewards[:, :-1].T, not_done[:, :-1].T, gammas[:, :-1].T,
              lambdas[:, :-1].T, values[:, 1:].T)
        _, head = jax.lax.scan(step, values[:, -1], xs, reverse=True)
        lambda_returns = jnp.concatenate([head.T, values[:, -1:]], axis=1)
        return (lambda_returns - values)[:, :length - margin]

    return estimator


def gae(gamma, margin, lambda_=0.95, scan='auto'):
    """Generalised advantage estimation; the last step's advantage is 0; `scan`
    as `resolve_scan`."""
    resolve_scan(scan)

    def estimator(rewards, returns, values, dones, discount_mask):
        _check_estimator_inputs('gae estimator', rewards, returns, values, dones,
                                discount_mask)
        gammas, lambdas, not_done = _lambda_estimator_inputs(
            gamma, lambda_, values, dones, discount_mask)
        length = returns.shape[1]
        if resolve_scan(scan) == 'associative':
            # A_i = a_i A_{i+1} + delta_i; the appended map (0, 0) is the last step's A = 0.
            discount = not_done[:, :-1] * gammas[:, :-1]
            delta = rewards[:, :-1] - values[:, :-1] + discount * values[:, 1:]
            zero = jnp.zeros_like(values[:, -1:])
            a = jnp.concatenate([discount * lambdas[:, :-1], zero], 1)
            b = jnp.concatenate([delta, zero], 1)
            return reverse_affine_scan(a, b)[:, :length - margin]

        def step(next_advantage, xs):
            reward, cont, g, lam, value, next_value = xs
            delta = reward - value + cont * g * next_value
            current = delta + cont * g * lam * next_advantage
            return current, current

        xs = (rewards[:, :-1].T, not_done[:, :-1].T, gammas[:, :-1].T,
              lambdas[:, :-1].T, values[:, :-1].T, values[:, 1:].T)
        _, head = jax.lax.scan(step, jnp.zeros_like(values[:, -1]), xs, reverse=True)
        advantages = jnp.concatenate([head.T, jnp.zeros_like(values[:, -1:])], axis=1)
        return advantages[:, :length - margin]

    return estimator


# ---------------------------------------------------------------------------
# remaining_evals: trax/rl/training.py, unchanged.
# ---------------------------------------------------------------------------


def remaining_evals(cur_step, epoch, train_steps_per_epoch, evals_per_epoch):
    """How many trainer evaluation chunks are left in `epoch` at `cur_step`."""
    if epoch < 1:
        raise ValueError('Epoch must be at least 1, got %d' % epoch)
    prev_steps = (epoch - 1) * train_steps_per_epoch
    done_steps_this_epoch = cur_step - prev_steps
    if done_steps_this_epoch < 0:
        raise ValueError('Current step (%d) < previously done steps (%d).'
                         % (cur_step, prev_steps))
    train_steps_per_eval = train_steps_per_epoch // evals_per_epoch
    if done_steps_this_epoch % train_steps_per_eval != 0:
        raise ValueError('Done steps (%d) must divide train steps per eval (%d).'
                         % (done_steps_this_epoch, train_steps_per_eval))
    return evals_per_epoch - done_steps_this_epoch // train_steps_per_eval


# ---------------------------------------------------------------------------
# Environments.
# ---------------------------------------------------------------------------


class UsageError(ValueError):
    """Bad input from the user: reported as one line and exit status 2."""


def check_precision():
    """UsageError when JAX computes in 64 bits (JAX_ENABLE_X64=1, or
    jax_enable_x64 set in code): every program here is written for float32 and
    int32 (its carries, counters, checkpoints and bitwise resumes), and under
    x64 its loops would mix int32 and int64 (a traceback deep in tracing)."""
    if not jax.config.jax_enable_x64:
        return
    source = (f'JAX_ENABLE_X64={os.environ["JAX_ENABLE_X64"]} is set'
              if os.environ.get('JAX_ENABLE_X64') else 'jax_enable_x64 is on')
    raise UsageError(f'{source}: these programs compute in float32 and int32 (their '
                     'checkpoints and bitwise resumes too); unset JAX_ENABLE_X64 (or set it to '
                     '0) to run them')


class _ImportOnUse(types.ModuleType):
    """Stands in for a module until one of its attributes is used."""

    def __getattr__(self, attr):
        if attr.startswith('__'):  # the import system's own probes
            raise AttributeError(attr)
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


def make_env(name, max_steps=None):
    """A gymnax env and its params by registered name; `max_steps` caps episodes."""
    # gymnax imports seaborn and matplotlib.pyplot at module level, only to
    # render; they (with scipy and pandas) take a second to import, so they
    # load when first used instead.
    for module in ('matplotlib.pyplot', 'seaborn'):
        sys.modules.setdefault(module, _ImportOnUse(module))
    import gymnax  # imported here so `import common` stays fast
    if name not in gymnax.registered_envs:
        raise UsageError(f'unknown env {name!r}; valid gymnax envs: '
                         + ', '.join(gymnax.registered_envs))
    try:
        env, env_params = gymnax.make(name)
    except Exception as error:  # e.g. MNISTBandit-bsuite downloads its data
        raise UsageError(f'env {name} cannot be built here ({type(error).__name__}: '
                         f'{str(error).splitlines()[0] if str(error) else ""}); '
                         'it may need data from the internet') from error
    if max_steps is not None:
        if not hasattr(env_params, 'max_steps_in_episode'):
            raise UsageError(f'env {name} has no episode time limit to set')
        # Keep the field's type: BernoulliBandit-misc's limit is a float, and its
        # observation_space selects between it and other floats.
        kind = float if isinstance(env_params.max_steps_in_episode, float) else int
        env_params = env_params.replace(max_steps_in_episode=kind(max_steps))
    return env, env_params


def step_first_episode(env, key, state, action, env_params):
    """`env.step` without gymnax's auto-reset, for rollouts that use only each
    env's first episode (evaluation, fresh-episode collection): the reset
    that `env.step` computes every step is never used there, and it is most
    of a step's cost and compile time. Same outputs until the episode ends
    (the step's key is split as `env.step` splits it).
    """
    step_key, _ = jax.random.split(key)
    obs, state, reward, terminated, info = env.step_env(step_key, state, action, env_params)
    truncated = env.is_truncated(state, env_params)
    return obs, state, reward, terminated, truncated, {**info, 'final_observation': obs}


def space_kind(space):
    """'discrete' or 'box' for a gymnax space; anything else is refused."""
    kind = type(space).__name__
    if kind == 'Discrete':
        return 'discrete'
    if kind == 'Box':
        return 'box'
    raise UsageError(f'action space {kind} is not supported (only Discrete and Box)')


def flat_obs_size(env, env_params):
    return int(np.prod(env.observation_space(env_params).shape))


def env_max_steps(env_params):
    return int(getattr(env_params, 'max_steps_in_episode', 1000))


# ---------------------------------------------------------------------------
# Networks: a plain MLP over a params pytree (Trax's MLP: Dense + Relu).
# ---------------------------------------------------------------------------


def init_mlp(key, sizes, last_scale=1.0, layer_norm=False):
    """[{'w', 'b'}] for layer sizes [in, hidden..., out].

    Glorot-uniform weights (Trax's Dense default) and zero biases; the last
    layer's weights are multiplied by `last_scale` (small for policy heads).
    `layer_norm` gives each hidden layer a LayerNorm's 'scale' (ones) and
    'offset' (zeros); without it the params are exactly as before.
    """
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for i, (key_i, fan_in, fan_out) in enumerate(zip(keys, sizes[:-1], sizes[1:])):
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        weights = jax.random.uniform(key_i, (fan_in, fan_out), minval=-limit, maxval=limit)
        if i == len(sizes) - 2:
            weights = weights * last_scale
        params.append({'w': weights, 'b': jnp.zeros((fan_out,)),
                       **(layer_norm_params(fan_out) if layer_norm and i < len(sizes) - 2
                          else {})})
    return params


LAYER_NORM_EPSILON = 1e-6  # flax.linen.LayerNorm's, which PQN's networks use


def layer_norm_params(size):
    return {'scale': jnp.ones((size,)), 'offset': jnp.zeros((size,))}


def layer_norm(layer, x):
    """LayerNorm (Ba et al. 2016) over the last axis when `layer` has its
    'scale' and 'offset' (init_mlp / init_conv with layer_norm), else x as is."""
    if 'scale' not in layer:
        return x
    mean = x.mean(axis=-1, keepdims=True)
    variance = jnp.square(x - mean).mean(axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + LAYER_NORM_EPSILON) * layer['scale'] \
        + layer['offset']


def mlp(params, x):
    """Apply an MLP made by init_mlp; ReLU between layers, linear output."""
    return mlp_hidden(params, x) @ params[-1]['w'] + params[-1]['b']


def mlp_hidden(params, x):
    """The features an MLP's last layer reads: every layer but the last, each
    followed by its LayerNorm if it has one, then ReLU (x itself for an MLP
    with no hidden layer)."""
    check_args(chex.assert_rank, 'mlp', 2, **{f'params[{i}]["w"]': layer['w']
                                              for i, layer in enumerate(params)})
    check_args(chex.assert_rank, 'mlp', 1, **{f'params[{i}]["b"]': layer['b']
                                              for i, layer in enumerate(params)})
    check_args(chex.assert_shape, 'mlp', (..., params[0]['w'].shape[0]), x=x)
    for layer in params[:-1]:
        x = jax.nn.relu(layer_norm(layer, x @ layer['w'] + layer['b']))
    return x


# ---------------------------------------------------------------------------
# Conv torso for image observations ([..., H, W, C], e.g. MinAtar's 10x10xC
# grids): the MinAtar paper's network (Young & Tian 2019) is one 3x3 conv of
# 16 channels, stride 1, no padding, ReLU, flatten, then the MLP (dense 128).
# A network is then {'conv': [{'w', 'b'}], 'mlp': init_mlp(...)}; an MLP-only
# network stays init_mlp's plain list.
# ---------------------------------------------------------------------------

TORSOS = ('auto', 'mlp', 'conv')
# The policies' torsos (pg.py, actor_critic.py) add the recurrent one.
POLICY_TORSOS = TORSOS + ('gru',)


def resolve_torso(torso, obs_shape, choices=TORSOS):
    """'mlp', 'conv' or 'gru' for --torso: auto means conv for rank-3 observations."""
    if torso not in choices:
        raise UsageError(f'--torso must be one of {", ".join(choices)}, got {torso!r}')
    if torso == 'auto':
        return 'conv' if len(obs_shape) == 3 else 'mlp'
    if torso == 'conv' and len(obs_shape) != 3:
        raise UsageError(f'--torso conv needs [height, width, channels] observations; '
                         f'this env\'s are {list(obs_shape)}')
    return torso


def feature_torso(torso, obs_shape):
    """The torso under a GRU: conv for rank-3 observations, else mlp."""
    return resolve_torso('auto', obs_shape) if torso == 'gru' else torso


def conv_output_shape(in_shape, channels, kernel=3, stride=1):
    """[H, W, C] after the conv layers (VALID padding: each layer loses kernel - 1)."""
    height, width, _ = in_shape
    for _ in channels:
        height = (height - kernel) // stride + 1
        width = (width - kernel) // stride + 1
        if height < 1 or width < 1:
            raise UsageError(f'observation {list(in_shape)} is too small for '
                             f'{len(channels)} {kernel}x{kernel} conv layer(s)')
    return (height, width, channels[-1] if channels else in_shape[2])


def init_conv(key, in_channels, channels, kernel=3, layer_norm=False):
    """[{'w': [k, k, in, out], 'b': [out]}] per layer; Glorot-uniform over the
    receptive field (fan = k * k * channels, as Trax's Conv) and zero biases;
    `layer_norm` adds a LayerNorm over each layer's channels (as PQN's)."""
    params = []
    keys = jax.random.split(key, max(len(channels), 1))
    for key_i, fan_in, fan_out in zip(keys, (in_channels, *channels[:-1]), channels):
        limit = math.sqrt(6.0 / (kernel * kernel * (fan_in + fan_out)))
        params.append({'w': jax.random.uniform(key_i, (kernel, kernel, fan_in, fan_out),
                                               minval=-limit, maxval=limit),
                       'b': jnp.zeros((fan_out,)),
                       **(layer_norm_params(fan_out) if layer_norm else {})})
    return params


def conv(params, x, stride=1):
    """Conv layers made by init_conv, each followed by its LayerNorm if it has
    one, then ReLU, on [..., H, W, C];
    returns the features flattened, [..., H' * W' * C'].

    Written as im2col: the k * k shifted views of the input (slices, so exact
    copies) side by side, then one matmul with the kernel. Slices cost a
    tenth of `lax.conv_general_dilated_patches` on XLA CPU (a 512 x 10 x 10 x 4
    MinAtar batch: 5 ms against 58 ms forward, 15 ms against 56 ms with the
    gradient). It equals `lax.conv_general_dilated` up to float rounding, but
    stays bitwise the same for a run alone, in a grid or sharded (see
    compiler_options): vmap turns a per-run kernel in `conv_general_dilated`
    into a grouped convolution over the runs, whose kernel gradient XLA CPU
    sums in another order for 8 runs than for 1, while the matmul is
    YNNPACK's, which does not.
    """
    batch_shape = x.shape[:-3]
    x = x.reshape((-1,) + x.shape[-3:])
    n = x.shape[0]
    if n > CONV_CHUNK:  # a rollout's worth: chunk by chunk (each row's result unchanged)
        x = jnp.concatenate([x, jnp.zeros((-n % CONV_CHUNK,) + x.shape[1:], x.dtype)])
        x = jax.lax.map(functools.partial(conv_layers, params, stride=stride),
                        x.reshape((-1, CONV_CHUNK) + x.shape[1:]))
        x = x.reshape((-1,) + x.shape[2:])[:n]
    else:
        x = conv_layers(params, x, stride)
    return x.reshape(batch_shape + (-1,))


# Batches past this many observations go through the conv layers in chunks of
# it: a 4096-observation MinAtar rollout took 126 ms in one piece (its patches,
# 37 MB, fall out of the cache) and 23 ms in chunks of 512, bitwise the same.
CONV_CHUNK = 512


def conv_layers(params, x, stride=1):
    """conv's layers on one batch [N, H, W, C] -> [N, H', W', C']."""
    for layer in params:
        kernel = layer['w']  # [k, k, in, out]
        size, _, channels_in, channels_out = kernel.shape
        x = jax.nn.relu(layer_norm(layer, conv_patches(x, size, stride)
                                   @ kernel.reshape(-1, channels_out) + layer['b']))
    return x


def conv_patches(x, size, stride=1):
    """[N, H, W, C] -> [N, H', W', k * k * C]: each VALID k x k window, its
    features ordered (row, column, channel) as the kernel's [k, k, C] axes."""
    rows = (x.shape[1] - size) // stride + 1
    cols = (x.shape[2] - size) // stride + 1
    return jnp.concatenate(
        [x[:, i:i + stride * (rows - 1) + 1:stride, j:j + stride * (cols - 1) + 1:stride, :]
         for i in range(size) for j in range(size)], axis=-1)


def init_network(key, obs_shape, hidden_sizes, n_outputs, torso='mlp',
                 conv_channels=(16,), last_scale=1.0, layer_norm=False, gru_size=0):
    """Params of torso (flatten, or conv_channels 3x3 convs) + MLP head;
    `layer_norm`: a LayerNorm before every hidden ReLU (conv and dense).
    torso 'gru': {'base': that network (conv or flatten by the observations'
    rank) whose last layer is the GRU's input weights [.., 3 * gru_size],
    'gru': the recurrent weights, 'head': the linear layer on its state}."""
    if torso == 'gru':
        base_key, gru_key, head_key = jax.random.split(key, 3)
        return {'base': init_network(base_key, obs_shape, hidden_sizes, 3 * gru_size,
                                     feature_torso(torso, obs_shape), conv_channels,
                                     layer_norm=layer_norm),
                'gru': init_gru(gru_key, gru_size),
                'head': init_mlp(head_key, [gru_size, n_outputs], last_scale)}
    if torso == 'conv':
        conv_key, mlp_key = jax.random.split(key)
        features = int(np.prod(conv_output_shape(obs_shape, conv_channels)))
        return {'conv': init_conv(conv_key, obs_shape[-1], conv_channels,
                                  layer_norm=layer_norm),
                'mlp': init_mlp(mlp_key, [features, *hidden_sizes, n_outputs], last_scale,
                                layer_norm)}
    return init_mlp(key, [int(np.prod(obs_shape)), *hidden_sizes, n_outputs], last_scale,
                    layer_norm)


def is_recurrent(params):
    return isinstance(params, dict) and 'gru' in params


def network(params, obs, obs_shape):
    """Apply init_network's params to observations [..., *obs_shape] (float32);
    not a recurrent network (recurrent_features steps those)."""
    return network_head(params, network_features(params, obs, obs_shape))


def network_features(params, obs, obs_shape):
    """The features init_network's last layer reads (torso, then hidden layers)."""
    obs = jnp.asarray(obs).astype(jnp.float32)
    batch_shape = obs.shape[:obs.ndim - len(obs_shape)]
    if isinstance(params, dict) and 'conv' in params:
        return mlp_hidden(params['mlp'], conv(params['conv'], obs))
    return mlp_hidden(params, obs.reshape(batch_shape + (int(np.prod(obs_shape, dtype=int)),)))


def network_head(params, features):
    """init_network's last (linear) layer on network_features' output (a
    recurrent network's: on its GRU state)."""
    if is_recurrent(params):
        return flat_matmul(features, params['head'][-1]['w']) + params['head'][-1]['b']
    last = (params['mlp'] if isinstance(params, dict) and 'conv' in params else params)[-1]
    return features @ last['w'] + last['b']


def flat_matmul(x, weights):
    """x [..., n] @ weights [n, m] as one [N, n] matmul: a sequence's [B, L, n]
    as is rounds its gradient differently for one run than for several in a
    vmapped grid on XLA CPU; flattened, a run's numbers stay its own."""
    return (x.reshape(-1, x.shape[-1]) @ weights).reshape(x.shape[:-1] + (-1,))


# ---------------------------------------------------------------------------
# The recurrent torso: a GRU (Cho et al. 2014) over the MLP/conv features,
# in the form of cuDNN and flax's GRUCell (the reset gate applied after the
# recurrent matmul, so a step is one [H, 3H] matmul). A GRU rather than an
# LSTM: one state vector to carry, store, reset and checkpoint (an LSTM has
# two), and fewer weights; recurrent PPO in PureJaxRL uses one too. The
# state is zeros at an episode's first step: the rollout and every sequence
# pass set it to zeros after a step that ends its episode.
# ---------------------------------------------------------------------------


def init_gru(key, size):
    """{'wh': [H, 3H] recurrent weights (Glorot-uniform, as Trax's Dense), 'bh': [3H]}
    for the reset, update and candidate gates; the input weights are the
    base network's last layer."""
    limit = math.sqrt(6.0 / (size + 3 * size))
    return {'wh': jax.random.uniform(key, (size, 3 * size), minval=-limit, maxval=limit),
            'bh': jnp.zeros((3 * size,))}


def gru_step(gru, hidden, inputs):
    """One GRU step: hidden [..., H], inputs = x W_i + b_i [..., 3H] ->
    the new state (1 - z) * n + z * h, with r, z = sigmoid(x_r + h_r),
    sigmoid(x_z + h_z), n = tanh(x_n + r * h_n), h_* = h W_h* + b_h*."""
    x_r, x_z, x_n = jnp.split(inputs, 3, axis=-1)
    h_r, h_z, h_n = jnp.split(flat_matmul(hidden, gru['wh']) + gru['bh'], 3, axis=-1)
    reset = jax.nn.sigmoid(x_r + h_r)
    update = jax.nn.sigmoid(x_z + h_z)
    candidate = jnp.tanh(x_n + reset * h_n)
    return (1.0 - update) * candidate + update * hidden


def gru_inputs(params, obs, obs_shape):
    """A recurrent network's input projections of observations [..., *obs_shape]
    -> [..., 3H]: every step's at once, outside the recurrence."""
    return network(params['base'], obs, obs_shape)


def recurrent_features(params, obs, obs_shape, hidden, reset):
    """A recurrent network over sequences: obs [B, L, *obs_shape] from the
    states `hidden` [B, H] at their first steps; after a step with `reset`
    [B, L] (its episode ended there, or it is not a step of one) the state is
    zeros again. -> (the state after each step, before its reset [B, L, H]:
    what the head reads; the state after the last step, reset applied)."""
    inputs = gru_inputs(params, obs, obs_shape)

    def step(hidden, xs):
        inputs, reset = xs
        out = gru_step(params['gru'], hidden, inputs)
        return jnp.where(reset[:, None], 0.0, out), out

    hidden, outputs = jax.lax.scan(step, hidden, (jnp.swapaxes(inputs, 0, 1),
                                                  jnp.swapaxes(reset, 0, 1)))
    return jnp.swapaxes(outputs, 0, 1), hidden


def sequences(x, length):
    """Rows [R, T, ...] -> sequences [R * T / length, length, ...], in order."""
    return x.reshape((-1, length) + x.shape[2:])


# ---------------------------------------------------------------------------
# Policies over gymnax envs (pg.py, actor_critic.py): Categorical for
# Discrete actions, Gaussian for Box ones (a learned state-independent log
# std, or gSDE's state-dependent noise); their rollouts and evaluation.
# ---------------------------------------------------------------------------

LOG_2PI = math.log(2 * math.pi)
SDE_VARIANCE_FLOOR = 1e-6  # added to gSDE's variance (stable-baselines3's epsilon)
ROLLOUT_CHUNK = 50  # steps between checks that every episode of a rollout is over


def categorical_log_prob(logits, action):
    """log softmax(logits)[action], over the last axis; `action` is an integer."""
    where = 'categorical_log_prob'
    check_args(chex.assert_shape, where, (..., None), logits=logits)
    check_args(chex.assert_shape, where, logits.shape[:-1], action=action)
    check_args(chex.assert_type, where, int, action=action)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(log_p, action[..., None].astype(jnp.int32), axis=-1)[..., 0]


def categorical_entropy(logits):
    check_args(chex.assert_shape, 'categorical_entropy', (..., None), logits=logits)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def categorical_sample(noise, logits, temperature):
    """Trax's Gumbel-max sample argmax(logits + T * gumbel), i.e. a sample of
    softmax(logits / T); T == 0: argmax. `noise` is standard Gumbel, logits' shape."""
    check_args(chex.assert_shape, 'categorical_sample', (..., None), logits=logits)
    chex.assert_equal_shape([noise, logits], custom_message='categorical_sample: noise, logits')
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1)
    return jnp.argmax(logits + temperature * noise, axis=-1)


def gaussian_log_prob(mean, log_std, action):
    """log N(action; mean, exp(log_std)^2), summed over the last (action) axis."""
    check_args(chex.assert_shape, 'gaussian_log_prob', (..., None), mean=mean)
    chex.assert_equal_shape([mean, log_std, action],
                            custom_message='gaussian_log_prob: mean, log_std, action')
    z = (action - mean) * jnp.exp(-log_std)
    return jnp.sum(-0.5 * z ** 2 - log_std - 0.5 * LOG_2PI, axis=-1)


def gaussian_entropy(log_std):
    check_args(chex.assert_shape, 'gaussian_entropy', (..., None), log_std=log_std)
    return jnp.sum(log_std + 0.5 * (LOG_2PI + 1.0), axis=-1)


def gaussian_sample(noise, mean, log_std, temperature):
    """mean + T * std * noise (`noise` standard normal, mean's shape); T == 0: the mean."""
    check_args(chex.assert_shape, 'gaussian_sample', (..., None), mean=mean)
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


def masked_mean(x, weight):
    return jnp.sum(x * weight) / jnp.maximum(jnp.sum(weight), 1e-8)


class PolicySpec(typing.NamedTuple):
    """A policy over an env, derived once from the config: static."""
    env: typing.Any
    env_params: typing.Any
    max_steps: int  # the episode cap actually used
    obs_shape: tuple
    obs_dtype: typing.Any
    obs_bounds: typing.Any  # (centre, half width) mapped onto [-1, 1]; None: raw
    kind: str  # 'discrete' or 'box'
    action_shape: tuple
    n_outputs: int  # logits, or the Box's flattened size (Gaussian means)
    action_bounds: typing.Any  # Box: (centre, half width, low, high); None otherwise
    sde: bool  # gSDE (Box only)
    sde_sample_freq: int
    torso: str  # 'mlp', 'conv' or 'gru'
    conv_channels: tuple
    hidden_sizes: tuple
    latent_size: int  # features the last layer reads (gSDE's noise rows)
    gru_size: int  # the GRU's state size (torso 'gru'), else 0: no memory


def policy_spec(config):
    """The PolicySpec of a config's env, torso and policy fields."""
    env, env_params = make_env(config.env, config.max_steps)
    space, obs_space = env.action_space(env_params), env.observation_space(env_params)
    kind = space_kind(space)
    obs_shape = tuple(obs_space.shape)
    torso = resolve_torso(config.torso, obs_shape, POLICY_TORSOS)
    if feature_torso(torso, obs_shape) == 'conv':
        conv_output_shape(obs_shape, config.conv_channels)  # refuses too small
    gru_size = config.gru_size if torso == 'gru' else 0
    action_bounds = None
    if kind == 'discrete':
        n_outputs, action_shape = int(space.n), ()
    else:
        action_shape = tuple(space.shape)
        n_outputs = int(np.prod(action_shape))
        low = np.broadcast_to(np.asarray(space.low, np.float32), action_shape)
        high = np.broadcast_to(np.asarray(space.high, np.float32), action_shape)
        bounded = np.isfinite(low) & np.isfinite(high)
        # The net works in units of half the Box's width around its centre.
        action_bounds = (jnp.asarray(np.where(bounded, (low + high) / 2, 0.0).reshape(-1)),
                         jnp.asarray(np.where(bounded, (high - low) / 2, 1.0).reshape(-1)),
                         jnp.asarray(low), jnp.asarray(high))
    latent_size = gru_size or (config.hidden_sizes[-1] if config.hidden_sizes else
                               int(np.prod(conv_output_shape(obs_shape, config.conv_channels)
                                           if torso == 'conv' else obs_shape)))
    return PolicySpec(
        env=env, env_params=env_params, max_steps=env_max_steps(env_params),
        obs_shape=obs_shape, obs_dtype=jax.eval_shape(
            lambda k: env.reset(k, env_params)[0], jax.random.PRNGKey(0)).dtype,
        obs_bounds=(observation_bounds(obs_space, obs_shape)
                    if config.normalize_observations else None),
        kind=kind, action_shape=action_shape, n_outputs=n_outputs, action_bounds=action_bounds,
        sde=config.state_dependent_exploration and kind == 'box',
        sde_sample_freq=config.sde_sample_freq, torso=torso,
        conv_channels=config.conv_channels, hidden_sizes=config.hidden_sizes,
        latent_size=latent_size, gru_size=gru_size)


def observe(spec, obs):
    """Observations as the networks take them."""
    x = obs.astype(jnp.float32)
    if spec.obs_bounds is not None:
        x = (x - spec.obs_bounds[0]) / spec.obs_bounds[1]
    return x


def features_of(spec, net, obs, memory=None):
    """The features a network's last layer reads: of each observation, or
    with a recurrent torso of sequences obs [B, L, ...] given `memory` =
    (the GRU state at their first steps [B, H], reset [B, L]; see
    recurrent_features)."""
    x = observe(spec, obs)
    if spec.gru_size:
        return recurrent_features(net, x, spec.obs_shape, *memory)[0]
    return network_features(net, x, spec.obs_shape)


def policy_and_features(spec, params, obs, memory=None):
    """(distribution inputs: logits, or (mean, log_std) in env units; the
    features the policy's last layer reads); `memory`: features_of's."""
    features = features_of(spec, params['net'], obs, memory)
    return policy_from_features(spec, params, features), features


def policy_from_features(spec, params, features):
    out = network_head(params['net'], features)
    if spec.kind == 'discrete':
        return out
    centre, half = spec.action_bounds[:2]
    mean = centre + half * out
    if spec.sde:
        # gSDE's noise is features @ W, W ~ N(0, exp(log_std)^2) entrywise:
        # given the state that is N(0, features^2 @ exp(2 log_std)) per action
        # dimension. As in gSDE, no gradient reaches the features through the
        # noise's scale.
        variance = jax.lax.stop_gradient(features) ** 2 @ jnp.exp(2.0 * params['log_std'])
        log_std = 0.5 * jnp.log(variance + SDE_VARIANCE_FLOOR) + jnp.log(half)
    else:
        log_std = jnp.broadcast_to(params['log_std'] + jnp.log(half), mean.shape)
    return mean, log_std


def policy(spec, params, obs, memory=None):
    return policy_and_features(spec, params, obs, memory)[0]


def log_prob_and_entropy(spec, params, obs, action, memory=None):
    inputs = policy(spec, params, obs, memory)
    if spec.kind == 'discrete':
        return categorical_log_prob(inputs, action), categorical_entropy(inputs)
    mean, log_std = inputs
    flat = action.reshape(action.shape[:action.ndim - len(spec.action_shape)]
                          + (spec.n_outputs,))
    return gaussian_log_prob(mean, log_std, flat), gaussian_entropy(log_std)


def rollout_noise(spec, key, length, shape):
    """(gSDE's weight draws or None, per-step noise of `shape` = (steps...,
    count)): standard Gumbel (discrete) or normal (Box) noise for each action,
    or for gSDE each step's index into the draws, a fresh draw every
    sde_sample_freq steps (0: one for the rollout)."""
    if not spec.sde:
        sample = jax.random.gumbel if spec.kind == 'discrete' else jax.random.normal
        return None, sample(key, shape + (spec.n_outputs,))
    every = spec.sde_sample_freq or length
    n_draws = -(-length // every)
    draws = jax.random.normal(key, (n_draws, shape[-1], spec.latent_size, spec.n_outputs))
    steps = int(np.prod(shape[:-1]))
    index = jnp.minimum(jnp.arange(steps) // every, n_draws - 1)
    return draws, jnp.broadcast_to(index.reshape(shape[:-1] + (1,)), shape)


def act(spec, noise, params, obs, temperature, features=None):
    """(action to learn from, action for the env): a Box action is clipped to
    its bounds for the env only; the log-prob is of the sampled action.
    gSDE's `noise` is the standard-normal weights [..., features, actions].
    `features`: the recurrent torso's, already stepped on `obs`."""
    if features is None:
        inputs, features = policy_and_features(spec, params, obs)
    else:
        inputs = policy_from_features(spec, params, features)
    if spec.kind == 'discrete':
        action = categorical_sample(noise, inputs, temperature)
        return action, action
    _, half, low, high = spec.action_bounds
    if spec.sde:
        weights = jnp.exp(params['log_std']) * noise
        action = inputs[0] + temperature * half * jnp.einsum(
            '...f,...fa->...a', jax.lax.stop_gradient(features), weights)
    else:
        action = gaussian_sample(noise, *inputs, temperature)
    action = action.reshape(action.shape[:-1] + spec.action_shape)
    return action, jnp.clip(action, low, high)


def env_reset(spec, key, count):
    return jax.vmap(spec.env.reset, in_axes=(0, None))(jax.random.split(key, count),
                                                       spec.env_params)


def init_policy(spec, key, hp, n_envs, fresh_episodes):
    """-> (policy params, obs, env_state, key): the policy network (its last
    layer scaled by 0.01), a Box's log std (gSDE: one per noise weight), and
    n_envs envs, reset unless each epoch starts fresh episodes (then
    placeholders of the right shape)."""
    net_key, env_key, key = jax.random.split(key, 3)
    params = {'net': init_network(net_key, spec.obs_shape, spec.hidden_sizes, spec.n_outputs,
                                  spec.torso, spec.conv_channels, last_scale=0.01,
                                  gru_size=spec.gru_size)}
    if spec.kind == 'box':
        params['log_std'] = jnp.full((spec.latent_size, spec.n_outputs) if spec.sde
                                     else (spec.n_outputs,), hp['init_log_std'])
    if fresh_episodes:
        obs, env_state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
            lambda k: env_reset(spec, k, n_envs), env_key))
    else:
        obs, env_state = env_reset(spec, env_key, n_envs)
    return params, obs, env_state, key


def initial_memory(spec, names, count):
    """The GRU state at an episode's first step, zeros [count, H], of each
    recurrent network in `names` (none without the recurrent torso)."""
    return {name: jnp.zeros((count, spec.gru_size)) for name in names} if spec.gru_size else {}


def rollout_step(spec, params, temperature, one_episode, final_obs, draws, nets, carry, xs):
    """One step of every env: (carry, the step's record). Each recurrent
    network of `nets` (the policy's 'policy') steps its GRU on the
    observation; its state is zeros again after a step that ends the episode."""
    obs, env_state, episode_return, memory, active = carry
    noise, env_keys = xs
    if draws is not None:  # gSDE: this step's weights, per env
        noise = draws[noise, jnp.arange(episode_return.shape[0])]
    stepped = {name: gru_step(net['gru'], memory[name],
                              gru_inputs(net, observe(spec, obs), spec.obs_shape))
               for name, net in nets.items()}
    action, env_action = act(spec, noise, params, obs, temperature, stepped.get('policy'))
    step = (functools.partial(step_first_episode, spec.env) if one_episode
            else spec.env.step)
    next_obs, env_state, reward, terminated, truncated, info = jax.vmap(
        step, in_axes=(0, 0, 0, None))(env_keys, env_state, env_action, spec.env_params)
    reward = reward.astype(jnp.float32)
    done = terminated | truncated
    episode_return = episode_return + jnp.where(active, reward, 0.0)
    finished = done & active
    record = dict(obs=obs, action=action, reward=reward, done=done, valid=active,
                  finished=finished, finished_return=jnp.where(finished, episode_return, 0.0),
                  memory=memory)  # the GRU states the step started from
    if final_obs:  # a value network bootstraps a truncation from V(final obs)
        record.update(terminated=terminated, truncated=truncated,
                      final_obs=info['final_observation'])
    episode_return = jnp.where(done, 0.0, episode_return)
    memory = {name: jnp.where(done[:, None], 0.0, h) for name, h in stepped.items()}
    if one_episode:
        active = active & ~done
    return (next_obs, env_state, episode_return, memory, active), record


def rollout(spec, key, params, obs, env_state, episode_return, length, temperature,
            one_episode, final_obs=False, memory=None, nets=None):
    """`length` steps of `obs.shape[0]` envs -> (carry, time-major records of
    each step). With `one_episode`, each env plays until its first done
    (later steps invalid); `final_obs` also records terminated, truncated and
    the observation each step led to. With the recurrent torso, `memory`
    holds each env's GRU state per network of `nets` (default: the policy's,
    from the first step of an episode)."""
    count = episode_return.shape[0]
    if nets is None:
        nets = {'policy': params['net']} if spec.gru_size else {}
    if memory is None:
        memory = initial_memory(spec, nets, count)
    # All randomness drawn up front in two calls: each random op compiles
    # into its own code, and on CPU that compile time dominates short runs.
    noise_key, env_key = jax.random.split(key)
    carry = (obs, env_state, episode_return, memory, jnp.ones(count, bool))
    chunk = min(length, ROLLOUT_CHUNK)
    n_chunks = -(-length // chunk)
    draws, noise = rollout_noise(
        spec, noise_key, length, (length, count) if not one_episode else (n_chunks, chunk, count))
    step = functools.partial(rollout_step, spec, params, temperature, one_episode, final_obs,
                             draws, nets)
    if not one_episode:  # episodes continue: every step is needed
        env_keys = jax.random.split(env_key, length * count).reshape(length, count, -1)
        return jax.lax.scan(step, carry, (noise, env_keys))
    env_keys = jax.random.split(env_key, n_chunks * chunk * count).reshape(
        n_chunks, chunk, count, -1)
    return play_until_done(step, carry, noise, env_keys, length)


def play_until_done(step, carry, noise, env_keys, length):
    """One episode per env: play `step` in chunks [n_chunks, chunk, ...] of
    noise and keys, and stop once every env is done (most of max_steps while
    the policy is still poor). Records of chunks never played stay zero,
    i.e. invalid steps."""
    n_chunks, chunk = noise.shape[:2]
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
        i, (*_, active), _ = loop
        return (i < n_chunks) & jnp.any(active)

    _, carry, records = jax.lax.while_loop(more, body, (0, carry, records))
    return carry, jax.tree.map(
        lambda x: x.reshape((n_chunks * chunk,) + x.shape[2:])[:length], records)


def collect_rollout(spec, state, n_envs, steps, fresh_episodes, final_obs=False, nets=None):
    """An epoch's temperature-1 rollout of `state.params`: fresh episodes, or
    the envs' running ones (and their GRU states, `state.memory`, per
    recurrent network of `nets`) -> (key, carry, records [n_envs, steps, ...])."""
    key, reset_key, rollout_key = jax.random.split(state.key, 3)
    if fresh_episodes:
        obs, env_state = env_reset(spec, reset_key, n_envs)
        episode_return = jnp.zeros(n_envs)
        memory = jax.tree.map(jnp.zeros_like, state.memory)
    else:
        obs, env_state, episode_return = state.obs, state.env_state, state.episode_return
        memory = state.memory
    carry, rec = rollout(spec, rollout_key, state.params, obs, env_state, episode_return, steps,
                         1.0, fresh_episodes, final_obs, memory, nets)
    return key, carry, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), rec)


def finish_collect(state, key, carry, rec, fresh_episodes):
    """The collect phase's counters, env carry and metrics -> (state, metrics).
    With fresh episodes an episode cut by the cap counts as finished, truncated."""
    obs, env_state, episode_return, memory, _ = carry
    n_finished = rec['finished'].sum()
    new_interactions = rec['valid'].sum()
    if fresh_episodes:
        finished_return = jnp.sum(rec['reward'] * rec['valid'], axis=1)
        n_finished = jnp.asarray(rec['valid'].shape[0], n_finished.dtype)
        avg_return = finished_return.mean()
    else:
        avg_return = jnp.where(n_finished > 0, rec['finished_return'].sum()
                               / jnp.maximum(n_finished, 1), jnp.nan)
    metrics = {'rl/avg_return': avg_return,
               'rl/n_interactions': state.n_interactions + new_interactions,
               'rl/n_trajectories': state.n_trajectories + n_finished,
               'rl/new_interactions': new_interactions}
    return state._replace(env_state=env_state, obs=obs, episode_return=episode_return, key=key,
                          memory=memory, n_interactions=state.n_interactions + new_interactions,
                          n_trajectories=state.n_trajectories + n_finished), metrics


def evaluate_policy(spec, state, eval_tags, n_episodes):
    """Fresh episodes of `state.params` for each (temperature, horizon) of
    `eval_tags`; never training data -> (state unchanged, metrics)."""
    metrics = {}
    if n_episodes == 0:
        return state, metrics
    for tag_key, (temperature, horizon) in zip(jax.random.split(evaluation_key(state),
                                                                len(eval_tags)),
                                               eval_tags):
        reset_key, rollout_key = jax.random.split(tag_key)
        obs, env_state = env_reset(spec, reset_key, n_episodes)
        _, rec = rollout(spec, rollout_key, state.params, obs, env_state, jnp.zeros(n_episodes),
                         horizon, temperature, True)
        metrics[eval_key(temperature, horizon)] = jnp.sum(
            rec['reward'] * rec['valid'], axis=0).mean()
    return state, metrics


# ---------------------------------------------------------------------------
# Schedules: Trax's lr.multifactor, written in jnp so `constant` (and the
# others) may be traced per-run hyperparameters in a vmapped sweep.
# ---------------------------------------------------------------------------

SCHEDULE_FACTORS = ('constant', 'linear_warmup', 'rsqrt_decay', 'decay_every',
                    'linear_decay')


def multifactor(factors='constant * linear_warmup * rsqrt_decay', constant=0.1,
                warmup_steps=400, decay_factor=0.5, steps_per_decay=20000,
                minimum=0.0, total_steps=1):
    """step -> value, the product of the named factors, floored at `minimum`.

    Trax's factors; `linear_decay` (1 -> 0 over `total_steps`) is ours, added
    because annealing the learning rate makes the final policy stable. The
    result is an optax schedule (any callable count -> value is one).
    """
    names = [name.strip() for name in factors.split('*') if name.strip()]
    for name in names:
        if name not in SCHEDULE_FACTORS:
            raise UsageError(f'unknown schedule factor {name!r}; allowed: '
                             + ', '.join(SCHEDULE_FACTORS))

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        value = jnp.float32(1.0)
        for name in names:
            if name == 'constant':
                value = value * constant
            elif name == 'linear_warmup':
                value = value * jnp.minimum(1.0, step / warmup_steps)
            elif name == 'rsqrt_decay':
                value = value / jnp.sqrt(jnp.maximum(step, warmup_steps))
            elif name == 'decay_every':
                value = value * decay_factor ** jnp.floor(step / steps_per_decay)
            elif name == 'linear_decay':
                value = value * jnp.maximum(0.0, 1.0 - step / total_steps)
        return jnp.maximum(value, minimum)

    return schedule


# ---------------------------------------------------------------------------
# Config fields: each algorithm's Config is a frozen dataclass whose fields
# carry their help line and constraint (the harness makes them flags).
# ---------------------------------------------------------------------------


def option(default, help, sweep=False, bounds=None, choices=None, aliases=()):
    """A config field with its --help line and its constraint.

    `sweep`: the flag takes a comma list (a grid over runs). `bounds`: an
    interval such as '[1, inf)' or '(0, 1]' that every value must lie in (each
    tuple entry, each sweep value); an int field without bounds still must fit
    int32. Every float must be finite, unless its bounds close on inf ('[0,
    inf]'). `choices`: the allowed strings. `check_fields` enforces them all.
    `aliases`: other flag names for the field (Trax's name, where ours differs).
    """
    if bounds is not None:
        Bounds.parse(bounds)  # a malformed interval fails at import, not at run time
    return dataclasses.field(default=default, metadata={
        'help': help, 'sweep': sweep, 'bounds': bounds, 'choices': choices,
        'aliases': tuple(aliases)})


INT32_MAX = 2 ** 31 - 1  # counters and sizes live in int32 arrays


def check_int32_products(products):
    """UsageError naming the first product of flags past int32, the integers
    the compiled program counts and indexes in (a counter that wraps, a size
    JAX cannot take): `products` is [(what it counts, [(flag, value), ...])],
    checked before anything is traced."""
    for what, factors in products:
        value = math.prod(int(factor) for _, factor in factors)
        if value > INT32_MAX:
            said = ' x '.join(f'{flag} {factor}' for flag, factor in factors)
            raise UsageError(f'{what} per run would be {said} = {value}, past {INT32_MAX}, the '
                             'largest int32, which the program counts in; lower one of them')


def env_steps_factors(config, n_envs, steps, max_steps):
    """The flags behind a run's env steps per epoch: --n-interactions-per-epoch,
    or --n-trajectories-per-epoch episodes of up to `max_steps` steps."""
    if config.n_trajectories_per_epoch:
        cap = (('--max-steps', max_steps) if getattr(config, 'max_steps', None)
               else (f"{config.env}'s episode cap", max_steps))
        return [('--n-trajectories-per-epoch', n_envs), cap]
    return [('--n-interactions-per-epoch', n_envs * steps)]


@dataclasses.dataclass(frozen=True)
class Bounds:
    """An interval, written as in maths: '[1, inf)', '(0, 1]', '[0, 1)'."""
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text):
        text = text.strip()
        if len(text) < 5 or text[0] not in '[(' or text[-1] not in '])' or ',' not in text:
            raise ValueError(f'bounds {text!r}: expected an interval like "[0, 1)"')
        low, high = (float(part) for part in text[1:-1].split(','))
        return cls(low, high, text[0] == '[', text[-1] == ']')

    def __contains__(self, value):
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def __str__(self):
        def number(x):
            return ('-inf' if x < 0 else 'inf') if math.isinf(x) else f'{x:g}'
        if math.isinf(self.high) and not self.high_closed:
            return f'{">=" if self.low_closed else ">"} {number(self.low)}'
        return (f'in {"[" if self.low_closed else "("}{number(self.low)}, '
                f'{number(self.high)}{"]" if self.high_closed else ")"}')


def _field_kinds(config_cls):
    hints = typing.get_type_hints(config_cls)
    return {field.name: _base_type(hints[field.name]) for field in dataclasses.fields(config_cls)}


def constraint_text(field, kind):
    """The constraint as --help shows it, e.g. 'in (0, 1]' or '>= 1' ('' if none)."""
    if field.metadata.get('choices'):
        return 'one of ' + ', '.join(field.metadata['choices'])
    if field.metadata.get('bounds'):
        return str(Bounds.parse(field.metadata['bounds']))
    return 'finite' if kind is float else ''


def _value_error(field, kind, value):
    """Why one value breaks the field's constraint, or None if it is fine."""
    choices, bounds = field.metadata.get('choices'), field.metadata.get('bounds')
    if choices and value not in choices:
        return f'must be {constraint_text(field, kind)}'
    if kind not in (int, float):
        return None
    interval = Bounds.parse(bounds) if bounds else None
    if kind is float and math.isnan(value):
        return 'must be a number'
    if kind is float and math.isinf(value) and not (interval and value in interval):
        return 'must be finite'
    if interval is not None and value not in interval:
        return f'must be {interval}'
    if kind is int and abs(value) > INT32_MAX:
        return f'must be at most {INT32_MAX} in size (int32)'
    return None


def check_fields(config, grid=None):
    """Every field's declared constraint, on every value: the config's, each
    entry of a tuple and each value of a sweep list. Raises UsageError naming
    the flag. Cross-field rules stay in each script's check_config."""
    kinds = _field_kinds(type(config))
    for field in dataclasses.fields(config):
        kind, is_tuple, _ = kinds[field.name]
        values = (grid or {}).get(field.name, [getattr(config, field.name)])
        for value in values:
            if value is None:  # an Optional field left unset
                continue
            for entry in (value if is_tuple else (value,)):
                why = _value_error(field, kind, entry)
                if why:
                    what = 'entries ' if is_tuple else ''
                    raise UsageError(f'--{field.name.rstrip("_").replace("_", "-")} {what}{why}, got '
                                     f'{_show(value)}')


def _show(value):
    if isinstance(value, tuple):
        return ','.join(f'{v:g}' if isinstance(v, float) else str(v) for v in value)
    return f'{value:g}' if isinstance(value, float) else repr(value) if isinstance(
        value, str) else str(value)


def _base_type(annotation):
    """(element type, is_tuple, optional) of a field annotation."""
    optional = False
    args = typing.get_args(annotation)
    if type(None) in args:  # Optional[X] / X | None
        optional = True
        annotation = next(a for a in args if a is not type(None))
        args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple:
        return args[0], True, optional
    return annotation, False, optional


# ---------------------------------------------------------------------------
# The agent record and runs: an algorithm is pure per-run functions; runs are
# seeds x a grid of sweepable hyperparameters, vmapped in one program.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Agent:
    """An algorithm as pure per-run functions (hp = that run's hyperparameters).

    init(key, hp) -> state; collect/train/evaluate(hp, state) -> (state, metrics).
    `state.params` must hold the network parameters and `state.train_step` the
    gradient-step counter. `spec` is the static record make_agent derived
    from the config (env, shapes, modes, sizes), which the algorithm's
    module-level functions take as their first argument.
    """
    name: str
    init: typing.Callable
    collect: typing.Callable
    train: typing.Callable
    evaluate: typing.Callable
    eval_tags: list  # [(temperature, steps)] evaluated each epoch
    max_steps: int  # the episode cap actually used
    memory_flags: str = '--num-seeds'  # what to lower when the runs do not fit
    spec: typing.Any = None

    def batched(self, name):
        """jit(vmap(phase `name`)) over a leading runs axis, made once per
        agent: jit caches its trace, so the memory estimate, the chunk's
        metric shapes and the chunk itself trace each phase once."""
        cache = self.__dict__.setdefault('_batched', {})
        if name not in cache:
            cache[name] = jax.jit(jax.vmap(getattr(self, name)))
        return cache[name]

    def learn(self, hp, state):
        """One epoch's learning, collect -> train, as one pure function."""
        state, collect_metrics = self.collect(hp, state)
        state, train_metrics = self.train(hp, state)
        return state, {**collect_metrics, **train_metrics}

    def epoch(self, hp, state):
        """One whole epoch, collect -> train -> evaluate, as one pure function:
        (state, metrics), jittable, vmappable and scannable over epochs."""
        state, metrics = self.learn(hp, state)
        state, eval_metrics = self.evaluate(hp, state)
        return state, {**metrics, **eval_metrics}


def evaluation_key(state):
    """This evaluation's key: the run's evaluation stream (`state.eval_key`,
    split off at init) folded with the epoch. Training never draws from it and
    it is never advanced, so how often a run evaluates cannot change how it
    trains, and an epoch's evaluation is the same whenever it is run."""
    return jax.random.fold_in(state.eval_key, state.epoch)


def eval_key(temperature, steps):
    """Trax's summary tag for an evaluation figure."""
    return f'rl/avg_return_temperature{temperature:.2f}_steps{steps}'




def compiler_options(batch_invariant=True):
    """XLA options for the compiled phases (CPU only; XLA_FLAGS takes precedence).

    LLVM's backend optimisation level 2 instead of XLA's default 3 halves the
    compile time, which dominates short runs, while these programs (many
    small kernels) run as fast. `batch_invariant` makes each run's numbers
    bitwise the same whether it runs alone, in a grid or sharded over
    devices: it turns off XLA's YNNPACK elementwise and reduction fusions,
    which pick other kernels (other rounding) for another number of runs, and
    the algebraic simplifier, which reassociates divisions differently in a
    sharded program. YNNPACK's matmul fusions stay: they are invariant and
    the fastest (64 CartPole DQN seeds: 16 s with them alone, 17 s with XLA's
    default fusions, 23 s with none); algsimp costs nothing measurable.
    """
    if jax.default_backend() != 'cpu':
        return None
    flags = os.environ.get('XLA_FLAGS', '')
    options = {}
    if 'xla_backend_optimization_level' not in flags:
        options['xla_backend_optimization_level'] = 2
    if batch_invariant:
        if 'xla_cpu_experimental_ynn_fusion_type' not in flags:
            options['xla_cpu_experimental_ynn_fusion_type'] = 'LIBRARY_FUSION_TYPE_DOT'
        if 'xla_disable_hlo_passes' not in flags:
            options['xla_disable_hlo_passes'] = 'algsimp'
    return options


def expand_runs(config, grid, seed, num_seeds):
    """One dict per run: the grid point (outer, in flag order) times seeds (inner)."""
    names = list(grid)
    runs = []
    for point in itertools.product(*(grid[name] for name in names)):
        for offset in range(num_seeds):
            run = {'seed': seed + offset}
            run.update({name: getattr(config, name) for name in sweep_fields(config)})
            run.update(dict(zip(names, point)))
            runs.append(run)
    return runs


def sweep_fields(config):
    return [f.name for f in dataclasses.fields(config) if f.metadata.get('sweep')]


def hyperparameters(config, runs):
    """{sweepable field: float32 array [n_runs]}, the traced per-run values."""
    return {name: jnp.asarray([run[name] for run in runs], jnp.float32)
            for name in sweep_fields(config)}


def run_keys(runs):
    """Each run's PRNG key, PRNGKey(its seed), built in one call."""
    return jax.vmap(jax.random.PRNGKey)(jnp.asarray([run['seed'] for run in runs], jnp.int32))


def evaluation_period(config):
    """Epochs between evaluations: --eval-every, by default about 20 a run."""
    return config.eval_every or max(1, config.epochs // 20)


def evaluation_due(epoch, epochs, eval_every):
    """Is epoch `epoch` (1-based) evaluated? Every eval_every-th and the last.
    Python ints or traced scalars alike."""
    return (epoch % eval_every == 0) | (epoch == epochs)


def params_finite(params):
    """Are all of one run's floating-point parameters finite? (bool scalar)"""
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(params)
                                if jnp.issubdtype(leaf.dtype, jnp.floating)] or [True]))


def run_epochs(agent, length, hp, state, start, n, epochs, eval_every):
    """Epochs start+1 .. start+n (n <= length) of every run as one compiled
    loop: learn (collect -> train) each epoch and evaluate the due ones.

    hp and state carry a leading runs axis; start, n, epochs and eval_every
    are int32 scalars, traced, so one compiled program serves every chunk of
    a run: splitting a run into chunks of any sizes gives bitwise the same
    numbers. Evaluation sits under a `lax.cond` outside the vmap, so epochs
    not due skip it. Returns (state, metrics {name: [n_runs, length]},
    finite [n_runs, length]): entries past n are zeros, evaluation figures
    NaN in epochs not evaluated; finite says the parameters were finite
    after each epoch (the NaN guard).
    """
    learn, evaluate = agent.batched('learn'), agent.batched('evaluate')
    learnt_shapes = jax.eval_shape(learn, hp, state)[1]
    eval_shapes = jax.eval_shape(evaluate, hp, state)[1]
    not_evaluated = {name: jnp.full(shape.shape, jnp.nan, shape.dtype)
                     for name, shape in eval_shapes.items()}
    buffers = {name: jnp.zeros((length,) + shape.shape, shape.dtype)
               for name, shape in {**learnt_shapes, **eval_shapes}.items()}
    finite = jnp.zeros((length,) + state.epoch.shape, bool)

    def one_epoch(i, carry):
        state, buffers, finite = carry
        state, metrics = learn(hp, state)
        metrics.update(jax.lax.cond(evaluation_due(start + i + 1, epochs, eval_every),
                                    lambda s: evaluate(hp, s)[1], lambda s: not_evaluated,
                                    state))
        buffers = {name: buffers[name].at[i].set(value) for name, value in metrics.items()}
        return state, buffers, finite.at[i].set(jax.vmap(params_finite)(state.params))

    state, buffers, finite = jax.lax.fori_loop(0, n, one_epoch, (state, buffers, finite))
    runs_first = lambda rows: jnp.moveaxis(rows, 0, 1)  # noqa: E731
    return state, jax.tree.map(runs_first, buffers), runs_first(finite)


def run_sweep(agent, config, seed=0, num_seeds=1, grid=None, epochs=None,
              batch_invariant=True):
    """Run `num_seeds` seeds (seed, seed + 1, ...) x every point of `grid`
    ({sweepable field: [values]}) for `epochs` epochs (default: config.epochs)
    as one compiled program: init, then `run_epochs` (learn every epoch,
    evaluate every `evaluation_period(config)`-th and the last), vmapped over
    the runs and compiled with the command line's XLA options, so each run's
    numbers are bitwise those of `python <algorithm>.py` with the same flags
    (its metrics.jsonl, but timings).

    `agent` is `make_agent(config)`. Returns (runs, state, metrics): one dict
    per run (its seed and hyperparameter values), the final state with a
    leading runs axis, and {metric: array [epochs, n_runs]}, the evaluation
    figures NaN in the epochs not evaluated.
    """
    check_precision()
    grid = dict(grid or {})
    unknown = sorted(set(grid) - set(sweep_fields(config)))
    if unknown:
        raise UsageError(f'grid fields {unknown} are not sweepable; sweepable: '
                         + ', '.join(sweep_fields(config)))
    check_fields(config, grid)
    runs = expand_runs(config, grid, seed, num_seeds)
    hp, keys = hyperparameters(config, runs), run_keys(runs)
    options = compiler_options(batch_invariant)
    state = agent.batched('init').lower(keys, hp).compile(compiler_options=options)(keys, hp)

    epochs = config.epochs if epochs is None else epochs
    plan = [jnp.int32(value) for value in (0, epochs, epochs, evaluation_period(config))]
    chunk = jax.jit(functools.partial(run_epochs, agent, epochs))
    state, metrics, _ = chunk.lower(hp, state, *plan).compile(compiler_options=options)(
        hp, state, *plan)
    return runs, state, {name: values.T for name, values in metrics.items()}
