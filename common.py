"""What dqn.py and pg.py share: Trax's advantage estimators, its `remaining_evals`
helper, and the small plumbing every run needs (env by name, MLP, schedules,
config flags, atomic checkpoints, metrics files, processes, the epoch loop).

Copy this file together with dqn.py or pg.py; nothing here imports either script.
Importing it compiles nothing.
"""

import argparse
import contextlib
import copy
import dataclasses
import datetime
import fcntl
import glob
import hashlib
import importlib
import importlib.util
import io
import itertools
import json
import math
import os
import signal
import sys
import threading
import time
import types
import typing
import zipfile

import chex
import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------
# Advantage estimators: trax/rl/advantages.py, same signatures and numerics,
# rewritten with jnp/lax so they jit and vmap (Trax wrote into numpy arrays).
# Every array is [batch, length]; a result is [batch, length - margin].
# Inputs are checked with chex, as rlax does, while tracing: free at run time.
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


def _lambda_estimator_inputs(gamma, lambda_, values, dones, discount_mask):
    gammas = mask_discount(gamma, discount_mask).astype(values.dtype)
    lambdas = mask_discount(lambda_, discount_mask).astype(values.dtype)
    not_done = 1.0 - jnp.asarray(dones).astype(values.dtype)
    return gammas, lambdas, not_done


def td_lambda(gamma, margin, lambda_=0.95):
    """TD(lambda) return minus value, computed backwards from the last value."""
    def estimator(rewards, returns, values, dones, discount_mask):
        _check_estimator_inputs('td_lambda estimator', rewards, returns, values, dones,
                                discount_mask)
        gammas, lambdas, not_done = _lambda_estimator_inputs(
            gamma, lambda_, values, dones, discount_mask)
        length = returns.shape[1]

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


def gae(gamma, margin, lambda_=0.95):
    """Generalised advantage estimation; the last step's advantage is 0."""
    def estimator(rewards, returns, values, dones, discount_mask):
        _check_estimator_inputs('gae estimator', rewards, returns, values, dones,
                                discount_mask)
        gammas, lambdas, not_done = _lambda_estimator_inputs(
            gamma, lambda_, values, dones, discount_mask)
        length = returns.shape[1]

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


def init_mlp(key, sizes, last_scale=1.0):
    """[{'w', 'b'}] for layer sizes [in, hidden..., out].

    Glorot-uniform weights (Trax's Dense default) and zero biases; the last
    layer's weights are multiplied by `last_scale` (small for policy heads).
    """
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for i, (key_i, fan_in, fan_out) in enumerate(zip(keys, sizes[:-1], sizes[1:])):
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        weights = jax.random.uniform(key_i, (fan_in, fan_out), minval=-limit, maxval=limit)
        if i == len(sizes) - 2:
            weights = weights * last_scale
        params.append({'w': weights, 'b': jnp.zeros((fan_out,))})
    return params


def mlp(params, x):
    """Apply an MLP made by init_mlp; ReLU between layers, linear output."""
    return mlp_hidden(params, x) @ params[-1]['w'] + params[-1]['b']


def mlp_hidden(params, x):
    """The features an MLP's last layer reads: every layer but the last, each
    followed by ReLU (x itself for an MLP with no hidden layer)."""
    check_args(chex.assert_rank, 'mlp', 2, **{f'params[{i}]["w"]': layer['w']
                                              for i, layer in enumerate(params)})
    check_args(chex.assert_rank, 'mlp', 1, **{f'params[{i}]["b"]': layer['b']
                                              for i, layer in enumerate(params)})
    check_args(chex.assert_shape, 'mlp', (..., params[0]['w'].shape[0]), x=x)
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer['w'] + layer['b'])
    return x


# ---------------------------------------------------------------------------
# Conv torso for image observations ([..., H, W, C], e.g. MinAtar's 10x10xC
# grids): the MinAtar paper's network (Young & Tian 2019) is one 3x3 conv of
# 16 channels, stride 1, no padding, ReLU, flatten, then the MLP (dense 128).
# A network is then {'conv': [{'w', 'b'}], 'mlp': init_mlp(...)}; an MLP-only
# network stays init_mlp's plain list.
# ---------------------------------------------------------------------------

TORSOS = ('auto', 'mlp', 'conv')
_CONV_DIMENSIONS = ('NHWC', 'HWIO', 'NHWC')  # observations are channels-last


def resolve_torso(torso, obs_shape):
    """'mlp' or 'conv' for --torso: auto means conv for rank-3 observations."""
    if torso not in TORSOS:
        raise UsageError(f'--torso must be one of {", ".join(TORSOS)}, got {torso!r}')
    if torso == 'auto':
        return 'conv' if len(obs_shape) == 3 else 'mlp'
    if torso == 'conv' and len(obs_shape) != 3:
        raise UsageError(f'--torso conv needs [height, width, channels] observations; '
                         f'this env\'s are {list(obs_shape)}')
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


def init_conv(key, in_channels, channels, kernel=3):
    """[{'w': [k, k, in, out], 'b': [out]}] per layer; Glorot-uniform over the
    receptive field (fan = k * k * channels, as Trax's Conv) and zero biases."""
    params = []
    keys = jax.random.split(key, max(len(channels), 1))
    for key_i, fan_in, fan_out in zip(keys, (in_channels, *channels[:-1]), channels):
        limit = math.sqrt(6.0 / (kernel * kernel * (fan_in + fan_out)))
        params.append({'w': jax.random.uniform(key_i, (kernel, kernel, fan_in, fan_out),
                                               minval=-limit, maxval=limit),
                       'b': jnp.zeros((fan_out,))})
    return params


def conv(params, x, stride=1):
    """Conv layers made by init_conv, each followed by ReLU, on [..., H, W, C];
    returns the features flattened, [..., H' * W' * C'].

    Written as im2col: `lax.conv_general_dilated_patches` (a convolution with
    a constant 0/1 kernel, so exact) and one matmul with the kernel. It equals
    `lax.conv_general_dilated` up to float rounding, but stays bitwise the
    same for a run alone, in a grid or sharded (see compiler_options): vmap
    turns a per-run kernel in `conv_general_dilated` into a grouped
    convolution over the runs, whose kernel gradient XLA CPU sums in another
    order for 8 runs than for 1, while the matmul is YNNPACK's, which does not.
    """
    batch_shape = x.shape[:-3]
    x = x.reshape((-1,) + x.shape[-3:])  # lax wants exactly one batch dim
    for layer in params:
        kernel = layer['w']  # [k, k, in, out]
        size, _, channels_in, channels_out = kernel.shape
        # [N, H', W', in * k * k], features ordered (in, row, column).
        patches = jax.lax.conv_general_dilated_patches(
            x, (size, size), (stride, stride), 'VALID', dimension_numbers=_CONV_DIMENSIONS)
        weights = jnp.transpose(kernel, (2, 0, 1, 3)).reshape(channels_in * size * size,
                                                               channels_out)
        x = jax.nn.relu(patches @ weights + layer['b'])
    return x.reshape(batch_shape + (-1,))


def init_network(key, obs_shape, hidden_sizes, n_outputs, torso='mlp',
                 conv_channels=(16,), last_scale=1.0):
    """Params of torso (flatten, or conv_channels 3x3 convs) + MLP head."""
    if torso == 'conv':
        conv_key, mlp_key = jax.random.split(key)
        features = int(np.prod(conv_output_shape(obs_shape, conv_channels)))
        return {'conv': init_conv(conv_key, obs_shape[-1], conv_channels),
                'mlp': init_mlp(mlp_key, [features, *hidden_sizes, n_outputs], last_scale)}
    return init_mlp(key, [int(np.prod(obs_shape)), *hidden_sizes, n_outputs], last_scale)


def network(params, obs, obs_shape):
    """Apply init_network's params to observations [..., *obs_shape] (float32)."""
    return network_head(params, network_features(params, obs, obs_shape))


def network_features(params, obs, obs_shape):
    """The features init_network's last layer reads (torso, then hidden layers)."""
    obs = jnp.asarray(obs).astype(jnp.float32)
    batch_shape = obs.shape[:obs.ndim - len(obs_shape)]
    if isinstance(params, dict) and 'conv' in params:
        return mlp_hidden(params['mlp'], conv(params['conv'], obs))
    return mlp_hidden(params, obs.reshape(batch_shape + (int(np.prod(obs_shape, dtype=int)),)))


