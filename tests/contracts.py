"""A check shared by the contract tests (not a test module itself)."""

import chex
import jax


def assert_contracts_trace_to_nothing(function, *args):
    """The traced program is the same with chex's assertions on and off: the
    contracts cost nothing once compiled."""
    with_contracts = str(jax.make_jaxpr(function)(*args))
    chex.disable_asserts()
    try:
        without = str(jax.make_jaxpr(function)(*args))
    finally:
        chex.enable_asserts()
    assert with_contracts == without
