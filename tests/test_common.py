"""Contract tests for common.py (rlax style).

Every advantage estimator is checked against a plain-numpy loop reference
written here straight from the formulas of docs/trax.md section 4 (no code
from common.py is used in the references), against the values Trax 1.4.1
computed, and with and without jit, vmapped (chex.variants). Their chex
contracts: a wrong-shaped call fails naming the argument, and adds nothing
to the traced program. Then remaining_evals (docs/trax.md section 3),
checkpoints (docs/trax.md section 1), schedules,
make_env, the MLP and conv torso, and the config-flag plumbing.
"""

import dataclasses
import functools
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple, Optional, Tuple

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl.testing import parameterized  # noqa: E402

import common  # noqa: E402
from harness import cli  # noqa: E402
from harness import flags  # noqa: E402
from harness import rundir  # noqa: E402
from contracts import assert_contracts_trace_to_nothing  # noqa: E402

BATCH, LENGTH = 3, 7
RTOL, ATOL = 1e-5, 1e-5


# ---------------------------------------------------------------------------
# Plain-numpy loop references, from docs/trax.md section 4 (float64, element by element).
# ---------------------------------------------------------------------------


def ref_mask_discount(discount, discount_mask):
    discount_mask = np.asarray(discount_mask)
    out = np.empty(discount_mask.shape, np.float64)
    for index in np.ndindex(discount_mask.shape):
        out[index] = discount if discount_mask[index] else 1.0
    return out


def ref_discounted_returns(rewards, gammas):
    rewards = np.asarray(rewards, np.float64)
    gammas = np.broadcast_to(np.asarray(gammas, np.float64), rewards.shape)
    batch, length = rewards.shape
    out = np.zeros((batch, length))
    for b in range(batch):
        future = 0.0
        for t in reversed(range(length)):
            future = rewards[b, t] + gammas[b, t] * future
            out[b, t] = future
    return out


def _f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


def ref_monte_carlo(gamma, margin, rewards, returns, values, dones, discount_mask):
    del gamma, discount_mask
    rewards, returns, values = _f64(rewards, returns, values)
    batch, length = rewards.shape
    out = np.zeros((batch, length - margin))
    for b in range(batch):
        for t in range(length - margin):
            if dones[b, t]:
                out[b, t] = rewards[b, t] - 0.0
            else:
                out[b, t] = returns[b, t] - values[b, t]
    return out


def ref_td_k(gamma, margin, rewards, returns, values, dones, discount_mask):
    del returns
    rewards, values = _f64(rewards, values)
    k = margin
    gammas = ref_mask_discount(gamma, discount_mask)
    batch, length = rewards.shape
    n = length - k
    out = np.zeros((batch, n))
    for b in range(batch):
        for t in range(n):
            if dones[b, t]:
                adv = rewards[b, t]
            else:
                adv = 0.0
                for i in range(k):
                    discount = 1.0
                    for j in range(i):
                        discount *= gammas[b, t + j]
                    adv += discount * rewards[b, t + i]
                discount = 1.0
                for j in range(k):
                    discount *= gammas[b, t + j]
                adv += discount * values[b, t + k]
            out[b, t] = adv - values[b, t]
    return out


def ref_td_lambda(gamma, margin, lambda_, rewards, returns, values, dones, discount_mask):
    del returns
    rewards, values = _f64(rewards, values)
    gammas = ref_mask_discount(gamma, discount_mask)
    lambdas = ref_mask_discount(lambda_, discount_mask)
    batch, length = rewards.shape
    out = np.zeros((batch, length - margin))
    for b in range(batch):
        g = np.zeros(length)
        g[-1] = values[b, -1]
        for i in reversed(range(length - 1)):
            lam = lambdas[b, i]
            g[i] = rewards[b, i] + (1.0 - float(dones[b, i])) * gammas[b, i] * (
                (1.0 - lam) * values[b, i + 1] + lam * g[i + 1])
        for t in range(length - margin):
            out[b, t] = g[t] - values[b, t]
    return out


def ref_gae(gamma, margin, lambda_, rewards, returns, values, dones, discount_mask):
    del returns
    rewards, values = _f64(rewards, values)
    gammas = ref_mask_discount(gamma, discount_mask)
    lambdas = ref_mask_discount(lambda_, discount_mask)
    batch, length = rewards.shape
    out = np.zeros((batch, length - margin))
    for b in range(batch):
        a = np.zeros(length)
        a[-1] = 0.0
        for i in reversed(range(length - 1)):
            cont = 1.0 - float(dones[b, i])
            delta = rewards[b, i] - values[b, i] + cont * gammas[b, i] * values[b, i + 1]
            a[i] = delta + cont * gammas[b, i] * lambdas[b, i] * a[i + 1]
        for t in range(length - margin):
            out[b, t] = a[t]
    return out


def random_inputs(seed, batch=BATCH, length=LENGTH, lead=()):
    """rewards, returns, values (float32), dones, discount_mask (bool)."""
    rng = np.random.default_rng(seed)
    shape = lead + (batch, length)
    rewards = rng.normal(size=shape).astype(np.float32)
    returns = rng.normal(size=shape).astype(np.float32) * 3
    values = rng.normal(size=shape).astype(np.float32) * 2
    dones = rng.random(shape) < 0.3
    discount_mask = rng.random(shape) < 0.7
    # The cases must exercise both branches of every where().
    assert dones.any() and (~dones).any()
    assert discount_mask.any() and (~discount_mask).any()
    return rewards, returns, values, dones, discount_mask


GAMMAS = (0.0, 0.9, 1.0)
LAMBDAS = (0.0, 0.95, 1.0)
# Every gamma x lambda at margin 1, every margin at two (gamma, lambda) pairs, and
# the corners: 17 cases, each one eager scan compile (the file must stay fast).
LAMBDA_CASES = ([(g, lam, 1) for g in GAMMAS for lam in LAMBDAS]
                + [(g, 0.95, m) for g in (0.9, 1.0) for m in (0, 2, 3)]
                + [(0.0, 0.0, 0), (1.0, 1.0, 3)])