def network_head(params, features):
    """init_network's last (linear) layer on network_features' output."""
    last = (params['mlp'] if isinstance(params, dict) and 'conv' in params else params)[-1]
    return features @ last['w'] + last['b']


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
# Config flags: a frozen dataclass -> argparse, one help line per field.
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


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line on stderr, status 2."""

    def error(self, message):
        self.exit(2, f'{self.prog}: error: {message}\n')


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


def _parse_scalar(kind, text, flag):
    try:
        if kind is int:
            value = float(text)
            if value != int(value):
                raise ValueError
            return int(value)
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f'{flag}: expected {kind.__name__}, got {text!r}') from None


def _flag_parser(kind, is_tuple, optional, sweep, flag):
    def parse(text):
        if optional and text.lower() in ('none', ''):
            return None
        parts = [part.strip() for part in text.split(',') if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f'{flag}: empty value')
        values = [_parse_scalar(kind, part, flag) for part in parts]
        if is_tuple:
            return tuple(values)
        if len(values) > 1 and not sweep:
            raise argparse.ArgumentTypeError(
                f'{flag} takes one value (it changes shapes or the program), got {text!r}')
        return values if sweep else values[0]
    return parse


DEFAULT_COMPILE_CACHE = os.environ.get(
    'JAX_COMPILATION_CACHE_DIR', os.path.join(os.path.expanduser('~'), '.cache', 'trax-rl-jax'))


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


def enable_compile_cache(path):
    """Persist compiled programs on disk (JAX's own cache) unless path is 'none'."""
    if path and path.lower() != 'none':
        jax.config.update('jax_compilation_cache_dir', path)
        jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.2)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default, unless its help already says what it is;
    the epilog (the env settings table) keeps its lines."""

    def _fill_text(self, text, width, indent):
        if text.startswith(_SETTINGS_HEADING):
            return ''.join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        if '(default' in (action.help or ''):
            return action.help
        return super()._get_help_string(action)


def build_parser(config_cls, prog, description, env_settings=None):
    """A parser with one flag per config field plus the run flags; --help ends
    with the table of per-env settings."""
    parser = ArgumentParser(prog=prog, description=description, formatter_class=_HelpFormatter,
                            epilog=None if env_settings is None else env_settings_help(env_settings))
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        flag = '--' + field.name.replace('_', '-')
        # A name that is a Python keyword plus '_' (Trax's `lambda_`) is typed
        # without the underscore: --lambda (the literal --lambda- works too).
        flags = [flag.rstrip('-'), flag] if field.name.endswith('_') else [flag]
        flags += list(field.metadata.get('aliases', ()))
        kind, is_tuple, optional = _base_type(hints[field.name])
        help_text = field.metadata.get('help', '')
        constraint = constraint_text(field, kind)
        if constraint:
            help_text += f' {{{constraint}}}'
        sweep = field.metadata.get('sweep', False)
        if sweep:
            help_text += ' [comma list = sweep]'
        if kind is bool:
            parser.add_argument(*flags, dest=field.name, default=field.default,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(*flags, dest=field.name, default=field.default,
                                type=_flag_parser(kind, is_tuple, optional, sweep, flags[0]),
                                metavar=kind.__name__.upper(), help=help_text)
    run = parser.add_argument_group('run')
    run.add_argument('--seed', type=_flag_parser(int, False, False, False, '--seed'),
                     default=0, help='first seed; runs use seed, seed+1, ...')
    run.add_argument('--num-seeds', type=_flag_parser(int, False, False, False, '--num-seeds'),
                     default=1, help='independent seeds, vmapped in one program')
    run.add_argument('--output-dir', default=None,
                     help='where config, metrics, checkpoint and summary go; an existing '
                          'run there is resumed (default: a new folder under runs/)')
    run.add_argument('--only-eval', action='store_true',
                     help='restore the checkpoint in --output-dir and only evaluate')
    run.add_argument('--plot', action='store_true',
                     help='write learning_curve.png to the output dir')
    run.add_argument('--device', default=None,
                     type=_flag_parser(int, False, True, False, '--device'),
                     help='run on this one device index (default: shard runs over all)')
    run.add_argument('--time-limit', default=None, metavar='SECONDS',
                     type=_flag_parser(float, False, True, False, '--time-limit'),
                     help='stop after the last epoch that ends within SECONDS of the start '
                          '(compile included; judged by the mean epoch so far), with the '
                          'checkpoint and summary of a finished run; the same command with '
                          '--output-dir goes on from there (default: none)')
    run.add_argument('--quiet', action='store_true',
                     help='no per-epoch lines on stdout (each shows epoch k/N, env steps, the '
                          'mean return of the episodes finished most recently, which may be '
                          "an earlier epoch's where none finished in this one: metrics.jsonl "
                          "keeps Trax's per-epoch rl/avg_return; then the evaluation returns, "
                          'losses, the epoch time and an estimate of the time left)')
    run.add_argument('--tensorboard', default=True, action=argparse.BooleanOptionalAction,
                     help='TensorBoard event files under <output-dir>/tb/<run>, one dir per '
                          'seed and grid point: every metric of metrics.jsonl at step = '
                          'epoch, and the config as text')
    run.add_argument('--batch-invariant', default=True, action=argparse.BooleanOptionalAction,
                     help='CPU: bitwise the same numbers for a run alone, in a grid or sharded '
                          '(XLA without its algebraic simplifier and YNNPACK fusions other '
                          'than matmuls)')
    run.add_argument('--compile-cache', default=DEFAULT_COMPILE_CACHE,
                     help="XLA's persistent compilation cache dir ('none': off); a rerun "
                          'of the same program skips most of its compile time')
    processes = parser.add_argument_group(
        'processes', 'one sweep over several processes or hosts (jax.distributed): start '
        'every process with the same flags but --process-id; the runs are sharded over all '
        "their devices, process 0 writes every file and line; --output-dir must be on a "
        'filesystem they all see to resume')
    processes.add_argument('--distributed', default=None, choices=('auto',),
                           help="auto: jax.distributed.initialize() with the cluster's "
                                'settings (SLURM, Open MPI); the flags below override them '
                                '(default: one process, unless the flags below are given)')
    processes.add_argument('--coordinator-address', default=None, metavar='HOST:PORT',
                           help="process 0's address and a free port, the same for every "
                                'process (default: none)')
    processes.add_argument('--num-processes', default=None, metavar='N',
                           type=_flag_parser(int, False, True, False, '--num-processes'),
                           help='how many processes take part (default: none)')
    processes.add_argument('--process-id', default=None, metavar='I',
                           type=_flag_parser(int, False, True, False, '--process-id'),
                           help='this process, in [0, N) (default: none)')
    processes.add_argument('--coordinator-timeout', default=60.0, metavar='SECONDS',
                           type=_flag_parser(float, False, False, False, '--coordinator-timeout'),
                           help='stop with an error if the processes are not all connected '
                                'within this time')
    return parser


def given_flags(parser, argv):
    """The dests set on the command line itself, as opposed to by default.

    Lets a layer of settings sit between the defaults and the command line
    (a saved run's config on resume, an env's settings): a flag typed by the
    user always wins, a flag left out takes the layer's value.
    """
    bare = copy.deepcopy(parser)
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    return set(vars(bare.parse_args(argv)))


# ---------------------------------------------------------------------------
# Per-env settings: each algorithm file has a plain table {env name: {field:
# value}} of the fields that differ from its generic defaults (the CartPole
# ones). Layering: defaults < env settings < flags typed on the command line.
# ---------------------------------------------------------------------------

_SETTINGS_HEADING = 'per-env settings'


def settings_flags(settings):
    """{field: value} as the command-line flags that give those values."""
    flags = []
    for name, value in settings.items():
        flag = '--' + name.replace('_', '-').rstrip('-')
        if isinstance(value, bool):
            flags.append(flag if value else '--no-' + flag[2:])
        elif value is None:
            flags.append(f'{flag} none')
        elif isinstance(value, (tuple, list)):
            flags.append(f'{flag} {",".join(str(v) for v in value)}')
        else:
            flags.append(f'{flag} {value}')
    return ' '.join(flags)


def env_settings_help(table):
    """--help's epilog: one line per env, as the flags it amounts to."""
    lines = [f'{_SETTINGS_HEADING} (used when --env is one of these; a flag given on the '
             'command line wins):']
    for env, settings in table.items():
        lines.append(f'  {env}: {settings_flags(settings)}')
    return '\n'.join(lines if table else lines + ['  (none)'])


