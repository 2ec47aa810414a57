"""The research core dqn.py, pg.py and actor_critic.py share: Trax's advantage
estimators and remaining_evals, gymnax envs, MLP and conv networks, multifactor
schedules, the Agent record and run_sweep (seeds x a grid, one compiled
program). The Config contract and the plain command line are fields.py's."""

import contextlib
import contextvars
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

# Advantage estimators: trax/rl/advantages.py's signatures and numerics in jnp/lax,
# so they jit and vmap. Arrays are [batch, length]; a result is [batch, length -
# margin]. Inputs are checked with chex while tracing (free at run time), as rlax.


def check_args(assertion, function, expected, **arrays):
    """chex `assertion(array, expected)` on each keyword array, naming the one that fails."""
    for name, array in arrays.items():
        assertion(array, expected, custom_message=f'argument `{name}` of {function}')


def _check_estimator_inputs(function, rewards, returns, values, dones, discount_mask):
    arrays = dict(rewards=rewards, returns=returns, values=values, dones=dones,
                  discount_mask=discount_mask)
    check_args(chex.assert_rank, function, 2, **arrays)
    chex.assert_equal_shape(list(arrays.values()), custom_message=f'{function}: rewards, '
                            'returns, values, dones, discount_mask share one shape')


def mask_discount(discount, discount_mask):
    """`discount` (a scalar) where the mask is set, 1 elsewhere (any shape)."""
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
    """'auto': 'associative' on GPU/TPU, where a lax.scan runs a kernel per step
    (rlax PR #168: 4.5x at batch x time 1024 x 16), 'sequential' on CPU."""
    if scan not in SCANS:
        raise ValueError(f'scan must be one of {SCANS}, got {scan!r}')
    if scan == 'auto':
        return 'sequential' if jax.default_backend() == 'cpu' else 'associative'
    return scan


def reverse_affine_scan(a, b):
    """x[:, t] = a[:, t] x[:, t + 1] + b[:, t], from the end (0 past it), in
    O(log length) depth: affine maps compose, (a1, b1) o (a2, b2) = (a1 a2, a1 b2 + b1)."""
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


# remaining_evals: trax/rl/training.py's, unchanged.


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


# Environments ---------------------------------------------------------------

class UsageError(ValueError):
    """Bad input from the user: reported as one line and exit status 2.
    `field`: the Config field refused, if one; `inert`: refused as unable to
    act with the other fields (an env's setting of it is dropped instead)."""

    def __init__(self, message, field=None, inert=False):
        super().__init__(message)
        self.field, self.inert = field, inert


INT32_MAX = 2 ** 31 - 1  # counters, sizes and seeds live in int32 arrays


def check_precision():
    """UsageError under jax_enable_x64: the programs, checkpoints and bitwise
    resumes are float32 and int32 (x64 would mix int32 and int64 in the loops)."""
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
    # gymnax imports seaborn and matplotlib.pyplot only to render; they (with
    # scipy and pandas) take a second to import, so they load when first used.
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
    """`env.step` without gymnax's auto-reset (most of a step's cost and compile
    time), for rollouts that use each env's first episode only: the same
    outputs until the episode ends (the key split as `env.step` splits it)."""
    step_key, _ = jax.random.split(key)
    obs, state, reward, terminated, info = env.step_env(step_key, state, action, env_params)
    truncated = env.is_truncated(state, env_params)
    return obs, state, reward, terminated, truncated, {**info, 'final_observation': obs}


def space_kind(space):
    """'discrete' or 'box' for a gymnax space; anything else is refused."""
    kind = type(space).__name__
    if kind in ('Discrete', 'Box'):
        return kind.lower()
    raise UsageError(f'action space {kind} is not supported (only Discrete and Box)')


def env_max_steps(env_params):
    return int(getattr(env_params, 'max_steps_in_episode', 1000))


# Networks: a plain MLP over a params pytree (Trax's MLP: Dense + Relu) ------