# ---------------------------------------------------------------------------
# 1. Estimators vs the loop references.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('discount', [0.0, 0.5, 0.99, 1.0])
def test_mask_discount_matches_reference(discount):
    mask = np.random.default_rng(1).random((BATCH, LENGTH)) < 0.5
    got = common.mask_discount(discount, mask)
    assert got.shape == (BATCH, LENGTH)
    np.testing.assert_allclose(np.asarray(got), ref_mask_discount(discount, mask),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('gamma', GAMMAS + (0.5,))
@pytest.mark.parametrize('per_step', [False, True], ids=['scalar_gamma', 'gamma_array'])
def test_discounted_returns_matches_reference(gamma, per_step):
    rewards, _, _, _, mask = random_inputs(11)
    gammas = ref_mask_discount(gamma, mask).astype(np.float32) if per_step else gamma
    got = common.discounted_returns(rewards, gammas)
    assert got.shape == (BATCH, LENGTH)
    np.testing.assert_allclose(np.asarray(got), ref_discounted_returns(rewards, gammas),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('margin', [0, 1, 2, 3])
@pytest.mark.parametrize('gamma', GAMMAS)
def test_monte_carlo_matches_reference(gamma, margin):
    inputs = random_inputs(100 + margin)
    got = common.monte_carlo(gamma, margin)(*inputs)
    assert got.shape == (BATCH, LENGTH - margin)
    np.testing.assert_allclose(np.asarray(got), ref_monte_carlo(gamma, margin, *inputs),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('margin', [1, 2, 3])
@pytest.mark.parametrize('gamma', GAMMAS + (0.5,))
def test_td_k_matches_reference(gamma, margin):
    inputs = random_inputs(200 + margin)
    got = common.td_k(gamma, margin)(*inputs)
    assert got.shape == (BATCH, LENGTH - margin)
    np.testing.assert_allclose(np.asarray(got), ref_td_k(gamma, margin, *inputs),
                               rtol=RTOL, atol=ATOL)


def test_td_k_rejects_margin_zero():
    with pytest.raises(ValueError):
        common.td_k(0.9, 0)


@pytest.mark.parametrize('gamma,lambda_,margin', LAMBDA_CASES)
def test_td_lambda_matches_reference(gamma, lambda_, margin):
    inputs = random_inputs(300 + margin)
    got = common.td_lambda(gamma, margin, lambda_)(*inputs)
    assert got.shape == (BATCH, LENGTH - margin)
    np.testing.assert_allclose(np.asarray(got),
                               ref_td_lambda(gamma, margin, lambda_, *inputs),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('gamma,lambda_,margin', LAMBDA_CASES)
def test_gae_matches_reference(gamma, lambda_, margin):
    inputs = random_inputs(400 + margin)
    got = common.gae(gamma, margin, lambda_)(*inputs)
    assert got.shape == (BATCH, LENGTH - margin)
    np.testing.assert_allclose(np.asarray(got), ref_gae(gamma, margin, lambda_, *inputs),
                               rtol=RTOL, atol=ATOL)


def test_default_lambda_is_095():
    inputs = random_inputs(7)
    np.testing.assert_allclose(np.asarray(common.gae(0.9, 1)(*inputs)),
                               ref_gae(0.9, 1, 0.95, *inputs), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(common.td_lambda(0.9, 1)(*inputs)),
                               ref_td_lambda(0.9, 1, 0.95, *inputs), rtol=RTOL, atol=ATOL)


def test_references_agree_with_each_other():
    """Sanity of the references: without dones and with lambda 1, TD(lambda)
    minus value equals GAE (both telescope to the same sum)."""
    rewards, returns, values, dones, mask = random_inputs(9)
    dones = np.zeros_like(dones)
    for lam in (0.0, 0.95, 1.0):
        np.testing.assert_allclose(
            ref_td_lambda(0.9, 0, lam, rewards, returns, values, dones, mask),
            ref_gae(0.9, 0, lam, rewards, returns, values, dones, mask), atol=1e-9)


# ---------------------------------------------------------------------------
# 2. Values computed by Trax 1.4.1 and the further checks of docs/trax.md section 4.
# ---------------------------------------------------------------------------

TRAX_TABLE = [
    # dones, gamma, margin, monte_carlo, td_k, td_lambda = gae (lambda .95)
    ([0, 0, 1], 1.0, 1, [1, 0], [1, 1], [1.95, 1]),
    ([0, 0, 1], 1.0, 2, [1], [2], [1.95]),
    ([0, 0, 1], 0.9, 1, [1, 0], [.8, .8], [1.484, .8]),
    ([0, 1, 0], 0.9, 1, [1, 1], [.8, -1], [-.055, -1]),
]


@pytest.mark.parametrize('dones_dtype', [bool, np.int32])
@pytest.mark.parametrize('row', TRAX_TABLE, ids=[f'row{i}' for i in range(len(TRAX_TABLE))])
def test_trax_1_4_1_values(row, dones_dtype):
    dones, gamma, margin, mc, tdk, tdl = row
    rewards = np.array([[1, 1, 1]], np.float32)
    returns = np.array([[3, 2, 1]], np.float32)
    values = np.array([[2, 2, 2]], np.float32)
    dones = np.array([dones], dones_dtype)
    mask = np.ones((1, 3), bool)
    args = (rewards, returns, values, dones, mask)
    for estimator, want in [(common.monte_carlo(gamma, margin), mc),
                            (common.td_k(gamma, margin), tdk),
                            (common.td_lambda(gamma, margin, 0.95), tdl),
                            (common.gae(gamma, margin, 0.95), tdl)]:
        got = np.asarray(estimator(*args))
        assert got.shape == (1, 3 - margin)
        np.testing.assert_allclose(got, [want], rtol=1e-5, atol=1e-6)


def test_spec_extra_examples_no_dones():
    rewards = np.array([[1, 2, 3, 4]], np.float32)
    values = np.array([[10, 20, 30, 40]], np.float32)
    returns = np.zeros_like(rewards)
    dones = np.zeros((1, 4), bool)
    mask = np.ones((1, 4), bool)
    args = (rewards, returns, values, dones, mask)
    np.testing.assert_allclose(np.asarray(common.td_k(0.9, 2)(*args)), [[17.1, 17.1]],
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(common.gae(0.9, 0)(*args)),
                               [[23.2742, 16.695, 9, 0]], rtol=1e-5, atol=1e-6)


def test_spec_gamma_zero_discount_mask_example():
    rewards = np.array([[1, 2, 3, 4]], np.float32)
    values = np.array([[5, 6, 7, 8]], np.float32)
    mask = np.array([[1, 0, 1, 0]], bool)
    dones = np.zeros((1, 4), bool)
    gammas = common.mask_discount(0.0, mask)
    np.testing.assert_allclose(np.asarray(gammas), [[0, 1, 0, 1]])
    returns = common.discounted_returns(rewards, gammas)
    np.testing.assert_allclose(np.asarray(returns), [[1, 5, 3, 4]], rtol=1e-6)
    args = (rewards, np.asarray(returns), values, dones, mask)
    for estimator in (common.monte_carlo(0.0, 1), common.td_lambda(0.0, 1),
                      common.gae(0.0, 1)):
        np.testing.assert_allclose(np.asarray(estimator(*args)), [[-4, -1, -4]],
                                   rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(common.td_k(0.0, 1)(*args)), [[-4, 3, -4]],
                               rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# 3. With and without jit (chex.variants), vmapped, and the chex contracts.
# ---------------------------------------------------------------------------

ESTIMATOR_CASES = [  # name, estimator, its loop reference, margin
    ('monte_carlo', lambda: common.monte_carlo(0.9, 2),
     functools.partial(ref_monte_carlo, 0.9, 2), 2),
    ('td_k', lambda: common.td_k(0.9, 2), functools.partial(ref_td_k, 0.9, 2), 2),
    ('td_lambda', lambda: common.td_lambda(0.9, 1, 0.8),
     functools.partial(ref_td_lambda, 0.9, 1, 0.8), 1),
    ('gae_m0', lambda: common.gae(1.0, 0, 0.8), functools.partial(ref_gae, 1.0, 0, 0.8), 0),
    ('gae_m3', lambda: common.gae(0.99, 3, 0.95), functools.partial(ref_gae, 0.99, 3, 0.95), 3),
]
ESTIMATOR_ARGS = ('rewards', 'returns', 'values', 'dones', 'discount_mask')


class EstimatorVariantsTest(chex.TestCase):
    """Each piece with and without jit, alone and vmapped over a leading axis,
    against the loop references."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*ESTIMATOR_CASES)
    def test_estimator(self, make, reference, margin):
        estimator = make()
        inputs = random_inputs(500 + margin, lead=(2,))
        want = np.stack([reference(*(x[i] for x in inputs)) for i in range(2)])
        one = self.variant(estimator)(*(x[0] for x in inputs))
        assert one.shape == (BATCH, LENGTH - margin)
        np.testing.assert_allclose(np.asarray(one), want[0], rtol=RTOL, atol=ATOL)
        both = self.variant(jax.vmap(estimator))(*inputs)
        assert both.shape == (2, BATCH, LENGTH - margin)
        np.testing.assert_allclose(np.asarray(both), want, rtol=RTOL, atol=ATOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_discounted_returns_and_mask_discount(self):
        rewards, _, _, _, mask = random_inputs(600, lead=(2,))
        gammas = self.variant(jax.vmap(functools.partial(common.mask_discount, 0.9)))(mask)
        np.testing.assert_allclose(np.asarray(gammas),
                                   np.stack([ref_mask_discount(0.9, m) for m in mask]),
                                   rtol=1e-6)
        gammas = np.asarray(gammas, np.float32)
        got = self.variant(common.discounted_returns)(rewards[0], gammas[0])
        np.testing.assert_allclose(np.asarray(got), ref_discounted_returns(rewards[0], gammas[0]),
                                   rtol=RTOL, atol=ATOL)
        got = self.variant(jax.vmap(common.discounted_returns))(rewards, gammas)
        np.testing.assert_allclose(np.asarray(got), np.stack(
            [ref_discounted_returns(r, g) for r, g in zip(rewards, gammas)]), rtol=RTOL, atol=ATOL)
        # one scalar gamma for every row, broadcast inside vmap
        got = self.variant(jax.vmap(common.discounted_returns, in_axes=(0, None)))(rewards, 0.5)
        np.testing.assert_allclose(np.asarray(got), np.stack(
            [ref_discounted_returns(r, 0.5) for r in rewards]), rtol=RTOL, atol=ATOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_mlp(self):
        params = common.init_mlp(jax.random.PRNGKey(0), [4, 8, 3])
        x = np.random.default_rng(0).normal(size=(2, 5, 4)).astype(np.float32)
        got = self.variant(common.mlp)(params, x)
        assert got.shape == (2, 5, 3)
        np.testing.assert_allclose(np.asarray(got[1, 2]), np.asarray(common.mlp(params, x[1, 2])),
                                   rtol=1e-5, atol=1e-6)


class ContractTest(chex.TestCase):
    """A wrong-shaped call fails at once, with chex's message naming the argument,
    instead of broadcasting into a wrong result; with jit it fails while tracing."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*ESTIMATOR_CASES)
    def test_estimator_names_the_wrong_argument(self, make, reference, margin):
        del reference, margin
        estimator = self.variant(make())
        inputs = random_inputs(1)
        label = make().__qualname__.split('.')[0] + ' estimator'
        for index, name in enumerate(ESTIMATOR_ARGS):
            one_row = [x[0] if i == index else x for i, x in enumerate(inputs)]  # [length]
            with self.assertRaisesRegex(
                    AssertionError, rf'assert_rank failed: .* but expected 2\. '
                                    rf'\[argument `{name}` of {label}\]'):
                estimator(*one_row)
            one_step = [x[:, :1] if i == index else x for i, x in enumerate(inputs)]  # [batch, 1]
            with self.assertRaisesRegex(AssertionError,
                                        rf'assert_equal_shape failed: .*\(3, 1\).*{label}'):
                estimator(*one_step)

    @chex.variants(with_jit=True, without_jit=True)
    def test_discounted_returns_names_the_wrong_argument(self):
        rewards, _, _, _, mask = random_inputs(2)
        returns = self.variant(common.discounted_returns)
        with self.assertRaisesRegex(AssertionError,
                                    r'assert_rank.*\[argument `rewards` of discounted_returns\]'):
            returns(rewards[0], 0.9)  # one row, no batch axis
        with self.assertRaisesRegex(AssertionError,
                                    r'assert_rank.*\[argument `gammas` of discounted_returns\]'):
            returns(rewards, np.full(LENGTH, 0.9, np.float32))  # per step, not per row
        with self.assertRaisesRegex(AssertionError, r'assert_equal_shape.*discounted_returns'):
            returns(rewards, np.full((BATCH, 1), 0.9, np.float32))  # would broadcast
        with self.assertRaisesRegex(AssertionError,
                                    r'assert_rank.*\[argument `discount` of mask_discount\]'):
            self.variant(common.mask_discount)(np.full(LENGTH, 0.9, np.float32), mask)

    @chex.variants(with_jit=True, without_jit=True)
    def test_mlp_names_the_wrong_argument(self):
        params = common.init_mlp(jax.random.PRNGKey(0), [4, 8, 3])
        mlp = self.variant(common.mlp)
        with self.assertRaisesRegex(AssertionError,
                                    r'expected \(\.\.\., 4\)\. \[argument `x` of mlp\]'):
            mlp(params, jnp.ones((5, 3)))  # 3 features for a 4-input net
        with self.assertRaisesRegex(AssertionError, r'\[argument `x` of mlp\]'):
            mlp(params, jnp.ones(()))
        bad = [dict(layer) for layer in params]
        bad[1]['b'] = bad[1]['b'][None]  # [1, out]: would broadcast a batch of 1
        with self.assertRaisesRegex(AssertionError, r'\[argument `params\[1\]\["b"\]` of mlp\]'):
            mlp(bad, jnp.ones((5, 4)))


def test_contracts_add_nothing_to_the_traced_program():
    inputs = random_inputs(3)
    for _, make, _, _ in ESTIMATOR_CASES:
        assert_contracts_trace_to_nothing(make(), *inputs)
    assert_contracts_trace_to_nothing(common.discounted_returns, inputs[0], 0.9)
    assert_contracts_trace_to_nothing(common.mlp, common.init_mlp(jax.random.PRNGKey(0), [7, 3]),
                                      inputs[0])


SWEEP_GAMMAS = np.array([0.0, 0.5, 0.9, 1.0], np.float32)
SWEEP_LAMBDAS = np.array([0.95, 0.0, 1.0, 0.5], np.float32)


@pytest.mark.parametrize('name', ['monte_carlo', 'td_k', 'td_lambda', 'gae'])
def test_estimator_with_traced_gamma_and_lambda(name):
    """gamma (and lambda) are per-run sweep values in the scripts: traced, vmapped."""
    margin = 2
    inputs = random_inputs(700)
    if name in ('td_lambda', 'gae'):
        factory = getattr(common, name)
        fn = lambda g, lam: factory(g, margin, lam)(*inputs)  # noqa: E731
        refs = [{'td_lambda': ref_td_lambda, 'gae': ref_gae}[name](
            float(g), margin, float(lam), *inputs) for g, lam in zip(SWEEP_GAMMAS, SWEEP_LAMBDAS)]
    else:
        factory = getattr(common, name)
        fn = lambda g, lam: factory(g, margin)(*inputs)  # noqa: E731
        refs = [{'monte_carlo': ref_monte_carlo, 'td_k': ref_td_k}[name](
            float(g), margin, *inputs) for g in SWEEP_GAMMAS]
    got = np.asarray(jax.jit(jax.vmap(fn))(SWEEP_GAMMAS, SWEEP_LAMBDAS))
    assert got.shape == (len(SWEEP_GAMMAS), BATCH, LENGTH - margin)
    np.testing.assert_allclose(got, np.stack(refs), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------
# 4. remaining_evals (docs/trax.md section 3).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('args,want', [
    ((0, 1, 10, 2), 2),
    ((5, 1, 10, 2), 1),
    ((10, 1, 10, 2), 0),
    ((15, 2, 10, 2), 1),
    ((10, 2, 10, 2), 2),
    ((20, 3, 10, 1), 1),
    ((6, 1, 10, 3), 1),   # per_eval = 10 // 3 = 3
])
def test_remaining_evals_values(args, want):
    assert common.remaining_evals(*args) == want


@pytest.mark.parametrize('args,message', [
    ((0, 0, 10, 2), 'Epoch must be at least 1, got 0'),
    ((5, -1, 10, 2), 'Epoch must be at least 1, got -1'),
    ((5, 2, 10, 2), 'Current step (5) < previously done steps (10).'),
    ((3, 1, 10, 2), 'Done steps (3) must divide train steps per eval (5).'),
    ((17, 2, 10, 2), 'Done steps (7) must divide train steps per eval (5).'),
])
def test_remaining_evals_errors(args, message):
    with pytest.raises(ValueError, match='^' + re.escape(message) + '$'):
        common.remaining_evals(*args)


# ---------------------------------------------------------------------------
# 5. Checkpoints.
# ---------------------------------------------------------------------------


class State(NamedTuple):
    params: list
    opt: dict
    key: object
    keys: object
    done: object
    step: object


def make_state(offset=0.0):
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.4e38, 1.5 + offset],
                       np.float32)
    return State(
        params=[{'w': jnp.arange(12, dtype=jnp.float32).reshape(3, 4) + offset,
                 'b': jnp.asarray(special)},
                {'w': jnp.full((4, 2), -1.25 + offset, jnp.float32),
                 'b': np.zeros((2,), np.float32)}],
        opt={'count': jnp.int32(7 + int(offset)), 'mu': [np.float32(offset),
                                                         jnp.ones((2, 2), jnp.float32)]},
        key=jax.random.PRNGKey(42 + int(offset)),
        keys=jax.random.split(jax.random.PRNGKey(3), 5),
        done=np.array([True, False, True, True, False, bool(offset)]),
        step=np.int32(123 + int(offset)),
    )


METADATA = {
    'config': {'env': 'CartPole-v1', 'lr': 1e-3, 'grid': {'lr': [1e-3, 3e-4]},
               'max_steps': None, 'double_dqn': True, 'eval_steps': [200, 500]},
    'epoch': 3,
    'history': [{'epoch': 1, 'run': 0, 'rl/avg_return': 12.5, 'metrics/value_loss': None},
                {'epoch': 2, 'run': 0, 'rl/avg_return': 0.1 + 0.2}],
    'text': 'caf\u00e9 \u2192 ok',
}


def assert_trees_bitwise_equal(got, want):
    """chex.assert_trees_all_equal (structure, shapes, dtypes and values, naming the
    leaf that differs), then the bytes: exact equality still counts -0.0 as 0.0
    and any NaN as any other, and a checkpoint must give back the very bits."""
    chex.assert_trees_all_equal(got, want, strict=True)  # strict: dtypes too
    chex.assert_trees_all_equal_comparator(
        lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
        lambda a, b: f'equal values, different bytes: {a!r} vs {b!r}', got, want)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / 'checkpoint.npz'
    rundir.save_checkpoint(str(path), make_state(), METADATA)
    return path


def test_checkpoint_round_trip(ckpt):
    state = make_state()
    restored, metadata = rundir.load_checkpoint(str(ckpt), state)
    assert isinstance(restored, State)
    assert_trees_bitwise_equal(restored, state)
    assert restored.key.dtype == np.uint32 and restored.keys.shape == (5, 2)
    assert restored.done.dtype == np.bool_
    assert metadata == METADATA
    assert rundir.read_checkpoint_metadata(str(ckpt)) == METADATA
    # Loadable into an all-jax template too, and after an overwrite holds the new state.
    new = make_state(1.0)
    rundir.save_checkpoint(str(ckpt), new, {'epoch': 4})
    restored, metadata = rundir.load_checkpoint(str(ckpt), jax.tree.map(jnp.asarray, new))
    assert_trees_bitwise_equal(restored, jax.tree.map(np.asarray, new))
    assert metadata == {'epoch': 4}
    assert os.listdir(ckpt.parent) == ['checkpoint.npz']


def _replace_leaf(state, which, value):
    params = [dict(layer) for layer in state.params]
    if which == 'w0':
        params[0]['w'] = value
        return state._replace(params=params)
    if which == 'done':
        return state._replace(done=value)
    if which == 'step':
        return state._replace(step=value)
    if which == 'key':
        return state._replace(key=value)
    raise AssertionError(which)


MISMATCHES = {
    'shape_w': lambda s: _replace_leaf(s, 'w0', np.zeros((4, 3), np.float32)),
    'shape_done': lambda s: _replace_leaf(s, 'done', np.zeros((7,), bool)),
    'shape_scalar_vs_vector': lambda s: _replace_leaf(s, 'step', np.zeros((1,), np.int32)),
    'dtype_float16': lambda s: _replace_leaf(s, 'w0', np.zeros((3, 4), np.float16)),
    'dtype_int_vs_float': lambda s: _replace_leaf(s, 'step', np.float32(0)),
    'dtype_key_int32': lambda s: _replace_leaf(s, 'key', np.zeros((2,), np.int32)),
    'dtype_bool_vs_int': lambda s: _replace_leaf(s, 'done', np.zeros((6,), np.int32)),
    'extra_leaf': lambda s: s._replace(opt={**s.opt, 'nu': np.zeros(2, np.float32)}),
    'missing_leaf': lambda s: s._replace(opt={'count': s.opt['count']}),
    'renamed_key': lambda s: s._replace(opt={'count2': s.opt['count'], 'mu': s.opt['mu']}),
    'extra_layer': lambda s: s._replace(params=s.params + [s.params[-1]]),
    'tuple_not_namedtuple': lambda s: tuple(s),
}


@pytest.mark.parametrize('mutate', list(MISMATCHES.values()), ids=list(MISMATCHES))
def test_checkpoint_template_mismatch(ckpt, mutate):
    template = mutate(make_state())
    with pytest.raises(ValueError, match=re.escape(str(ckpt))):
        rundir.load_checkpoint(str(ckpt), template)


def test_checkpoint_missing_file(tmp_path):
    path = str(tmp_path / 'nope' / 'checkpoint.npz')
    with pytest.raises(ValueError, match=re.escape(path)):
        rundir.load_checkpoint(path, make_state())
    with pytest.raises(ValueError, match=re.escape(path)):
        rundir.read_checkpoint_metadata(path)


def _write(path, data):
    with open(path, 'wb') as f:
        f.write(data)


def _corruptions(raw):
    rng = np.random.default_rng(0)
    yield 'random_bytes', rng.integers(0, 256, 2000, dtype=np.uint8).tobytes()
    yield 'random_bytes_zip_magic', b'PK\x03\x04' + rng.integers(
        0, 256, 2000, dtype=np.uint8).tobytes()
    yield 'npy_magic_garbage', b'\x93NUMPY' + rng.integers(0, 256, 200, dtype=np.uint8).tobytes()
    yield 'empty', b''
    for fraction in (0.5, 0.1, 0.9):
        yield f'truncated_{fraction}', raw[:int(len(raw) * fraction)]
    yield 'truncated_last_byte', raw[:-1]
    data = bytearray(raw)  # a flipped byte inside the first leaf's data: CRC must catch it
    position = raw.find(np.array([3.0, 4.0], np.float32).tobytes())  # in params[0]['w']
    assert position > 0
    data[position + 3] ^= 0x01
    yield 'bit_flip_in_data', bytes(data)


@pytest.mark.parametrize('kind', ['random_bytes', 'random_bytes_zip_magic',
                                  'npy_magic_garbage', 'empty', 'truncated_0.5',
                                  'truncated_0.1', 'truncated_0.9', 'truncated_last_byte',
                                  'bit_flip_in_data'])
def test_checkpoint_corrupt_or_truncated(ckpt, kind):
    data = dict(_corruptions(ckpt.read_bytes()))[kind]
    bad = ckpt.parent / 'bad.npz'
    _write(bad, data)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        rundir.load_checkpoint(str(bad), make_state())
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        rundir.read_checkpoint_metadata(str(bad))


def test_checkpoint_valid_npz_that_is_not_a_checkpoint(tmp_path):
    for name, arrays in [('no_header', {'foo': np.zeros(3)}),
                         ('bad_json', {'header': np.frombuffer(b'{not json', np.uint8)}),
                         ('missing_leaf', {'header': np.frombuffer(
                             b'{"paths": ["[0]", "[1]"], "metadata": {}}', np.uint8),
                             'leaf_00000': np.zeros(2)})]:
        path = str(tmp_path / f'{name}.npz')
        with open(path, 'wb') as f:
            np.savez(f, **arrays)
        with pytest.raises(ValueError, match=re.escape(path)):
            rundir.load_checkpoint(path, [np.zeros(2), np.zeros(2)])


def _central_directory_corruption(raw, offset, value):
    data = bytearray(raw)
    position = raw.find(b'PK\x01\x02')
    assert position > 0
    data[position + offset] = value
    return bytes(data)


# zipfile raises NotImplementedError / RuntimeError for these; they must become ValueError.
@pytest.mark.parametrize('field,offset,value', [
    ('encrypted_flag', 8, 0x01),          # RuntimeError: ... is encrypted, password required
    ('version_needed', 6, 0xFF),          # NotImplementedError: zip file version 25.5
    ('compression_method', 10, 99),       # NotImplementedError: compression method
])
def test_checkpoint_corrupt_zip_directory(ckpt, field, offset, value):
    bad = ckpt.parent / 'bad.npz'
    _write(bad, _central_directory_corruption(ckpt.read_bytes(), offset, value))
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        rundir.load_checkpoint(str(bad), make_state())


class SimulatedCrash(Exception):
    pass


@pytest.mark.parametrize('crash_at', ['os.replace', 'os.fsync', 'np.savez'])
def test_checkpoint_interrupted_write_keeps_previous(ckpt, monkeypatch, crash_at):
    old_bytes = ckpt.read_bytes()
    module_name, attr = crash_at.split('.')
    module = {'os': rundir.os, 'np': rundir.np}[module_name]

    def crash(*args, **kwargs):
        raise SimulatedCrash(crash_at)

    monkeypatch.setattr(module, attr, crash)
    with pytest.raises(SimulatedCrash):
        rundir.save_checkpoint(str(ckpt), make_state(1.0), {'epoch': 99})
    monkeypatch.undo()

    assert ckpt.read_bytes() == old_bytes
    restored, metadata = rundir.load_checkpoint(str(ckpt), make_state())
    assert_trees_bitwise_equal(restored, make_state())
    assert metadata == METADATA
    assert rundir.read_checkpoint_metadata(str(ckpt)) == METADATA
    # And a later save works and replaces the old contents.
    rundir.save_checkpoint(str(ckpt), make_state(1.0), {'epoch': 4})
    restored, metadata = rundir.load_checkpoint(str(ckpt), make_state(1.0))
    assert_trees_bitwise_equal(restored, make_state(1.0))
    assert metadata == {'epoch': 4}


def test_checkpoint_leftover_temp_file_is_harmless(ckpt):
    # A crashed writer's temp file (garbage) next to the checkpoint.
    for name in (f'{ckpt.name}.tmp-{os.getpid()}', f'{ckpt.name}.tmp-1', 'checkpoint.npz.tmp'):
        _write(ckpt.parent / name, b'garbage')
    restored, metadata = rundir.load_checkpoint(str(ckpt), make_state())
    assert_trees_bitwise_equal(restored, make_state())
    rundir.save_checkpoint(str(ckpt), make_state(1.0), {'epoch': 5})
    restored, metadata = rundir.load_checkpoint(str(ckpt), make_state(1.0))
    assert_trees_bitwise_equal(restored, make_state(1.0))
    assert metadata == {'epoch': 5}


def test_checkpoint_written_to_temp_then_renamed(ckpt, monkeypatch):
    """At the moment of the rename the temp file is a complete checkpoint in the
    same directory under another name, and the target still holds the old one."""
    old_bytes = ckpt.read_bytes()
    real_replace = os.replace
    calls = []

    def spy(src, dst):
        src, dst = os.fspath(src), os.fspath(dst)
        calls.append((src, dst))
        if os.path.abspath(dst) == os.path.abspath(str(ckpt)):
            assert os.path.abspath(src) != os.path.abspath(dst)
            assert os.path.dirname(os.path.abspath(src)) == str(ckpt.parent)
            assert ckpt.read_bytes() == old_bytes
            restored, metadata = rundir.load_checkpoint(src, make_state(1.0))
            assert_trees_bitwise_equal(restored, make_state(1.0))
            assert metadata == {'epoch': 9}
        return real_replace(src, dst)

    monkeypatch.setattr(rundir.os, 'replace', spy)
    rundir.save_checkpoint(str(ckpt), make_state(1.0), {'epoch': 9})
    monkeypatch.undo()
    assert [dst for _, dst in calls] == [str(ckpt)]
    assert os.listdir(ckpt.parent) == ['checkpoint.npz']
    assert rundir.read_checkpoint_metadata(str(ckpt)) == {'epoch': 9}


# ---------------------------------------------------------------------------
# 6. Schedules.
# ---------------------------------------------------------------------------

STEPS = [0, 1, 50, 399, 400, 401, 1000, 12345, 100000]


def test_multifactor_trax_default():
    explicit = common.multifactor('constant * linear_warmup * rsqrt_decay', constant=0.1,
                                  warmup_steps=400)
    default = common.multifactor()
    for step in STEPS:
        want = 0.1 * min(1.0, step / 400) / np.sqrt(max(step, 400))
        np.testing.assert_allclose(float(explicit(step)), want, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(float(default(step)), want, rtol=1e-6, atol=1e-12)
    jitted = jax.jit(explicit)(jnp.asarray(STEPS))
    np.testing.assert_allclose(
        np.asarray(jitted),
        [0.1 * min(1.0, s / 400) / np.sqrt(max(s, 400)) for s in STEPS], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize('constant,decay,every,minimum', [
    (1.0, 0.99, 1, 0.1),       # Trax's DQN exploration_rate default
    (1.0, 0.995, 1, 0.1),      # Trax's CartPole regression config
    (0.5, 0.5, 3, 0.01),
    (2.0, 0.9, 7, 0.0),
])
def test_multifactor_decay_every(constant, decay, every, minimum):
    schedule = common.multifactor('constant * decay_every', constant=constant,
                                  decay_factor=decay, steps_per_decay=every, minimum=minimum)
    for step in [0, 1, 2, 3, 5, 6, 7, 13, 14, 20, 100, 229, 230, 459, 460, 1000]:
        want = max(minimum, constant * decay ** (step // every))
        np.testing.assert_allclose(float(schedule(step)), want, rtol=1e-5, atol=1e-12)


def test_multifactor_traced_constant():
    values = jax.jit(jax.vmap(lambda c: common.multifactor(constant=c)(800)))(
        jnp.asarray([0.1, 0.2], jnp.float32))
    np.testing.assert_allclose(np.asarray(values), np.array([0.1, 0.2]) / np.sqrt(800),
                               rtol=1e-6)


@pytest.mark.parametrize('factors', ['constant * cosine_decay', 'bogus', 'constant*warmup'])
def test_multifactor_unknown_factor(factors):
    with pytest.raises(common.UsageError):
        common.multifactor(factors)(10)


# ---------------------------------------------------------------------------
# 7. make_env.
# ---------------------------------------------------------------------------


def test_make_env_unknown_name():
    with pytest.raises(common.UsageError) as info:
        common.make_env('CartPole-v9')
    message = str(info.value)
    assert 'CartPole-v9' in message
    assert 'CartPole-v1' in message and 'Pendulum-v1' in message
    assert '\n' not in message


def test_make_env_max_steps():
    _, params = common.make_env('CartPole-v1', max_steps=123)
    assert params.max_steps_in_episode == 123
    _, params = common.make_env('CartPole-v1')
    assert params.max_steps_in_episode == 500  # gymnax's CartPole-v1 default


@pytest.mark.parametrize('name', ['CartPole-v1', 'Asterix-MinAtar', 'FourRooms-misc'])
def test_step_first_episode_equals_env_step_until_the_episode_ends(name):
    """The no-auto-reset step gives env.step's outputs, randomness included
    (Asterix spawns and FourRooms slips with the step's key), up to and
    including the step that ends the first episode."""
    env, params = common.make_env(name, max_steps=30)
    plain = jax.jit(lambda k, s, a: env.step(k, s, a, params))
    first = jax.jit(lambda k, s, a: common.step_first_episode(env, k, s, a, params))
    key = jax.random.PRNGKey(0)
    _, state = env.reset(key, params)
    n_actions = env.action_space(params).n
    for t in range(40):
        key, step_key, action_key = jax.random.split(key, 3)
        action = jax.random.randint(action_key, (), 0, n_actions)
        _, plain_state, *plain_out, plain_info = plain(step_key, state, action)
        obs, first_state, *first_out, first_info = first(step_key, state, action)
        assert_trees_bitwise_equal(first_out, plain_out)  # reward, terminated, truncated
        assert_trees_bitwise_equal(obs, plain_info['final_observation'])
        assert_trees_bitwise_equal(first_info['final_observation'], obs)
        if bool(plain_out[1] | plain_out[2]):
            break
        assert_trees_bitwise_equal(first_state, plain_state)
        state = plain_state
    assert t >= 1  # the episode lasted a few steps and ended inside the loop
    assert bool(plain_out[1] | plain_out[2])


# ---------------------------------------------------------------------------
# 8. MLP, and `import common` not importing gymnax.
# ---------------------------------------------------------------------------


def test_init_mlp_and_mlp():
    sizes = [4, 16, 8, 3]
    params = common.init_mlp(jax.random.PRNGKey(0), sizes)
    assert len(params) == 3
    for layer, fan_in, fan_out in zip(params, sizes[:-1], sizes[1:]):
        assert layer['w'].shape == (fan_in, fan_out)
        assert layer['b'].shape == (fan_out,)
        assert np.all(np.isfinite(np.asarray(layer['w'])))
        assert np.std(np.asarray(layer['w'])) > 0
        np.testing.assert_array_equal(np.asarray(layer['b']), 0)
    assert_trees_bitwise_equal(common.init_mlp(jax.random.PRNGKey(0), sizes), params)
    other = common.init_mlp(jax.random.PRNGKey(1), sizes)
    assert not np.array_equal(np.asarray(other[0]['w']), np.asarray(params[0]['w']))
    # last_scale multiplies the last layer only
    small = common.init_mlp(jax.random.PRNGKey(0), sizes, last_scale=0.01)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(small[i]['w']), np.asarray(params[i]['w']))
    np.testing.assert_allclose(np.asarray(small[2]['w']), 0.01 * np.asarray(params[2]['w']),
                               rtol=1e-6)

    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    out = common.mlp(params, x)
    assert out.shape == (5, 3)
    assert common.mlp(params, x[0]).shape == (3,)
    h = x.astype(np.float64)
    for i, layer in enumerate(params):
        h = h @ np.asarray(layer['w'], np.float64) + np.asarray(layer['b'], np.float64)
        if i < len(params) - 1:
            h = np.maximum(h, 0)  # ReLU between layers, linear output
    np.testing.assert_allclose(np.asarray(out), h, rtol=1e-4, atol=1e-5)
    # nonzero biases are added
    shifted = [dict(layer) for layer in params]
    shifted[-1]['b'] = jnp.asarray([1.0, -2.0, 3.0])
    np.testing.assert_allclose(np.asarray(common.mlp(shifted, x)), h + [1.0, -2.0, 3.0],
                               rtol=1e-4, atol=1e-5)


def reference_conv_network(params, x):
    """The conv torso + MLP head written out with jax.lax.conv (NCHW / OIHW)."""
    h = jnp.transpose(x, (0, 3, 1, 2))  # [N, H, W, C] -> [N, C, H, W]
    for layer in params['conv']:
        kernel = jnp.transpose(layer['w'], (3, 2, 0, 1))  # [k, k, in, out] -> [out, in, k, k]
        h = jax.lax.conv(h, kernel, (1, 1), 'VALID') + layer['b'][None, :, None, None]
        h = jnp.maximum(h, 0.0)
    h = jnp.transpose(h, (0, 2, 3, 1)).reshape(x.shape[0], -1)  # channels-last flatten
    for layer in params['mlp'][:-1]:
        h = jnp.maximum(h @ layer['w'] + layer['b'], 0.0)
    return h @ params['mlp'][-1]['w'] + params['mlp'][-1]['b']


def test_conv_torso_shapes_and_gradients_match_lax_conv():
    obs_shape = (5, 4, 2)
    layers = common.init_conv(jax.random.PRNGKey(0), 2, (4, 3))
    assert [layer['w'].shape for layer in layers] == [(3, 3, 2, 4), (3, 3, 4, 3)]
    # Two 3x3 VALID convs would take 5x4 to 3x2, then to 1x0: refused.
    with pytest.raises(common.UsageError, match='too small'):
        common.conv_output_shape(obs_shape, (4, 3))
    params = common.init_network(jax.random.PRNGKey(0), obs_shape, (6,), 3, 'conv',
                                 conv_channels=(4,))
    assert common.conv_output_shape(obs_shape, (4,)) == (3, 2, 4)
    assert params['conv'][0]['w'].shape == (3, 3, 2, 4) and params['conv'][0]['b'].shape == (4,)
    assert [layer['w'].shape for layer in params['mlp']] == [(3 * 2 * 4, 6), (6, 3)]
    # Nonzero biases, so they are checked too.
    params = jax.tree.map(lambda leaf: leaf + 0.1 * jnp.arange(leaf.size).reshape(leaf.shape)
                          / leaf.size, params)
    x = jax.random.normal(jax.random.PRNGKey(1), (7,) + obs_shape)
    out = common.network(params, x, obs_shape)
    assert out.shape == (7, 3)
    np.testing.assert_allclose(out, reference_conv_network(params, x), rtol=1e-5, atol=1e-6)
    # Leading batch dims of any rank, and one observation alone.
    np.testing.assert_allclose(common.network(params, x.reshape((7, 1) + obs_shape), obs_shape),
                               out[:, None], rtol=1e-6, atol=1e-6)
    assert common.network(params, x[0], obs_shape).shape == (3,)

    def loss(net, p):
        return jnp.sum(jnp.sin(net(p, x)))
    grads = jax.grad(lambda p: loss(lambda q, y: common.network(q, y, obs_shape), p))(params)
    want = jax.grad(lambda p: loss(reference_conv_network, p))(params)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        assert np.any(np.asarray(expected) != 0)


def test_torso_choice():
    assert common.resolve_torso('auto', (10, 10, 4)) == 'conv'
    assert common.resolve_torso('auto', (4,)) == 'mlp'
    assert common.resolve_torso('auto', (8, 8)) == 'mlp'
    assert common.resolve_torso('mlp', (10, 10, 4)) == 'mlp'
    with pytest.raises(common.UsageError, match='conv'):
        common.resolve_torso('conv', (4,))
    with pytest.raises(common.UsageError, match='torso'):
        common.resolve_torso('cnn', (4,))
    # An MLP network is init_mlp's list, applied to flattened observations.
    params = common.init_network(jax.random.PRNGKey(0), (2, 3), (5,), 2)
    assert_trees_bitwise_equal(params, common.init_mlp(jax.random.PRNGKey(0), [6, 5, 2]))
    x = jnp.arange(12.0).reshape(2, 2, 3)
    np.testing.assert_array_equal(common.network(params, x, (2, 3)),
                                  common.mlp(params, x.reshape(2, 6)))


def test_import_common_does_not_import_gymnax():
    code = ("import sys; import common; "
            "assert 'gymnax' not in sys.modules, 'gymnax imported by import common'; "
            "print('ok')")
    result = subprocess.run([sys.executable, '-c', code], cwd=str(REPO),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == 'ok'


# ---------------------------------------------------------------------------
# 9. Config flags.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    env: str = common.option('CartPole-v1', 'gymnax env name')
    max_slice_length: int = common.option(2, 'slice length')
    double_dqn: bool = common.option(True, 'double DQN')
    eval_steps: Tuple[int, ...] = common.option((200,), 'eval horizons')
    max_steps: Optional[int] = common.option(None, 'episode cap')
    lr: float = common.option(1e-3, 'learning rate', sweep=True)
    gamma: float = common.option(0.99, 'discount', sweep=True)


def parse(argv):
    parser = flags.build_parser(TinyConfig, 'tiny', 'a tiny config')
    return parser.parse_args(argv)


def test_config_defaults():
    args = parse([])
    config, grid = flags.config_and_grid(TinyConfig, args)
    assert config == TinyConfig()
    assert grid == {}
    assert (args.seed, args.num_seeds, args.output_dir, args.only_eval) == (0, 1, None, False)


def test_config_kebab_case_flags_bool_tuple_optional():
    args = parse(['--max-slice-length', '3', '--no-double-dqn', '--eval-steps', '200,500',
                  '--max-steps', '50', '--env', 'Acrobot-v1', '--seed', '4',
                  '--num-seeds', '2', '--output-dir', 'out'])
    config, grid = flags.config_and_grid(TinyConfig, args)
    assert config == TinyConfig(env='Acrobot-v1', max_slice_length=3, double_dqn=False,
                                eval_steps=(200, 500), max_steps=50)
    assert isinstance(config.max_slice_length, int)
    assert grid == {}
    assert (args.seed, args.num_seeds, args.output_dir) == (4, 2, 'out')
    assert flags.config_and_grid(TinyConfig, parse(['--double-dqn']))[0].double_dqn is True
    assert flags.config_and_grid(TinyConfig, parse(['--eval-steps', '300']))[0].eval_steps \
        == (300,)
    assert flags.config_and_grid(TinyConfig, parse(['--max-steps', 'none']))[0].max_steps \
        is None


def test_config_help_lists_kebab_flags(capsys):
    with pytest.raises(SystemExit) as info:
        parse(['--help'])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ('--max-slice-length', '--double-dqn', '--no-double-dqn', '--eval-steps',
                 '--max-steps', '--lr', '--num-seeds', '--output-dir', '--only-eval'):
        assert flag in out
    assert '--max_slice_length' not in out


@pytest.mark.parametrize('script', ['dqn', 'pg', 'actor_critic'])
def test_help_states_each_default_once(script):
    """Every flag's help ends with its default, said once (a help text that
    already explains the default, e.g. '(default: --epochs)', gets no second)."""
    module = __import__(script)
    parser = flags.build_parser(module.Config, f'{script}.py', '')
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest == 'help':
            continue
        text = formatter._get_help_string(action) % {'default': action.default}
        assert text.count('(default') == 1, (action.dest, text)


def test_config_sweep_grid_and_runs():
    args = parse(['--lr', '1e-3,3e-4', '--gamma', '0.9,0.99'])
    config, grid = flags.config_and_grid(TinyConfig, args)
    assert config.lr == 1e-3 and config.gamma == 0.9
    assert grid == {'lr': [1e-3, 3e-4], 'gamma': [0.9, 0.99]}
    runs = common.expand_runs(config, grid, seed=5, num_seeds=2)
    assert [(r['lr'], r['gamma'], r['seed']) for r in runs] == [
        (1e-3, 0.9, 5), (1e-3, 0.9, 6), (1e-3, 0.99, 5), (1e-3, 0.99, 6),
        (3e-4, 0.9, 5), (3e-4, 0.9, 6), (3e-4, 0.99, 5), (3e-4, 0.99, 6)]
    hp = common.hyperparameters(config, runs)
    np.testing.assert_allclose(np.asarray(hp['lr']), [1e-3] * 4 + [3e-4] * 4, rtol=1e-6)
    assert hp['lr'].dtype == jnp.float32


def test_config_single_sweep_value_and_no_grid_runs():
    args = parse(['--lr', '3e-4'])
    config, grid = flags.config_and_grid(TinyConfig, args)
    assert config.lr == 3e-4 and grid == {}
    runs = common.expand_runs(config, grid, seed=0, num_seeds=3)
    assert runs == [{'seed': s, 'lr': 3e-4, 'gamma': 0.99} for s in range(3)]


@pytest.mark.parametrize('argv', [
    ['--max-slice-length', '2,3'],
    ['--max-slice-length', 'abc'],
    ['--max-slice-length', '2.5'],
    ['--lr', 'fast'],
    ['--lr', '1e-3,x'],
    ['--eval-steps', '200,abc'],
    ['--seed', 'one'],
    ['--max-steps', 'lots'],
    ['--no-such-flag'],
    ['--max-slice-length'],
])
def test_config_bad_values_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err, 'nothing on stderr'
    assert len(err.splitlines()) == 1, err
    assert 'Traceback' not in err
    assert err.startswith('tiny: error:')
    flag = argv[0]
    assert flag in err


def test_config_unparseable_int_message_says_what(capsys):
    with pytest.raises(SystemExit) as info:
        parse(['--max-slice-length', 'abc'])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert '--max-slice-length' in err and 'int' in err and "'abc'" in err


def test_given_flags_names_only_what_the_command_line_set():
    parser = flags.build_parser(TinyConfig, 'tiny', '')
    assert flags.given_flags(parser, []) == set()
    given = flags.given_flags(parser, ['--lr', '1e-3,3e-4', '--no-double-dqn', '--seed', '3'])
    assert given == {'lr', 'double_dqn', 'seed'}
    # A flag given at its default value is still given (an explicit choice).
    assert flags.given_flags(parser, ['--gamma', '0.99']) == {'gamma'}
    assert parser.parse_args([]).lr == 1e-3  # the parser itself keeps its defaults


# ---------------------------------------------------------------------------
# Declared constraints (common.option's bounds / choices, common.check_fields)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('text,inside,outside,shown', [
    ('[1, inf)', [1, 2, 10 ** 9], [0, -1, math.inf], '>= 1'),
    ('(0, 1]', [1e-9, 0.5, 1.0], [0.0, 1.0000001, -1.0], 'in (0, 1]'),
    ('[0, 1)', [0.0, 0.999], [1.0, -1e-9], 'in [0, 1)'),
    ('[0, inf]', [0.0, math.inf], [-1.0], 'in [0, inf]'),
    ('(0, inf)', [1e-30], [0.0, math.inf], '> 0'),
])
def test_bounds_membership_and_text(text, inside, outside, shown):
    bounds = common.Bounds.parse(text)
    assert all(value in bounds for value in inside)
    assert not any(value in bounds for value in outside)
    assert str(bounds) == shown


@pytest.mark.parametrize('text', ['1, 2', '[1 2]', '[a, 2]', '{0, 1}'])
def test_malformed_bounds_fail_when_declared(text):
    with pytest.raises(ValueError):
        common.option(1, 'x', bounds=text)


@dataclasses.dataclass(frozen=True)
class BoundedConfig:
    count: int = common.option(4, 'a count', bounds='[1, inf)')
    sizes: Tuple[int, ...] = common.option((8, 8), 'sizes', bounds='[1, inf)')
    rate: float = common.option(0.5, 'a probability', sweep=True, bounds='[0, 1]')
    scale: float = common.option(0.0, 'any finite number')
    cap: Optional[int] = common.option(None, 'optional', bounds='[1, inf)')
    mode: str = common.option('a', 'a mode', choices=('a', 'b'))
    big: int = common.option(0, 'an unbounded int')


@pytest.mark.parametrize('changes,grid,message', [
    (dict(count=0), None, '--count must be >= 1, got 0'),
    (dict(sizes=(8, 0)), None, '--sizes entries must be >= 1, got 8,0'),
    (dict(rate=1.5), None, '--rate must be in [0, 1], got 1.5'),
    ({}, {'rate': [0.5, -0.1]}, '--rate must be in [0, 1], got -0.1'),
    (dict(scale=math.nan), None, '--scale must be a number'),
    (dict(scale=-math.inf), None, '--scale must be finite'),
    (dict(cap=0), None, '--cap must be >= 1'),
    (dict(mode='c'), None, '--mode must be one of a, b'),
    (dict(big=2 ** 31), None, '--big must be at most 2147483647'),
])
def test_check_fields_names_the_flag_and_the_rule(changes, grid, message):
    config = dataclasses.replace(BoundedConfig(), **changes)
    with pytest.raises(common.UsageError, match=re.escape(message)):
        common.check_fields(config, grid)


def test_check_fields_accepts_values_inside_and_unset_optionals():
    common.check_fields(BoundedConfig())
    common.check_fields(dataclasses.replace(BoundedConfig(), cap=3, scale=-2.5),
                        {'rate': [0.0, 1.0]})


@pytest.mark.parametrize('script', ['dqn', 'pg'])
def test_help_shows_each_constraint(script, capsys):
    module = __import__(script)
    with pytest.raises(SystemExit):
        module.main(['--help'])
    out = ' '.join(capsys.readouterr().out.split())
    for text in ('{>= 1} (default: 50)' if script == 'dqn' else '{>= 1} (default: 40)',
                 '{in (0, 1]} [comma list = sweep]', '{> 0} [comma list = sweep]'):
        assert text in out, text


@pytest.mark.parametrize('script', ['dqn', 'pg', 'actor_critic'])
def test_every_int_field_declares_its_bounds(script):
    """Counts and sizes all state their range (floats are at least finite)."""
    module = __import__(script)
    kinds = common._field_kinds(module.Config)
    for field in dataclasses.fields(module.Config):
        kind = kinds[field.name][0]
        if kind is int:
            assert field.metadata.get('bounds'), field.name


# ---------------------------------------------------------------------------
# The progress line and TensorBoard run names.
# ---------------------------------------------------------------------------


def test_epoch_line_shows_epoch_of_total_recent_return_and_time_left():
    metrics = {'rl/n_interactions': np.array([1024, 1024]),
               'rl/avg_return': np.array([np.nan, np.nan]),  # no episode ended this epoch
               'rl/avg_return_temperature0.00_steps500': np.array([500.0, 480.0]),
               'metrics/value_loss': np.array([0.5, 0.25])}
    line = cli.epoch_line(7, 150, metrics, np.array([210.0, 190.0]), 0.5, 3725)
    assert line == ('epoch   7/150 | steps 1024 | return 200.0 (min 190.0) | eval T0.00@500 '
                    '490.0 (min 480.0) | value_loss 0.375 | 0.50s | left 1h02m')
    assert cli.epoch_line(3, 5, metrics, np.array([np.nan, np.nan]), 0.5, 65).endswith(
        '| 0.50s | left 1m05s')
    assert 'return n/a' in cli.epoch_line(3, 5, metrics, np.array([np.nan, np.nan]), 1, 0)


def test_recent_returns_are_the_last_epoch_in_which_an_episode_ended():
    history = [{'epoch': 2, 'run': 0, 'rl/avg_return': None},
               {'epoch': 1, 'run': 0, 'rl/avg_return': 20.0},
               {'epoch': 1, 'run': 1, 'rl/avg_return': None},
               {'epoch': 2, 'run': 1, 'rl/avg_return': 30.0}]
    np.testing.assert_array_equal(cli.recent_returns(history, 3), [20.0, 30.0, np.nan])


def test_run_names_name_grid_values_and_seed():
    runs = [{'seed': 3, 'lr': 0.01, 'gamma': 0.99}, {'seed': 4, 'lr': 0.003, 'gamma': 0.99}]
    assert rundir.run_names(runs, {'lr': [0.01, 0.003]}) == ['lr=0.01,seed=3', 'lr=0.003,seed=4']
    assert rundir.run_names(runs[:1], {}) == ['seed=3']
    twins = [{'seed': 3, 'lr': 0.01}, {'seed': 3, 'lr': 0.01}]
    assert rundir.run_names(twins, {'lr': [0.01, 0.01]}) == ['lr=0.01,seed=3,run=0',
                                                              'lr=0.01,seed=3,run=1']


def test_take_saved_config_fills_in_what_the_command_line_left_out():
    parser = flags.build_parser(TinyConfig, 'tiny', '')
    saved = {'algorithm': 'tiny', 'env': 'Acrobot-v1', 'max_slice_length': 4,
             'double_dqn': False, 'eval_steps': [100, 300], 'max_steps': None, 'lr': 0.01,
             'gamma': 0.9, 'grid': {'lr': [0.01, 0.003]}, 'seed': 7, 'num_seeds': 2}
    argv = ['--gamma', '0.95', '--output-dir', 'x']
    args = parser.parse_args(argv)
    args.given, args.only_eval = flags.given_flags(parser, argv), False
    flags.take_saved_config(TinyConfig, args, saved)
    config, grid = flags.config_and_grid(TinyConfig, args)
    assert config == TinyConfig(env='Acrobot-v1', max_slice_length=4, double_dqn=False,
                                eval_steps=(100, 300), max_steps=None, lr=0.01, gamma=0.95)
    assert grid == {'lr': [0.01, 0.003]} and (args.seed, args.num_seeds) == (7, 2)
    # A save of another algorithm (other fields) is left alone: resuming names them.
    args = parser.parse_args([])
    args.given, args.only_eval = set(), False
    flags.take_saved_config(TinyConfig, args, {**saved, 'hidden_sizes': [8]})
    assert args.env == 'CartPole-v1' and args.seed == 0