def apply_env_settings(config_cls, args, table, mode_field=None):
    """Set on `args` the settings of args.env that no command-line flag gave;
    -> {field: value} of those applied. Refuses a table naming no such field.

    `mode_field` (pg.py's policy_loss): an entry that sets it was tuned for
    that algorithm; when the command line asks for another, none of the entry
    applies (its other fields belong to that algorithm) -> None."""
    names = {field.name for field in dataclasses.fields(config_cls)}
    entry = (table or {}).get(args.env, {})
    if (mode_field in entry and mode_field in getattr(args, 'given', set())
            and getattr(args, mode_field) != entry[mode_field]):
        return None
    applied = {}
    for name, value in entry.items():
        if name not in names:
            raise ValueError(f'env settings for {args.env}: no config field {name!r}')
        if name not in getattr(args, 'given', set()):
            setattr(args, name, value)
            applied[name] = value
    return applied


RUN_FIELDS = ('seed', 'num_seeds')  # run flags a saved run's config records


def saved_run_config(output_dir):
    """The config a run in output_dir was saved with (its checkpoint's, or the
    previous checkpoint's when a save was cut between its renames); None when
    there is no readable one (a broken checkpoint is reported when resuming)."""
    if not output_dir:
        return None
    for name in ('checkpoint.npz', 'checkpoint.prev.npz'):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            try:
                return read_checkpoint_metadata(path)['config']
            except (ValueError, KeyError, TypeError):
                continue  # gone (a save's rename) or broken: try the previous one
    return None


def take_saved_config(config_cls, args, saved):
    """Resume: every config field and run flag not given on the command line
    (args.given) takes the saved run's value, its grid included.

    A saved config of another algorithm or version (other fields) is left
    alone: resuming refuses it, naming the fields that differ.
    """
    fields = {field.name: field for field in dataclasses.fields(config_cls)}
    if set(saved) - {'algorithm', 'grid', *RUN_FIELDS} != set(fields):
        return
    hints = typing.get_type_hints(config_cls)
    grid = saved.get('grid') or {}
    for name in [*fields, *RUN_FIELDS]:
        if name in args.given or name not in saved:
            continue
        value = grid.get(name, saved[name])
        if name in fields and value is not None and _base_type(hints[name])[1]:
            value = tuple(value)  # JSON keeps tuples as lists
        setattr(args, name, list(value) if name in grid else value)
    horizon = saved.get('lr_decay_epochs')
    if ('lr_decay_epochs' not in args.given and not args.only_eval and horizon is not None
            and 'linear_decay' in str(args.lr_schedule) and args.epochs > horizon):
        raise UsageError(pinned_schedule_message(args.output_dir, horizon))


def pinned_schedule_message(output_dir, horizon):
    return (f'{output_dir} holds a run whose learning rate decays to 0 over {horizon} '
            f'epochs; to extend it add --lr-decay-epochs {horizon} (its schedule, lr 0 from '
            'then on) or start a new run with a larger --lr-decay-epochs or --lr-schedule '
            'constant')


def config_and_grid(config_cls, args):
    """(config with each sweep field at its first value, {field: [values]})."""
    values, grid = {}, {}
    for field in dataclasses.fields(config_cls):
        value = getattr(args, field.name)
        if field.metadata.get('sweep') and isinstance(value, list):
            if len(value) > 1:
                grid[field.name] = value
            value = value[0]
        values[field.name] = value
    if 'lr_decay_epochs' in values and values['lr_decay_epochs'] is None:
        # Pin the schedule's horizon, so a resume with more --epochs keeps it.
        values['lr_decay_epochs'] = values['epochs']
    return config_cls(**values), grid


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


# ---------------------------------------------------------------------------
# Checkpoints: one .npz holding every leaf of the state pytree and a JSON
# metadata blob, written to a temp file and renamed, so a crash at any moment
# leaves either the old or the new checkpoint, never a broken one.
# ---------------------------------------------------------------------------


def _leaf_paths(tree):
    return [jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def atomic_write_bytes(path, data, previous=None):
    """Write `data` to `path` via a temp file and a rename; optionally move the
    old file to `previous` first (in the instant between the two renames only
    `previous` exists, and the loader falls back to it)."""
    tmp = f'{path}.tmp-{os.getpid()}'
    with open(tmp, 'wb') as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if previous and os.path.exists(path):
        os.replace(path, previous)
    os.replace(tmp, path)
    try:
        directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(directory)
        os.close(directory)
    except OSError:
        pass


def save_checkpoint(path, state, metadata, previous=None):
    """Atomically write `state` (any pytree of arrays) and JSON `metadata`;
    with `previous`, the checkpoint being replaced is kept under that name."""
    leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(state))]
    header = {'paths': _leaf_paths(state), 'metadata': metadata}
    arrays = {f'leaf_{i:05d}': leaf for i, leaf in enumerate(leaves)}
    arrays['header'] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue(), previous)


def read_checkpoint_metadata(path):
    """The JSON metadata of a checkpoint; ValueError naming the file if unreadable."""
    return _read_checkpoint(path)[0]['metadata']


def _read_checkpoint(path):
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(bytes(data['header']).decode())
            leaves = [data[f'leaf_{i:05d}'] for i in range(len(header['paths']))]
    except FileNotFoundError:
        raise ValueError(f'checkpoint {path} does not exist') from None
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, UnicodeDecodeError,
            NotImplementedError, RuntimeError) as error:  # zipfile raises all of these
        raise ValueError(f'checkpoint {path} is corrupt or truncated '
                         f'({type(error).__name__}: {error})') from None
    return header, leaves


def load_checkpoint(path, template):
    """(state shaped like `template`, metadata); ValueError naming the file if the
    file is corrupt or its structure, shapes or dtypes differ from the template."""
    header, leaves = _read_checkpoint(path)
    expected_paths = _leaf_paths(template)
    template_leaves, treedef = jax.tree.flatten(template)
    if header['paths'] != expected_paths:
        missing = sorted(set(expected_paths) - set(header['paths']))[:3]
        extra = sorted(set(header['paths']) - set(expected_paths))[:3]
        raise ValueError(f'checkpoint {path} has a different state structure '
                         f'(missing {missing}, unexpected {extra})')
    for name, leaf, want in zip(expected_paths, leaves, template_leaves):
        if leaf.shape != tuple(want.shape) or leaf.dtype != want.dtype:
            raise ValueError(f'checkpoint {path}: {name} is {leaf.dtype}{list(leaf.shape)}, '
                             f'expected {want.dtype}{list(want.shape)}')
    return jax.tree.unflatten(treedef, leaves), header['metadata']


# ---------------------------------------------------------------------------
# Metrics: metrics.jsonl has one JSON object per (epoch, run); stdout one
# human line per epoch (mean and min over runs).
# ---------------------------------------------------------------------------


def _json_value(value):
    value = float(value)
    return value if math.isfinite(value) else None


def metric_records(epoch, metrics, runs):
    """Per-run JSON records for one epoch from {name: array [n_runs]}."""
    records = []
    for index, run in enumerate(runs):
        record = {'epoch': epoch, 'run': index, **run}
        record.update({name: _json_value(values[index]) for name, values in metrics.items()})
        records.append(record)
    return records


def read_history(path, last_epoch):
    """Records of epochs <= last_epoch from metrics.jsonl (a torn last line is dropped)."""
    history = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get('epoch', last_epoch + 1) <= last_epoch:
                    history.append(record)
    return history


def write_jsonl(path, records, mode='a'):
    with open(path, mode) as f:
        for record in records:
            f.write(json.dumps(record) + '\n')
        f.flush()
        os.fsync(f.fileno())


def run_names(runs, grid):
    """One TensorBoard run name per run: its grid values and seed, e.g.
    'lr=0.01,gamma=0.99,seed=3' (',run=i' added where two would coincide)."""
    names = [','.join([f'{name}={format(run[name], "g")}' for name in grid]
                      + [f'seed={run["seed"]}']) for run in runs]
    return [f'{name},run={index}' if names.count(name) > 1 else name
            for index, name in enumerate(names)]


def config_markdown(config):
    """The config as a markdown table, TensorBoard's text dashboard renders it."""
    rows = [f'| {name} | {json.dumps(value)} |' for name, value in config.items()]
    return '\n'.join(['| field | value |', '|---|---|', *rows])


