"""Contract tests for common.py (rlax style).

Every advantage estimator is checked against a plain-numpy loop reference
written here straight from the formulas of docs/trax.md section 4 (no code
from common.py is used in the references), against the values Trax 1.4.1
computed, and with and without jit, vmapped (chex.variants). Their chex
contracts: a wrong-shaped call fails naming the argument, and adds nothing
to the traced program. Then remaining_evals (docs/trax.md section 3),
schedules, make_env, the MLP and conv torso (the harness's checkpoints
and flags: test_harness.py).
"""

import functools
import re
import subprocess
import sys
from pathlib import Path

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
from contracts import assert_contracts_trace_to_nothing  # noqa: E402

BATCH, LENGTH = 3, 7
RTOL, ATOL = 1e-5, 1e-5


def assert_trees_bitwise_equal(got, want):
    """chex.assert_trees_all_equal (structure, shapes, dtypes and values), then
    the bytes: exact equality still counts -0.0 as 0.0 and any NaN as any other."""
    chex.assert_trees_all_equal(got, want, strict=True)
    chex.assert_trees_all_equal_comparator(
        lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
        lambda a, b: f'equal values, different bytes: {a!r} vs {b!r}', got, want)


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
# 1b. The associative_scan form of td_lambda and gae (chosen on GPU/TPU).
# ---------------------------------------------------------------------------

LAMBDA_ESTIMATORS = {'td_lambda': ref_td_lambda, 'gae': ref_gae}


def test_reverse_affine_scan_by_hand():
    # x_t = a_t x_{t+1} + b_t from the end. Row 0: 4; .5 * 4 + 1 = 3; 2 * 3 - 1 = 5.
    # Row 1: a 0 cuts the future (an episode's end): 2; 3 * 2 + 1 = 7; 0 * 7 + 7 = 7.
    a = np.array([[2.0, 0.5, 0.0], [0.0, 3.0, 0.0]], np.float32)
    b = np.array([[-1.0, 1.0, 4.0], [7.0, 1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(np.asarray(common.reverse_affine_scan(a, b)),
                                  [[5, 3, 4], [7, 7, 2]])


@pytest.mark.parametrize('gamma,lambda_,margin', [(0.99, 0.95, 0), (0.9, 0.0, 1), (1.0, 1.0, 3)])
@pytest.mark.parametrize('name', LAMBDA_ESTIMATORS)
def test_associative_scan_matches_reference_and_sequential(name, gamma, lambda_, margin):
    inputs = random_inputs(800 + margin, batch=16, length=33)  # dones and discount masks
    make = functools.partial(getattr(common, name), gamma, margin, lambda_)
    got = np.asarray(jax.jit(make(scan='associative'))(*inputs))
    assert got.shape == (16, 33 - margin)
    np.testing.assert_allclose(got, LAMBDA_ESTIMATORS[name](gamma, margin, lambda_, *inputs),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got, np.asarray(jax.jit(make(scan='sequential'))(*inputs)),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('name', LAMBDA_ESTIMATORS)
def test_associative_scan_batched_as_the_callers_do(name):
    """As actor_critic's whole_row_advantages and dqn's slice_targets call them:
    one [1, T + 1] row per env, vmapped over envs, inside a vmap over runs with
    traced gamma and lambda (truncations reach the estimators as a done plus a
    bootstrap in the reward, and steps past the row as discount_mask 0)."""
    inputs = random_inputs(900, batch=1, length=129, lead=(64,))

    def advantages(scan):
        def per_run(gamma, lambda_):
            return jax.vmap(getattr(common, name)(gamma, 0, lambda_, scan=scan))(*inputs)
        return np.asarray(jax.jit(jax.vmap(per_run))(SWEEP_GAMMAS, SWEEP_LAMBDAS))

    got = advantages('associative')
    assert got.shape == (len(SWEEP_GAMMAS), 64, 1, 129)
    np.testing.assert_allclose(got, advantages('sequential'), rtol=RTOL, atol=ATOL)


def test_scan_auto_keeps_the_sequential_form_on_cpu(monkeypatch):
    inputs = random_inputs(5)
    for make in (common.td_lambda, common.gae):
        assert_trees_bitwise_equal(jax.jit(make(0.9, 1, 0.8))(*inputs),
                                   jax.jit(make(0.9, 1, 0.8, scan='sequential'))(*inputs))
    want = 'sequential' if jax.default_backend() == 'cpu' else 'associative'
    assert common.resolve_scan('auto') == want
    monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
    assert common.resolve_scan('auto') == 'associative'
    with pytest.raises(ValueError, match='scan must be one of'):
        common.gae(0.9, 0, scan='parallel')


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
                            (common.gae(gamma, margin, 0.95), tdl),
                            (common.td_lambda(gamma, margin, 0.95, scan='associative'), tdl),
                            (common.gae(gamma, margin, 0.95, scan='associative'), tdl)]:
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
    for scan in ('sequential', 'associative'):
        np.testing.assert_allclose(np.asarray(common.gae(0.9, 0, scan=scan)(*args)),
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
                      common.gae(0.0, 1), common.td_lambda(0.0, 1, scan='associative'),
                      common.gae(0.0, 1, scan='associative')):
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
    ('td_lambda_associative', lambda: common.td_lambda(0.9, 1, 0.8, scan='associative'),
     functools.partial(ref_td_lambda, 0.9, 1, 0.8), 1),
    ('gae_associative', lambda: common.gae(0.99, 3, 0.95, scan='associative'),
     functools.partial(ref_gae, 0.99, 3, 0.95), 3),
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


def test_conv_in_chunks_is_the_whole_batch_bitwise():
    """A batch past CONV_CHUNK observations (not a multiple of it) goes through
    the conv layers chunk by chunk: every row as the whole batch gives it, bit
    for bit, vmapped over runs too; the gradient matches the reference."""
    obs_shape = (6, 5, 2)
    n = common.CONV_CHUNK * 2 + 37
    params = common.init_network(jax.random.PRNGKey(0), obs_shape, (8,), 2, 'conv',
                                 conv_channels=(4,))
    runs = jax.tree.map(lambda leaf: jnp.stack([leaf, 1.5 * leaf + 0.01]), params)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, n) + obs_shape)

    def whole(p, obs):  # conv_layers on the batch in one piece, then the MLP
        features = common.conv_layers(p['conv'], obs).reshape(obs.shape[0], -1)
        return common.mlp(p['mlp'], features)
    got = jax.jit(jax.vmap(lambda p, obs: common.network(p, obs, obs_shape)))(runs, x)
    want = jax.jit(jax.vmap(whole))(runs, x)
    assert got.shape == (2, n, 2)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    grads = jax.grad(lambda p: jnp.sum(jnp.sin(common.network(p, x[0], obs_shape))))(params)
    expected = jax.grad(lambda p: jnp.sum(jnp.sin(reference_conv_network(p, x[0]))))(params)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


def numpy_layer_norm(x, scale, offset):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + 1e-6) * scale + offset