def init_mlp(key, sizes, last_scale=1.0, layer_norm=False):
    """[{'w', 'b'}] for layer sizes [in, hidden..., out]: Glorot-uniform weights
    (Trax's Dense default), the last layer's times `last_scale`, zero biases;
    `layer_norm`: each hidden layer's LayerNorm 'scale' (ones), 'offset' (zeros)."""
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
ACTIVATIONS = {'relu': jax.nn.relu, 'tanh': jnp.tanh}  # Trax's Relu; PureJaxRL's PPO's tanh


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


# Inside transposed_weight_gradients(), dense's weight gradient is one
# dot_general whose output is already [n, m]. JAX's own rule computes [m, n]
# and transposes; without the algebraic simplifier (compiler_options) XLA CPU
# keeps chains of those transposes in the optimiser's fusions (--joint PPO's
# CartPole epoch: about 6% faster). Applied everywhere it changed DQN's
# numbers in the last bits, so only code that opts in gets it.
_TRANSPOSE_FREE = contextvars.ContextVar('transpose_free', default=False)


def dense(x, w):
    """x [..., n] @ w [n, m]."""
    return _transpose_free_matmul(x, w) if _TRANSPOSE_FREE.get() else x @ w


@contextlib.contextmanager
def transposed_weight_gradients():
    """While tracing inside it, dense differentiates without transposes."""
    token = _TRANSPOSE_FREE.set(True)
    try:
        yield
    finally:
        _TRANSPOSE_FREE.reset(token)


@jax.custom_vjp
def _transpose_free_matmul(x, w):
    return x @ w


def _matmul_forward(x, w):
    return x @ w, (x, w)


def _matmul_backward(saved, g):
    x, w = saved
    leading = tuple(range(x.ndim - 1))
    return (jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ()))),
            jax.lax.dot_general(x, g, ((leading, leading), ((), ()))))


_transpose_free_matmul.defvjp(_matmul_forward, _matmul_backward)


def mlp(params, x, activation='relu'):
    """Apply an MLP made by init_mlp; `activation` between layers, linear output."""
    return dense(mlp_hidden(params, x, activation), params[-1]['w']) + params[-1]['b']


def mlp_hidden(params, x, activation='relu'):
    """The features an MLP's last layer reads: every layer but the last, each
    followed by its LayerNorm if it has one, then `activation`."""
    check_args(chex.assert_rank, 'mlp', 2, **{f'params[{i}]["w"]': layer['w']
                                              for i, layer in enumerate(params)})
    check_args(chex.assert_rank, 'mlp', 1, **{f'params[{i}]["b"]': layer['b']
                                              for i, layer in enumerate(params)})
    check_args(chex.assert_shape, 'mlp', (..., params[0]['w'].shape[0]), x=x)
    for layer in params[:-1]:
        x = ACTIVATIONS[activation](layer_norm(layer, dense(x, layer['w']) + layer['b']))
    return x


# The conv torso for [..., H, W, C] observations, the MinAtar paper's (Young &
# Tian 2019): 3x3 convs, stride 1, no padding, ReLU, flatten, then the MLP; a
# network is {'conv': [{'w', 'b'}], 'mlp': init_mlp(...)}, an MLP-only one a list.

TORSOS = ('auto', 'mlp', 'conv')


def resolve_torso(torso, obs_shape, choices=TORSOS):
    """'mlp', 'conv' or 'gru' for --torso: auto means conv for rank-3 observations."""
    if torso not in choices:
        raise UsageError(f'--torso must be one of {", ".join(choices)}, got {torso!r}',
        field='torso')
    if torso == 'auto':
        return 'conv' if len(obs_shape) == 3 else 'mlp'
    if torso == 'conv' and len(obs_shape) != 3:
        raise UsageError(f'--torso conv needs [height, width, channels] observations; '
                         f'this env\'s are {list(obs_shape)}', field='torso')
    return torso


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
    """init_conv's layers on [..., H, W, C] -> features [..., H' * W' * C'], as
    im2col (shifted slices, one matmul): a tenth of conv_general_dilated_patches'
    time on XLA CPU and, unlike a vmapped conv_general_dilated, bitwise the same
    for a run alone, in a grid or sharded."""
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