class Summaries:
    """TensorBoard event files (tensorboardX, no TensorFlow), one directory per
    run under <output_dir>/tb/: each metric of metrics.jsonl under its Trax tag
    at step = epoch, and the run's config as a text summary (Trax wrote its
    operative gin config as text).

    Opening rewrites each run's events from `history` (metrics.jsonl cut at the
    checkpoint) into a new file and only then deletes the old ones, so after a
    resume TensorBoard shows one value per step. A no-op when not enabled.
    """

    def __init__(self, output_dir, runs, run_config, history, enabled=True):
        self.writers, self.runs = [], runs
        if not enabled:
            return
        from tensorboardX import SummaryWriter
        grid = run_config.get('grid') or {}
        for index, (run, name) in enumerate(zip(runs, run_names(runs, grid))):
            directory = os.path.join(output_dir, 'tb', name)
            old = glob.glob(os.path.join(directory, 'events.out.tfevents.*'))
            writer = SummaryWriter(directory, flush_secs=10,  # a name no other writer had
                                   filename_suffix=f'.{os.getpid()}.{time.time_ns()}')
            writer.add_text('config', config_markdown({**run_config, **run}), 0)
            self.writers.append(writer)
            self.write([r for r in history if r['run'] == index], flush=False)
            writer.flush()
            for path in old:
                os.remove(path)

    def write(self, records, flush=True):
        """Scalars of metric records (metric_records' dicts); None (non-finite) is left out."""
        if not self.writers:
            return
        for record in records:
            identity = {'epoch', 'run', *self.runs[record['run']]}
            writer = self.writers[record['run']]
            for tag, value in record.items():
                if tag not in identity and value is not None:
                    writer.add_scalar(tag, value, record['epoch'])
        if flush:
            for writer in self.writers:
                writer.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for writer in self.writers:
            writer.close()
        return False


def _mean_min(values):
    values = np.asarray(values, np.float64)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 'n/a'
    if values.size == 1:
        return f'{finite[0]:.1f}'
    return f'{finite.mean():.1f} (min {finite.min():.1f})'


def _duration(seconds):
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m'
    return f'{seconds // 60}m{seconds % 60:02d}s' if seconds >= 60 else f'{seconds}s'


def recent_returns(history, n_runs):
    """Per run, rl/avg_return of the last epoch in history in which some episode ended."""
    recent = np.full(n_runs, np.nan)
    for record in sorted(history, key=lambda r: r['epoch']):
        if record.get('rl/avg_return') is not None:
            recent[record['run']] = record['rl/avg_return']
    return recent


def epoch_line(epoch, epochs, metrics, recent_return, seconds, seconds_left):
    """One human line: epoch k/N, returns (mean, min over runs), losses, time.

    `recent_return` is per run the mean return of the episodes that finished
    most recently (in this epoch, or the last one where any did).
    """
    parts = [f'epoch {epoch:{len(str(epochs))}d}/{epochs}',
             f'steps {int(np.max(metrics["rl/n_interactions"]))}',
             f'return {_mean_min(recent_return)}']
    for name in metrics:
        if name.startswith('rl/avg_return_temperature'):
            short = name[len('rl/avg_return_'):].replace('temperature', 'T').replace('_steps', '@')
            parts.append(f'eval {short} {_mean_min(metrics[name])}')
    for name in ('metrics/value_loss', 'metrics/policy_loss', 'metrics/exploration_rate'):
        if name in metrics:
            parts.append(f'{name.split("/")[1]} {float(np.nanmean(metrics[name])):.4g}')
    parts.append(f'{seconds:.2f}s')
    parts.append(f'left {_duration(seconds_left)}')
    return ' | '.join(parts)


# ---------------------------------------------------------------------------
# Memory: refuse, before compiling, a run that cannot fit. The estimate is a
# floor: the state twice (a phase's input and output are both alive) plus the
# largest array any phase materialises. XLA's own out-of-memory error stays
# the backstop (run_experiment turns it into one line).
# ---------------------------------------------------------------------------

# Outputs XLA fuses into their consumers instead of materialising.
_FUSED_PRIMITIVES = {'broadcast_in_dim', 'convert_element_type', 'iota', 'reshape',
                     'squeeze', 'expand_dims', 'transpose', 'select_n'}


def _nbytes(aval):
    return math.prod(aval.shape) * aval.dtype.itemsize if hasattr(aval, 'shape') else 0


def _largest_array(jaxpr):
    """Bytes of the largest array an equation of `jaxpr` (or of any jaxpr nested
    in it: scan and while bodies, conds, inner jits) outputs."""
    largest = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _FUSED_PRIMITIVES:
            largest = max([largest] + [_nbytes(var.aval) for var in eqn.outvars])
        for param in eqn.params.values():
            for inner in (param if isinstance(param, (tuple, list)) else (param,)):
                inner = getattr(inner, 'jaxpr', inner)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, 'eqns'):
                    largest = max(largest, _largest_array(inner))
    return largest


def memory_needed(agent, hp, keys):
    """(bytes, what) of the floor estimate for all runs: `hp` and `keys` carry
    the runs axis; nothing is compiled or run, only traced."""
    state = jax.eval_shape(jax.vmap(agent.init), keys, hp)
    state_bytes = sum(_nbytes(leaf) for leaf in jax.tree.leaves(state))
    phase_bytes = {name: _largest_array(jax.make_jaxpr(jax.vmap(getattr(agent, name)))(
        hp, state).jaxpr) for name in ('collect', 'train', 'evaluate')}
    phase, largest = max(phase_bytes.items(), key=lambda item: item[1])
    return 2 * state_bytes + largest, f'state {state_bytes / 2**30:.2f} GiB x 2 + {phase} ' \
        f'{largest / 2**30:.2f} GiB'