def test_layer_norm_mlp_and_conv_against_numpy():
    """--layer-norm: a LayerNorm (flax's epsilon 1e-6) over the features before
    each hidden ReLU, conv (over channels) and dense; none on the output.
    Without it the params are init_mlp's plain ones, bitwise."""
    rng = np.random.default_rng(0)
    params = common.init_network(jax.random.PRNGKey(0), (4,), (8, 6), 3, layer_norm=True)
    plain = common.init_network(jax.random.PRNGKey(0), (4,), (8, 6), 3)
    assert_trees_bitwise_equal([{'w': l['w'], 'b': l['b']} for l in params], plain)
    assert [sorted(layer) for layer in params] == [['b', 'offset', 'scale', 'w']] * 2 + [['b', 'w']]
    np.testing.assert_array_equal(params[0]['scale'], 1.0)
    np.testing.assert_array_equal(params[0]['offset'], 0.0)
    params = jax.tree.map(lambda leaf: leaf + 0.3 * jnp.asarray(rng.normal(size=leaf.shape),
                                                                leaf.dtype), params)
    x = rng.normal(size=(5, 4))
    h = x
    for layer in params[:-1]:
        layer = {k: np.asarray(v, np.float64) for k, v in layer.items()}
        h = np.maximum(numpy_layer_norm(h @ layer['w'] + layer['b'], layer['scale'],
                                        layer['offset']), 0.0)
    want = h @ np.asarray(params[-1]['w'], np.float64) + np.asarray(params[-1]['b'], np.float64)
    got = common.network(params, jnp.asarray(x, jnp.float32), (4,))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # Scale and offset carry the output: the plain net's differs.
    assert not np.allclose(common.network([{'w': l['w'], 'b': l['b']} for l in params],
                                          jnp.asarray(x, jnp.float32), (4,)), want, atol=1e-3)

    obs_shape = (5, 4, 2)
    conv_params = common.init_network(jax.random.PRNGKey(1), obs_shape, (6,), 3, 'conv',
                                      conv_channels=(4,), layer_norm=True)
    assert sorted(conv_params['conv'][0]) == ['b', 'offset', 'scale', 'w']
    conv_params = jax.tree.map(lambda leaf: leaf + 0.3 * jnp.asarray(
        rng.normal(size=leaf.shape), leaf.dtype), conv_params)
    images = jax.random.normal(jax.random.PRNGKey(2), (7,) + obs_shape)
    layer = conv_params['conv'][0]
    kernel = jnp.transpose(layer['w'], (3, 2, 0, 1))
    h = jax.lax.conv(jnp.transpose(images, (0, 3, 1, 2)), kernel, (1, 1), 'VALID')
    h = np.asarray(jnp.transpose(h, (0, 2, 3, 1)), np.float64) + np.asarray(layer['b'])
    h = np.maximum(numpy_layer_norm(h, np.asarray(layer['scale']), np.asarray(layer['offset'])),
                   0.0).reshape(7, -1)  # over each cell's channels
    head = [{k: np.asarray(v, np.float64) for k, v in l.items()} for l in conv_params['mlp']]
    h = np.maximum(numpy_layer_norm(h @ head[0]['w'] + head[0]['b'], head[0]['scale'],
                                    head[0]['offset']), 0.0)
    np.testing.assert_allclose(common.network(conv_params, images, obs_shape),
                               h @ head[1]['w'] + head[1]['b'], rtol=1e-4, atol=1e-4)


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