# Larger batches go through the conv layers in chunks of this many: a 4096-step
# MinAtar rollout took 126 ms whole (37 MB of patches) and 23 ms in chunks.
CONV_CHUNK = 512


def conv_layers(params, x, stride=1):
    """conv's layers on one batch [N, H, W, C] -> [N, H', W', C']."""
    for layer in params:
        kernel = layer['w']  # [k, k, in, out]
        size, _, channels_in, channels_out = kernel.shape
        x = jax.nn.relu(layer_norm(layer, dense(conv_patches(x, size, stride),
                                                kernel.reshape(-1, channels_out)) + layer['b']))
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
                 conv_channels=(16,), last_scale=1.0, layer_norm=False):
    """Params of torso (flatten, or conv_channels 3x3 convs) + MLP head;
    `layer_norm`: a LayerNorm before every hidden ReLU (conv and dense)."""
    if torso == 'conv':
        conv_key, mlp_key = jax.random.split(key)
        features = int(np.prod(conv_output_shape(obs_shape, conv_channels)))
        return {'conv': init_conv(conv_key, obs_shape[-1], conv_channels,
                                  layer_norm=layer_norm),
                'mlp': init_mlp(mlp_key, [features, *hidden_sizes, n_outputs], last_scale,
                                layer_norm)}
    return init_mlp(key, [int(np.prod(obs_shape)), *hidden_sizes, n_outputs], last_scale,
                    layer_norm)


def network(params, obs, obs_shape, activation='relu'):
    """Apply init_network's params to observations [..., *obs_shape] (float32)."""
    return mlp(*torso(params, obs, obs_shape, activation), activation)


def torso(params, obs, obs_shape, activation='relu'):
    """(the MLP's layers, its input): conv features, or the observations flat."""
    obs = jnp.asarray(obs).astype(jnp.float32)
    if isinstance(params, dict) and 'conv' in params:
        return params['mlp'], conv(params['conv'], obs)  # (ReLU: --activation is the MLP's)
    batch_shape = obs.shape[:obs.ndim - len(obs_shape)]
    return params, obs.reshape(batch_shape + (int(np.prod(obs_shape, dtype=int)),))


# Schedules: Trax's lr.multifactor in jnp, its values traceable per run ------

SCHEDULE_FACTORS = ('constant', 'linear_warmup', 'rsqrt_decay', 'decay_every',
                    'linear_decay')


def schedule_factors(factors):
    """The factor names of a multifactor string, each one checked."""
    names = [name.strip() for name in factors.split('*') if name.strip()]
    if not names:
        raise UsageError(f'--lr-schedule {factors!r} names no factor '
                         "(e.g. 'constant' or 'constant * linear_decay')", field='lr_schedule')
    for name in names:
        if name not in SCHEDULE_FACTORS:
            raise UsageError(f'unknown schedule factor {name!r}; allowed: '
                             + ', '.join(SCHEDULE_FACTORS))
    return names


def multifactor(factors='constant * linear_warmup * rsqrt_decay', constant=0.1,
                warmup_steps=400, decay_factor=0.5, steps_per_decay=20000,
                minimum=0.0, total_steps=1):
    """step -> value (an optax schedule): the product of the named factors,
    floored at `minimum`. Trax's factors, and ours `linear_decay` (1 -> 0 over
    `total_steps`): annealing the learning rate makes the final policy stable."""
    names = schedule_factors(factors)

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


# The agent record and runs: seeds x a grid of hyperparameters, vmapped ------