def memory_available(device):
    """Bytes free on `device`: what it reports (accelerators), else host RAM."""
    stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
    if stats and 'bytes_limit' in stats:
        return stats['bytes_limit'] - stats.get('bytes_in_use', 0)
    try:
        with open('/proc/meminfo') as meminfo:
            fields = dict(line.split(':', 1) for line in meminfo)
        return int(fields['MemAvailable'].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def check_memory(agent, hp, keys, devices, hint):
    """UsageError if the runs cannot fit on `devices` (sharded evenly over them;
    devices of the CPU share the host's RAM). Over several processes, this
    process's share on its own devices."""
    needed, what = memory_needed(agent, hp, keys)
    local = [device for device in devices if device.process_index == jax.process_index()]
    if devices[0].platform == 'cpu':
        needed = needed * len(local) // len(devices)
        available = memory_available(local[0])
    else:
        needed //= len(devices)
        available = min(memory_available(device) for device in local)
    if needed > available:
        raise UsageError(
            f'{len(keys)} run(s) need at least {needed / 2**30:.1f} GiB ({what}) but '
            f'{available / 2**30:.1f} GiB is available; lower {hint}')


# ---------------------------------------------------------------------------
# Processes: one experiment over several processes (hosts) with
# jax.distributed. The runs axis is sharded over every process's devices in
# one global mesh, with the same shard_map program as on one host; each device
# computes its slice alone, so the processes only talk to agree on the flags
# and on errors, and to gather metrics and checkpoints to process 0, the one
# writer. Without the flags below none of this runs and nothing changes.
#
# Checkpoints are gathered and written by process 0 alone (not one shard file
# per process plus a manifest): the save stays one atomic rename, so a kill -9
# of any process at any moment leaves the last whole checkpoint, with no
# cross-host commit to get wrong; and the file is the same, bitwise, whatever
# the number of processes and devices, so a run resumes with another process
# count, or on one machine, and --only-eval works anywhere. The cost: the
# state is all-gathered to every process at each checkpoint (DQN's replay
# dominates: about 1.1 MB per CartPole seed), and resuming reads the
# checkpoint on every process, so --output-dir must be on a filesystem every
# process sees.
# ---------------------------------------------------------------------------

PROCESS_FLAGS = ('distributed', 'coordinator_address', 'num_processes', 'process_id')
_processes = types.SimpleNamespace(started=False, prog='')
_MESSAGE_BYTES = 512  # an error relayed between processes, utf-8, cut to this


def distributed_requested(args):
    return any(getattr(args, name, None) is not None for name in PROCESS_FLAGS)


def check_process_flags(args):
    """The process flags alone (before anything connects): UsageError if bad."""
    if not distributed_requested(args):
        return
    auto = args.distributed == 'auto'
    address, count, index = args.coordinator_address, args.num_processes, args.process_id
    if address is not None:
        host, _, port = address.rpartition(':')
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UsageError(f'--coordinator-address must be HOST:PORT (port 1-65535), '
                             f'got {address!r}')
    if not auto:
        given = [f'--{name.replace("_", "-")}' for name in PROCESS_FLAGS[1:]
                 if getattr(args, name) is not None]
        if address is None:
            raise UsageError(f'{given[0]} needs --coordinator-address HOST:PORT (or '
                             '--distributed auto on a cluster JAX detects)')
        if count is None or index is None:
            raise UsageError('--coordinator-address needs --num-processes N and '
                             '--process-id I (or --distributed auto on a cluster JAX detects)')
    if count is not None and count < 1:
        raise UsageError(f'--num-processes must be >= 1, got {count}')
    if index is not None and count is not None and not 0 <= index < count:
        raise UsageError(f'--process-id must be in [0, {count}) for --num-processes {count}, '
                         f'got {index}')
    if index is not None and index < 0:
        raise UsageError(f'--process-id must be >= 0, got {index}')
    if args.device is not None:
        raise UsageError('--device pins one device of one process; it cannot be combined '
                         'with the process flags (runs are sharded over every process)')


def start_processes(args, prog):
    """jax.distributed.initialize from the flags; must run before any JAX
    computation. Waits at most --coordinator-timeout seconds for all processes
    to connect, then stops with one line (JAX itself would abort the process
    with a C++ stack trace)."""
    if not distributed_requested(args) or _processes.started:
        return
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU collectives
    kwargs = {name: getattr(args, name) for name in PROCESS_FLAGS[1:]
              if getattr(args, name) is not None}
    timeout = args.coordinator_timeout
    address = args.coordinator_address or "the cluster's coordinator"
    if args.process_id == 0:
        why = (f'not all {args.num_processes} processes connected to the coordinator at '
               f'{address} within {timeout:g} s (--coordinator-timeout); is every process '
               'started, with the same --coordinator-address and --num-processes?')
    else:
        why = (f'no coordinator answered at {address} within {timeout:g} s '
               '(--coordinator-timeout); is process 0 running there, with the same '
               '--num-processes, and is the address reachable from here?')

    def give_up():
        print(f'{prog}: error: {why}', file=sys.stderr, flush=True)
        os._exit(2)  # skip JAX's exit handlers: they would wait for the others

    watchdog = threading.Timer(timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=int(timeout) + 60,
                                   heartbeat_timeout_seconds=max(30, int(timeout)))
    except (ValueError, TypeError, RuntimeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if args.distributed == 'auto' and 'should be defined' in first:
            first = ('no cluster detected (SLURM, Open MPI); give --coordinator-address, '
                     '--num-processes and --process-id')
        raise UsageError(f'jax.distributed.initialize: {first}') from None
    finally:
        watchdog.cancel()
    _processes.started, _processes.prog = True, prog
    # Gloo prints a line on stdout (fd 1) for each group it connects: send fd 1
    # to /dev/null and keep Python's stdout on the real one.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = io.TextIOWrapper(os.fdopen(real_stdout, 'wb'), line_buffering=True)


def is_writer():
    """Whether this process writes files and stdout: process 0, or the only one."""
    return not _processes.started or jax.process_index() == 0


def _allgather(values):
    """[n_processes, *shape] numpy: every process's host-local `values`."""
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(np.asarray(values)))


def from_process_0(value):
    """Process 0's int (uint32) `value`, on every process."""
    if not _processes.started:
        return value
    return int(_allgather(np.asarray([value], np.uint32))[0, 0])


def any_process(flag):
    """True on every process if `flag` is true on any."""
    if not _processes.started:
        return bool(flag)
    return bool(np.any(_allgather(np.asarray([bool(flag)], np.uint8))))


def gather(tree):
    """A pytree of [n_runs, ...] arrays, whole as numpy on every process (one
    writer needs all runs: metrics, checkpoints); bitwise, only data moves."""
    if not _processes.started:
        return jax.tree.map(np.asarray, jax.device_get(tree))
    from jax.experimental import multihost_utils
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def put_global(tree, sharding):
    """Host arrays [n_runs, ...] (the same on every process) onto `sharding`;
    each process builds only its addressable shards."""
    if not _processes.started:
        return jax.device_put(tree, sharding)
    def put(leaf):
        leaf = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])
    return jax.tree.map(put, tree)


def _digest(value):
    """Two uint32 words of the SHA-256 of a JSON value."""
    data = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()
    return np.frombuffer(data[:8], np.uint32)


def check_same_flags(args):
    """Refuse processes started with different flags: compare a hash of every
    flag (but --process-id and --compile-cache) across processes, then name
    the flags that differ."""
    if not _processes.started:
        return
    sees = _allgather(np.asarray([getattr(args, 'sees_saved_run', False)], np.uint8))[:, 0]
    if sees.any() and not sees.all():
        blind = ', '.join(str(p) for p in range(len(sees)) if sees[p] != sees[0])
        raise UsageError(f'process(es) {blind} {"do not" if sees[0] else "alone"} find the saved '
                         f'run in --output-dir {args.output_dir} that process 0 '
                         f'{"resumes" if sees[0] else "does not"}; it must be on a filesystem '
                         'every process shares')
    flags = {name: value for name, value in sorted(vars(args).items())
             if name not in ('process_id', 'compile_cache', 'given', 'sees_saved_run')}
    overall = _allgather(np.concatenate([[len(flags)], _digest(flags)]).astype(np.uint32))
    if (overall == overall[0]).all():
        return
    if not (overall[:, 0] == overall[0, 0]).all():
        raise UsageError('the processes run different versions of the script (their sets of '
                         'flags differ); start every process with the same code and flags')
    each = _allgather(np.stack([_digest(value) for value in flags.values()]))
    differing = [f'--{name.replace("_", "-")}' for index, name in enumerate(flags)
                 if not (each[:, index] == each[0, index]).all()]
    others = [str(p) for p in range(len(each)) if not (each[p] == each[0]).all()]
    raise UsageError(f'the processes were started with different flags: {", ".join(differing)} '
                     f'differ between process 0 and process(es) {", ".join(others)}; start '
                     'every process with the same flags (but --process-id)')


class agreement:
    """A block that may fail on some processes only (their own files, free
    memory): at its end every process learns whether any failed, and all stop
    together. A process reports its own error; process 0 also reports the
    first other process's, so its stderr always says why. One process: a no-op."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if not _processes.started:
            return False
        status, message = 0, ''
        if isinstance(error, SystemExit):  # _fail: already reported
            status = error.code if isinstance(error.code, int) else 1
        elif isinstance(error, UsageError):
            status, message = 2, str(error)
        elif isinstance(error, ValueError):
            status, message = 1, str(error)
        elif error is not None:
            return False  # a bug: its traceback, and the others stop when this one dies
        text = np.zeros(_MESSAGE_BYTES, np.uint8)
        encoded = message.encode()[:_MESSAGE_BYTES]
        text[:len(encoded)] = np.frombuffer(encoded, np.uint8)
        table = _allgather(np.concatenate([[min(status, 255)], text]).astype(np.uint8))
        failed = [(process, int(row[0]), bytes(row[1:]).rstrip(b'\0').decode(errors='replace'))
                  for process, row in enumerate(table) if row[0]]
        if not failed:
            return False
        me = jax.process_index()
        if error is not None:
            # Process 0 had the same error: it says it, the others stay quiet.
            same = failed[0][0] == 0 and failed[0][2] == message and message
            error.local = me == 0 or not same
            return False
        process, status, message = failed[0]
        if me == 0:
            print(f'{_processes.prog}: error: process {process}: {message or "stopped"}',
                  file=sys.stderr, flush=True)
        raise SystemExit(status)


def _lost_contact(error):
    text = str(error).lower()
    return not _out_of_memory(error) and any(word in text for word in (
        'gloo', 'connection', 'coordination', 'unavailable', 'peer', 'heartbeat', 'barrier'))


def lost_a_process(prog, error):
    """A collective failed mid-run (another process died): one line, and exit
    without JAX's exit handlers, which would wait for the dead process. (When
    process 0 dies, JAX's coordination client may also log, or abort this
    process first: it watches the coordinator from a thread of its own.)"""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    print(f'{prog}: error: process {jax.process_index()}: lost contact with another process '
          f'({first}); rerun every process with the same flags to resume from the last '
          'checkpoint', file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


# ---------------------------------------------------------------------------
# The epoch loop (Trax's Agent.run): Python only drives epochs; each phase is
# one compiled, vmapped pure function over all runs.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Agent:
    """An algorithm as pure per-run functions (hp = that run's hyperparameters).

    init(key, hp) -> state; collect/train/evaluate(hp, state) -> (state, metrics).
    `state.params` must hold the network parameters and `state.train_step` the
    gradient-step counter.
    """
    name: str
    init: typing.Callable
    collect: typing.Callable
    train: typing.Callable
    evaluate: typing.Callable
    eval_tags: list  # [(temperature, steps)] evaluated each epoch
    max_steps: int  # the episode cap actually used
    memory_flags: str = '--num-seeds'  # what to lower when the runs do not fit

    def epoch(self, hp, state):
        """One whole epoch, collect -> train -> evaluate, as one pure function:
        (state, metrics), jittable, vmappable and scannable over epochs."""
        state, collect_metrics = self.collect(hp, state)
        state, train_metrics = self.train(hp, state)
        state, eval_metrics = self.evaluate(hp, state)
        return state, {**collect_metrics, **train_metrics, **eval_metrics}


# Fields that may change between a run and its resumption.
HARMLESS_FIELDS = {'epochs', 'checkpoint_every'}


def _fail(prog, message, status=2, local=False):
    """One line on stderr, then exit. Over several processes an error every
    process meets alike is said by process 0 alone; a `local` one by its own."""
    if local or is_writer():
        print(f'{prog}: error: {message}', file=sys.stderr)
    sys.exit(status)


def _prepare_output_dir(path, prog):
    if os.path.exists(path) and not os.path.isdir(path):
        _fail(prog, f'--output-dir {path} exists and is not a directory')
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        _fail(prog, f'cannot create --output-dir {path}: {error.strerror}')
    if not os.access(path, os.W_OK | os.X_OK):
        _fail(prog, f'--output-dir {path} is not writable')


LOCK_FILE = 'run.lock'


@contextlib.contextmanager
def output_dir_lock(path):
    """Hold an OS lock on path/run.lock (which names our pid) while the block
    runs. The kernel drops it when the process ends however it ends, kill -9
    included, so a lock is never stale; a second process is refused at once."""
    fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f'another run (pid {_lock_holder(fd)}) is writing {path}') from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f'{os.getpid()}\n'.encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _writer_lock(path):
    """output_dir_lock, held by process 0 alone (the one writer); a refusal
    stops every process."""
    with contextlib.ExitStack() as stack:
        with agreement():
            if is_writer():
                stack.enter_context(output_dir_lock(path))
        yield


def _lock_holder(fd):
    """The pid the lock holder wrote (it writes it right after locking)."""
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode(errors='replace').strip()
        if text:
            return text
        time.sleep(0.05)
    return 'unknown'


def _run_sharding(n_runs, device):
    """Sharding of the leading runs axis: one chosen device, or all of them."""
    devices = jax.devices()
    if device is not None:
        if not 0 <= device < len(devices):
            raise UsageError(f'--device {device} out of range; {len(devices)} device(s) seen')
        return jax.sharding.SingleDeviceSharding(devices[device])
    if jax.process_count() > 1 and n_runs % len(devices) != 0:
        raise UsageError(f'{n_runs} run(s) do not divide evenly over the {len(devices)} devices '
                         f'of {jax.process_count()} processes; use a multiple of {len(devices)} '
                         'runs (--num-seeds times the grid points)')
    if len(devices) == 1 or n_runs % len(devices) != 0:
        return jax.sharding.SingleDeviceSharding(devices[0])
    mesh = jax.sharding.Mesh(np.array(devices), ('runs',))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('runs'))


class _Interrupt:
    """First Ctrl-C: finish the epoch, checkpoint, stop. Second: stop now."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print('interrupt: finishing this epoch, then saving (Ctrl-C again to abandon it)',
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)
        return False


def _finite_floats(tree):
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
                                if jnp.issubdtype(leaf.dtype, jnp.floating)] or [True]))


def config_differences(saved, current):
    return sorted(name for name in set(saved) | set(current)
                  if name not in HARMLESS_FIELDS and saved.get(name) != current.get(name))


def main(config_cls, make_agent, check_hyperparameters, prog, description, argv=None,
         env_settings=None, settings_mode_field=None):
    """The command line of dqn.py / pg.py: parse flags, then fill in the flags
    not given: from the env's settings, and on resume from the saved config
    (defaults < env settings < saved config < flags given); check every run's
    hyperparameters, then run (or resume, or only evaluate) the experiment."""
    parser = build_parser(config_cls, prog, description, env_settings)
    args = parser.parse_args(argv)
    args.given = given_flags(parser, argv)
    applied = apply_env_settings(config_cls, args, env_settings, settings_mode_field)
    try:
        saved = saved_run_config(args.output_dir)
        args.sees_saved_run = saved is not None  # processes must agree (check_same_flags)
        if saved is not None:  # resume: what the command line leaves out is the saved run's
            take_saved_config(config_cls, args, saved)
        elif applied and not args.quiet:
            print(f'{prog}: settings for {args.env}: {settings_flags(applied)}'
                  + ' (a flag on the command line overrides each)', flush=True)
        elif applied is None and not args.quiet:
            mode = settings_flags({settings_mode_field: env_settings[args.env][settings_mode_field]})
            print(f'{prog}: the settings for {args.env} are for {mode}: not applied to '
                  f'{settings_flags({settings_mode_field: getattr(args, settings_mode_field)})}',
                  flush=True)
        config, grid = config_and_grid(config_cls, args)
        check_run_flags(args)
        check_fields(config, grid)
        check_hyperparameters(config, expand_runs(config, grid, args.seed, 1))
    except UsageError as error:
        parser.error(str(error))
    return run_experiment(make_agent, config, grid, args, prog)


def check_run_flags(args):
    """--num-seeds >= 1, every run's seed a valid int32 PRNG seed, the process flags."""
    if not 1 <= args.num_seeds <= INT32_MAX:
        raise UsageError(f'--num-seeds must be >= 1, got {args.num_seeds}')
    if not 0 <= args.seed <= INT32_MAX - args.num_seeds + 1:
        raise UsageError(f'--seed must be in [0, {INT32_MAX} - num_seeds + 1], got {args.seed}')
    time_limit = getattr(args, 'time_limit', None)
    if time_limit is not None and not 0 < time_limit < float('inf'):
        raise UsageError(f'--time-limit must be a number of seconds > 0, got {time_limit:g}')
    timeout = getattr(args, 'coordinator_timeout', 60.0)
    if not 1 <= timeout <= 86400:
        raise UsageError(f'--coordinator-timeout must be in [1, 86400] seconds, got {timeout:g}')
    check_process_flags(args)


def run_experiment(make_agent, config, grid, args, prog):
    """Parse-independent driver: set up, resume, loop epochs, save results."""
    try:
        return _run_experiment(make_agent, config, grid, args, prog)
    except UsageError as error:
        _fail(prog, str(error), local=getattr(error, 'local', False))
    except ValueError as error:  # corrupt / mismatched checkpoint, remaining_evals
        _fail(prog, str(error), status=1, local=getattr(error, 'local', False))
    except (jax.errors.JaxRuntimeError, MemoryError) as error:
        if _processes.started and _lost_contact(error):
            lost_a_process(prog, error)
        if not _out_of_memory(error):
            raise
        # check_memory's estimate is a floor; this is XLA finding it short.
        first_line = (str(error).strip().splitlines() or ['MemoryError'])[0][:300]
        _fail(prog, f'out of memory: {first_line}; any checkpoint in --output-dir is kept '
                    '(lower --num-seeds, the grid or the buffer sizes)', status=1)


def _out_of_memory(error):
    text = str(error)
    return isinstance(error, MemoryError) or 'RESOURCE_EXHAUSTED' in text \
        or 'out of memory' in text.lower()


def _run_experiment(make_agent, config, grid, args, prog):
    run = _set_up(make_agent, config, grid, args, prog)
    with _writer_lock(run.output_dir):  # one writer per run dir, from here on
        return _locked_experiment(run, args, prog)