@dataclasses.dataclass
class Agent:
    """An algorithm as pure per-run functions (hp: the run's hyperparameters):
    init(key, hp) -> state (with .params, .train_step); collect/train/evaluate(hp,
    state) -> (state, metrics). `spec`: the static record its functions take."""
    name: str
    init: typing.Callable
    collect: typing.Callable
    train: typing.Callable
    evaluate: typing.Callable
    eval_tags: list  # [(temperature, steps)] evaluated each epoch
    max_steps: int  # the episode cap actually used
    memory_flags: str = '--num-seeds'  # what to lower when the runs do not fit
    spec: typing.Any = None
    config: typing.Any = None  # the config make_agent was given
    check_runs: typing.Callable = None  # (config, runs): the algorithm's cross-field rules
    obs_shape: tuple = ()  # one observation's

    def batched(self, name):
        """jit(vmap(phase `name`)) over runs, made once per agent (traced once)."""
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
        """collect -> train -> evaluate, one pure function of (hp, state)."""
        state, metrics = self.learn(hp, state)
        state, eval_metrics = self.evaluate(hp, state)
        return state, {**metrics, **eval_metrics}


def evaluation_key(state):
    """The run's own evaluation stream folded with the epoch: how often a run
    evaluates never changes how it trains."""
    return jax.random.fold_in(state.eval_key, state.epoch)


def return_tag(temperature, steps):
    """Trax's summary tag (a metric's name, not a PRNG key) for the average
    return of evaluations at `temperature`, each episode cut at `steps`."""
    return f'rl/avg_return_temperature{temperature:.2f}_steps{steps}'


def compiler_options(batch_invariant=True):
    """XLA options on CPU (XLA_FLAGS wins): LLVM level 2 halves compile time for
    the same speed; `batch_invariant` keeps a run bitwise the same alone, in a
    grid or sharded (no YNNPACK elementwise fusions, no algebraic simplifier)."""
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
    names, base = list(grid), {name: getattr(config, name) for name in sweep_fields(config)}
    return [{'seed': seed + offset, **base, **dict(zip(names, point))}
            for point in itertools.product(*(grid[name] for name in names))
            for offset in range(num_seeds)]


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
    """Epochs start+1 .. start+n (n <= length) of every run, one compiled loop;
    the ints are traced, so one program serves any split into chunks, bitwise.
    -> (state, metrics {name: [n_runs, length]} (NaN where not evaluated),
    finite [n_runs, length]: were the parameters finite after each epoch)."""
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
    """Seeds seed.. x every point of `grid` ({sweepable field: [values]}) in one
    compiled program, each run bitwise its metrics.jsonl; `agent` is make_agent(config).
    -> (runs: a dict each, its seed and values; final state [n_runs, ...];
    {metric: [epochs, n_runs]}, NaN in epochs not evaluated)."""
    check_precision()
    if config != agent.config:  # another config's agent would mix the two silently
        raise UsageError('run_sweep: `config` is not the one its agent was made from; '
                         'pass make_agent(config)')
    epochs = config.epochs if epochs is None else epochs
    import fields  # the Config contract (which imports this file)
    fields.check_sweep_args(config, seed, num_seeds, epochs, batch_invariant)
    fields.check_grid(config, grid or {}, agent.check_runs)
    runs, hp, state, chunk = compiled_runs(agent, config, grid, seed, num_seeds, epochs,
                                           batch_invariant)
    state, metrics, _ = chunk(hp, state, *plan(config, 0, epochs, epochs))
    return runs, state, {name: values.T for name, values in metrics.items()}


def compiled_runs(agent, config, grid, seed, num_seeds, length, batch_invariant=True):
    """-> (runs, hp, initial state, run_epochs of `length` compiled) for seeds x grid."""
    runs = expand_runs(config, grid or {}, seed, num_seeds)
    hp, keys = hyperparameters(config, runs), run_keys(runs)
    options = compiler_options(batch_invariant)
    state = agent.batched('init').lower(keys, hp).compile(compiler_options=options)(keys, hp)
    chunk = jax.jit(functools.partial(run_epochs, agent, length)).lower(
        hp, state, *plan(config, 0, 1)).compile(compiler_options=options)
    return runs, hp, state, chunk


def plan(config, start, n, epochs=None):
    """run_epochs' traced ints: epochs start+1 .. start+n of `epochs`."""
    return [jnp.int32(v) for v in (start, n, epochs or config.epochs,
                                   evaluation_period(config))]