def _locked_experiment(run, args, prog):
    _find_saved_run(run)
    state, phases, finite = _compile_phases(run, args)
    if run.resuming:
        state = _restore(run, state)
    elif not args.only_eval and is_writer():
        atomic_write_bytes(os.path.join(run.output_dir, 'config.json'),
                           json.dumps(run.run_config, indent=2).encode())
    if args.only_eval:
        return _only_eval(run, phases, state, args)
    last = _epoch_loop(run, phases, finite, state, args, prog)
    _finish(run, args)
    return last


@dataclasses.dataclass
class _Run:
    """What the driver's pieces share about one experiment (all its runs)."""
    agent: Agent
    config: typing.Any
    runs: list  # one dict per run: seed and grid values
    hp: typing.Any  # the runs' hyperparameters, [n_runs, ...] on `sharding`
    keys: typing.Any  # one PRNG key per run
    sharding: typing.Any
    output_dir: str
    run_config: dict  # what config.json and the checkpoint record
    resuming: bool
    wall_start: float
    compile_s: float = 0.0
    start_epoch: int = 0
    history: list = dataclasses.field(default_factory=list)  # metric records so far

    @property
    def checkpoint_path(self):
        return os.path.join(self.output_dir, 'checkpoint.npz')

    @property
    def previous_path(self):
        return os.path.join(self.output_dir, 'checkpoint.prev.npz')

    @property
    def metrics_path(self):
        return os.path.join(self.output_dir, 'metrics.jsonl')


def _set_up(make_agent, config, grid, args, prog):
    """Check the flags and the output dir before compiling; write nothing."""
    wall_start = time.time()
    enable_compile_cache(getattr(args, 'compile_cache', None))
    check_run_flags(args)
    if getattr(args, 'tensorboard', True) and importlib.util.find_spec('tensorboardX') is None:
        raise UsageError('TensorBoard summaries need the tensorboardX package '
                         '(pip install -r requirements.txt); or pass --no-tensorboard')
    start_processes(args, prog)  # with the process flags: connect, before any JAX work
    check_same_flags(args)
    runs = expand_runs(config, grid, args.seed, args.num_seeds)
    agent = make_agent(config)  # validates the config and the env
    hp = hyperparameters(config, runs)
    sharding = _run_sharding(len(runs), args.device)

    output_dir = args.output_dir
    if output_dir is None:
        if args.only_eval:
            raise UsageError('--only-eval needs --output-dir of a saved run')
        now = datetime.datetime.fromtimestamp(from_process_0(int(time.time())))
        output_dir = os.path.join(
            'runs', f'{agent.name}_{config.env}_s{args.seed}_{now.strftime("%Y%m%d-%H%M%S")}')
    checkpoint_path = os.path.join(output_dir, 'checkpoint.npz')
    with agreement():  # this host's memory and (process 0) files
        check_memory(agent, hp, jax.ShapeDtypeStruct((len(runs), 2), jnp.uint32),
                     sorted(sharding.device_set, key=lambda device: device.id),
                     agent.memory_flags)
        if is_writer():
            if args.only_eval and not any(os.path.isfile(os.path.join(output_dir, name))
                                          for name in ('checkpoint.npz', 'checkpoint.prev.npz')):
                # (checkpoint.npz alone is briefly absent while a running writer saves)
                raise UsageError(f'--only-eval: no checkpoint at {checkpoint_path}')
            _prepare_output_dir(output_dir, prog)

    run_config = {'algorithm': agent.name, **dataclasses.asdict(config), 'grid': grid,
                  'seed': args.seed, 'num_seeds': args.num_seeds}
    run_config = json.loads(json.dumps(run_config))  # tuples -> lists, as saved
    # Each run's key is PRNGKey(its seed), built in one call (not one per run).
    keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray([run['seed'] for run in runs], jnp.int32))
    return _Run(agent=agent, config=config, runs=runs, hp=put_global(hp, sharding),
                keys=put_global(keys, sharding), sharding=sharding, output_dir=output_dir,
                run_config=run_config, resuming=False, wall_start=wall_start)


def _find_saved_run(run):
    """Is there a run to resume (process 0 decides)? Refuse a broken checkpoint
    or another config before compiling."""
    if is_writer() and not os.path.exists(run.checkpoint_path) \
            and os.path.exists(run.previous_path):
        # A crash between the two renames of a save: the previous one is whole.
        os.replace(run.previous_path, run.checkpoint_path)
    run.resuming = bool(from_process_0(os.path.exists(run.checkpoint_path)))
    with agreement():  # every process reads the checkpoint to resume
        if run.resuming and not os.path.exists(run.checkpoint_path):
            raise UsageError(f'process 0 resumes from {run.checkpoint_path}, which this '
                             'process cannot see; --output-dir must be on a filesystem every '
                             'process shares')
        if run.resuming:
            _check_saved_config(run)


def _check_saved_config(run):
    """The saved run's config must be this one, up to HARMLESS_FIELDS."""
    try:
        saved = read_checkpoint_metadata(run.checkpoint_path)
    except ValueError as error:
        hint = (f'; the previous checkpoint {run.previous_path} is intact: move it to '
                f'{run.checkpoint_path} to resume from it' if os.path.exists(run.previous_path)
                else '')
        raise ValueError(f'{error}{hint}') from None
    differing = config_differences(saved['config'], run.run_config)
    if differing == ['lr_decay_epochs']:  # --epochs grew; the schedule is pinned
        raise UsageError(pinned_schedule_message(run.output_dir,
                                                 saved['config']['lr_decay_epochs']))
    if differing:
        raise UsageError(
            f'{run.output_dir} holds a run with a different config; differing: '
            + ', '.join(f'{name} (saved {saved["config"].get(name)!r}, now '
                        f'{run.run_config.get(name)!r})' for name in differing)
            + '; use another --output-dir')


def _compile_phases(run, args):
    """Compile init, the three phases and the finiteness check; run init.
    Returns (initial state, {phase name: compiled}, compiled finite check)."""
    compile_start = time.time()
    sharding = run.sharding
    options = compiler_options(getattr(args, 'batch_invariant', True))
    def compiled(function, *example):  # every leaf of every input/output is [n_runs, ...]
        vectorized = jax.vmap(function)
        if isinstance(sharding, jax.sharding.NamedSharding):
            # Each device runs the same vmapped program on its slice of runs, so
            # results are bitwise those of one device (GSPMD's rewrite is not).
            spec = sharding.spec
            vectorized = jax.shard_map(vectorized, mesh=sharding.mesh,
                                       in_specs=(spec,) * len(example), out_specs=spec,
                                       check_vma=False)
        return jax.jit(vectorized, in_shardings=sharding, out_shardings=sharding).lower(
            *example).compile(compiler_options=options)
    state = compiled(run.agent.init, run.keys, run.hp)(run.keys, run.hp)
    phases = {name: compiled(getattr(run.agent, name), run.hp, state)
              for name in ('collect', 'train', 'evaluate')}
    # Per run, [n_runs] (no reduction across devices or processes).
    finite = compiled(lambda hp, state: _finite_floats(state.params), run.hp, state)
    run.compile_s = time.time() - compile_start
    return state, phases, finite


def _restore(run, state):
    """Load the checkpoint into `state`'s structure; set start_epoch and history."""
    config = run.config
    with agreement():
        restored, saved = load_checkpoint(run.checkpoint_path, state)
    state = put_global(restored, run.sharding)
    run.start_epoch = saved['epoch']
    run.history = read_history(run.metrics_path, run.start_epoch) if is_writer() else []
    # Trax's check that the trainer is at an epoch boundary.
    for step in np.unique(np.asarray(restored.train_step)):
        try:
            left = remaining_evals(int(step), run.start_epoch + 1, config.train_steps_per_epoch,
                                   config.evals_per_epoch)
        except ValueError as error:
            left = error
        if left != config.evals_per_epoch:
            raise ValueError(f'checkpoint {run.checkpoint_path}: trainer step {int(step)} is not '
                             f'at the end of epoch {run.start_epoch} ({left} evals left)')
    return state


def _only_eval(run, phases, state, args):
    """--only-eval: one evaluation of the saved parameters, into eval.jsonl."""
    _, metrics = phases['evaluate'](run.hp, state)
    metrics = gather(metrics)
    if not is_writer():
        return metrics
    records = metric_records(run.start_epoch, metrics, run.runs)
    write_jsonl(os.path.join(run.output_dir, 'eval.jsonl'), records)
    if not args.quiet:
        for name, values in metrics.items():
            print(f'epoch {run.start_epoch} {name}: {_mean_min(values)}')
    return metrics


def _run_epoch(run, phases, state):
    """Collect, train, evaluate: (state, metrics as numpy [n_runs], with timings)."""
    n_runs = len(run.runs)
    epoch_start = time.time()
    state, collect_metrics = phases['collect'](run.hp, state)
    jax.block_until_ready(state)
    collect_s = time.time() - epoch_start
    state, train_metrics = phases['train'](run.hp, state)
    jax.block_until_ready(state)
    train_s = time.time() - epoch_start - collect_s
    state, eval_metrics = phases['evaluate'](run.hp, state)
    metrics = gather({**collect_metrics, **train_metrics, **eval_metrics})
    new_steps = metrics.pop('rl/new_interactions')
    metrics['rl/n_interactions_per_second'] = new_steps / max(collect_s, 1e-9)
    metrics['timing/collect'] = np.full(n_runs, collect_s)
    metrics['timing/train'] = np.full(n_runs, train_s)
    metrics['timing/epoch'] = np.full(n_runs, time.time() - epoch_start)
    metrics['timing/since_start'] = np.full(n_runs, time.time() - run.wall_start)
    return state, metrics


def _epoch_loop(run, phases, finite, state, args, prog):
    """Epochs start_epoch+1 .. config.epochs: metrics, checkpoints, the NaN guard
    and Ctrl-C. Returns the last epoch's metrics."""
    config = run.config
    # The checkpoint decides: drop lines of epochs after it (they are redone).
    if is_writer():
        atomic_write_bytes(run.metrics_path, b''.join(
            (json.dumps(record) + '\n').encode() for record in run.history))
    last = {}
    progress = _Progress(run)
    with _Interrupt() as interrupt, \
            Summaries(run.output_dir, run.runs, run.run_config, run.history,
                      enabled=getattr(args, 'tensorboard', True) and is_writer()) as summaries:
        for epoch in range(run.start_epoch + 1, config.epochs + 1):
            epoch_start = time.time()
            state, metrics = _run_epoch(run, phases, state)
            bad = [name for name, values in metrics.items()
                   if name.startswith('metrics/') and not np.all(np.isfinite(values))]
            if bad or not np.all(gather(finite(run.hp, state))):
                what = ', '.join(bad) if bad else 'network parameters'
                _fail(prog, f'non-finite {what} in epoch {epoch}; stopped, the checkpoint '
                            f'of epoch {epoch - 1} in {run.output_dir} is kept', status=1)
            records = metric_records(epoch, metrics, run.runs)
            run.history.extend(records)
            # Metrics first, then the checkpoint: a crash between the two leaves
            # lines of an epoch the resumed run recomputes identically.
            if is_writer():
                write_jsonl(run.metrics_path, records)
                summaries.write(records)
            interrupted = any_process(interrupt.requested)  # all processes stop together
            out_of_time = progress.out_of_time(epoch, getattr(args, 'time_limit', None))
            if epoch % config.checkpoint_every == 0 or epoch == config.epochs or interrupted \
                    or out_of_time:
                whole_state = gather(state)  # every process takes part
                if is_writer():
                    save_checkpoint(run.checkpoint_path, whole_state,
                                    {'config': run.run_config, 'epoch': epoch},
                                    previous=run.previous_path)
            last = metrics
            line = progress.line(epoch, metrics, time.time() - epoch_start)
            if not args.quiet and is_writer():
                print(line, flush=True)
            if interrupted:
                if is_writer():
                    print(f'interrupted after epoch {epoch}; rerun with --output-dir '
                          f'{run.output_dir} to resume', file=sys.stderr)
                sys.exit(130)
            if out_of_time and epoch < config.epochs:
                if not args.quiet and is_writer():
                    print(f'time limit: stopped after epoch {epoch} of {config.epochs}; rerun '
                          f'with --output-dir {run.output_dir} to go on', flush=True)
                break
    return last


class _Progress:
    """The per-epoch line's state: each run's most recent return, the time left."""

    def __init__(self, run):
        self.recent = recent_returns(run.history, len(run.runs))
        self.first, self.epochs, self.start = run.start_epoch, run.config.epochs, time.time()
        self.wall_start = run.wall_start

    def out_of_time(self, epoch, time_limit):
        """Would another epoch end past `time_limit` seconds from the start?
        (Process 0's clock decides for all processes.)"""
        if time_limit is None:
            return False
        now = time.time()
        per_epoch = (now - self.start) / (epoch - self.first)
        return bool(from_process_0(int(now - self.wall_start + per_epoch > time_limit)))

    def line(self, epoch, metrics, seconds):
        returns = metrics['rl/avg_return']
        self.recent = np.where(np.isfinite(returns), returns, self.recent)
        per_epoch = (time.time() - self.start) / (epoch - self.first)
        return epoch_line(epoch, self.epochs, metrics, self.recent, seconds,
                          per_epoch * (self.epochs - epoch))


def _finish(run, args):
    """summary.json, the optional plot and the final line (process 0's)."""
    if not is_writer():
        return
    summary = _summary(run.agent, run.config, run.runs, run.history, run.wall_start,
                       run.compile_s, getattr(args, 'batch_invariant', True))
    atomic_write_bytes(os.path.join(run.output_dir, 'summary.json'),
                       json.dumps(summary, indent=2).encode())
    if args.plot:
        plot_learning_curves(run.history, run.agent, run.config.env,
                             os.path.join(run.output_dir, 'learning_curve.png'))
    if not args.quiet:
        finals = summary['final_eval_return']
        print(f'done: {len(run.runs)} run(s), final greedy return {_mean_min(finals)}, '
              f'wall {summary["wall_s"]:.1f}s (compile {run.compile_s:.1f}s), '
              f'results in {run.output_dir}')


def eval_key(temperature, steps):
    """Trax's summary tag for an evaluation figure."""
    return f'rl/avg_return_temperature{temperature:.2f}_steps{steps}'


def _summary(agent, config, runs, history, wall_start, compile_s, batch_invariant):
    final_epoch = max((record['epoch'] for record in history), default=0)
    final = sorted((r for r in history if r['epoch'] == final_epoch), key=lambda r: r['run'])
    key = eval_key(0.0, agent.max_steps)
    return {
        'algorithm': agent.name,
        'env': config.env,
        'seeds': [run['seed'] for run in runs],
        'runs': runs,
        'epochs': final_epoch,
        'env_steps_per_seed': [r.get('rl/n_interactions') for r in final],
        'final_eval_return': [r.get(key) for r in final],
        'final_eval_key': key,
        'wall_s': time.time() - wall_start,
        'compile_s': compile_s,
        'batch_invariant': batch_invariant,
    }


def plot_learning_curves(history, agent, env_name, path):
    """Greedy and training return vs env steps: mean line, min-max band over runs."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    epochs = sorted({record['epoch'] for record in history})
    n_runs = max(record['run'] for record in history) + 1
    def table(name):
        values = np.full((len(epochs), n_runs), np.nan)
        for record in history:
            value = record.get(name)
            values[epochs.index(record['epoch']), record['run']] = np.nan if value is None else value
        return values
    steps = np.nanmean(table('rl/n_interactions'), axis=1)
    figure, axis = plt.subplots(figsize=(7, 4))
    names = [('rl/avg_return', 'training return')]
    names += [(eval_key(t, h), f'greedy return (T={t:g}, {h} steps)' if t == 0 else
               f'eval return (T={t:g}, {h} steps)')
              for t, h in agent.eval_tags]
    for name, label in names:
        values = table(name)
        if np.all(np.isnan(values)):
            continue
        with np.errstate(all='ignore'), __import__('warnings').catch_warnings():
            __import__('warnings').simplefilter('ignore')
            axis.plot(steps, np.nanmean(values, axis=1), label=label)
            axis.fill_between(steps, np.nanmin(values, axis=1), np.nanmax(values, axis=1),
                              alpha=0.2)
    axis.set_xlabel('env steps per run')
    axis.set_ylabel('return')
    axis.set_title(f'{env_name}: {n_runs} run(s), mean and min-max band')
    axis.legend(loc='lower right')
    figure.tight_layout()
    tmp = path + '.tmp.png'
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    os.replace(tmp, path)
