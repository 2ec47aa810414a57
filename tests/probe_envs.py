"""Probe environments shared by the agents' tests (not a test module itself).

ImageSignProbe is the observation-dependent-reward probe with an image
observation: a 5x5x2 grid with one lit cell, in channel 0 (reward +1) or in
channel 1 (reward -1), at a random place; the episode ends after one step,
whatever the action. So Q(s, a) = +1 or -1 by the lit channel, and an agent
learns it only if its torso (conv for rank-3 observations) reads channels at
every position. ImageChannelProbe shows the same images and pays +1 for the
action that names the lit channel, -1 for the other: the policy's probe.
"""

import gymnax
import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import environment, spaces

IMAGE_SHAPE = (5, 5, 2)
IMAGE_PROBE = 'ImageSignProbe-test'


@struct.dataclass
class ImageState(environment.EnvState):
    time: int
    cell: int  # which of the 5 * 5 cells is lit
    sign: float  # +1: channel 0 is lit, -1: channel 1


@struct.dataclass
class ImageParams(environment.EnvParams):
    max_steps_in_episode: int = 100


def image_observation(cell, sign):
    """The 5x5x2 grid with `cell` lit in channel 0 (sign +1) or 1 (sign -1)."""
    height, width, _ = IMAGE_SHAPE
    channel = jnp.where(sign > 0, 0, 1)
    return jnp.zeros(IMAGE_SHAPE, jnp.float32).at[cell // width, cell % width, channel].set(1.0)


class ImageSignProbe(environment.Environment):
    @property
    def default_params(self):
        return ImageParams()

    def reset_env(self, key, params):
        cell_key, sign_key = jax.random.split(key)
        cell = jax.random.randint(cell_key, (), 0, IMAGE_SHAPE[0] * IMAGE_SHAPE[1])
        sign = jnp.where(jax.random.bernoulli(sign_key), 1.0, -1.0)
        state = ImageState(time=0, cell=cell, sign=sign)
        return self.get_obs(state), state

    def step_env(self, key, state, action, params):
        reward = state.sign
        state = state.replace(time=state.time + 1)
        return self.get_obs(state), state, jnp.asarray(reward, jnp.float32), jnp.asarray(True), {}

    def get_obs(self, state, params=None, key=None):
        return image_observation(state.cell, state.sign)

    def is_terminated(self, state, params):
        return jnp.asarray(True)

    @property
    def name(self):
        return 'ImageSignProbe'

    @property
    def num_actions(self):
        return 2

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params):
        return spaces.Box(0.0, 1.0, IMAGE_SHAPE, jnp.float32)


class ImageChannelProbe(ImageSignProbe):
    """The same observations; the action must name the lit channel: action 0
    for channel 0, 1 for channel 1 pays +1, the other -1. A policy learns it
    only if its torso reads the channels at every position."""

    def step_env(self, key, state, action, params):
        reward = jnp.where(action == jnp.where(state.sign > 0, 0, 1), 1.0, -1.0)
        state = state.replace(time=state.time + 1)
        return self.get_obs(state), state, reward.astype(jnp.float32), jnp.asarray(True), {}


IMAGE_CHANNEL_PROBE = 'ImageChannelProbe-test'


# ---------------------------------------------------------------------------
# The memory probe: a cue (+1 or -1) shown on the first step only, then
# CUE_DELAY blank steps, then a query step whose action must name the cue
# (action 0 for +1, 1 for -1): +1 if it does, -1 if not, and the episode
# ends. Observations are [cue, query flag]. A memoryless policy sees the
# same query observation whatever the cue: its expected return is 0; one
# that remembers the cue gets +1.
# ---------------------------------------------------------------------------

CUE_PROBE = 'CueProbe-test'
CUE_DELAY = 3


@struct.dataclass
class CueState(environment.EnvState):
    time: int
    cue: float


class CueProbe(ImageSignProbe):  # its two actions and params; all else its own
    def reset_env(self, key, params):
        state = CueState(time=0, cue=jnp.where(jax.random.bernoulli(key), 1.0, -1.0))
        return self.get_obs(state), state

    def step_env(self, key, state, action, params):
        query = state.time == CUE_DELAY + 1
        named = jnp.where(action == 0, 1.0, -1.0)
        reward = jnp.where(query, jnp.where(named == state.cue, 1.0, -1.0), 0.0)
        state = state.replace(time=state.time + 1)
        return (self.get_obs(state), state, reward.astype(jnp.float32), query, {})

    def get_obs(self, state, params=None, key=None):
        return jnp.asarray([jnp.where(state.time == 0, state.cue, 0.0),
                            jnp.where(state.time == CUE_DELAY + 1, 1.0, 0.0)], jnp.float32)

    def is_terminated(self, state, params):
        return state.time > CUE_DELAY + 1

    @property
    def name(self):
        return 'CueProbe'

    def observation_space(self, params):
        return spaces.Box(-1.0, 1.0, (2,), jnp.float32)


def register():
    for name, factory in ((IMAGE_PROBE, ImageSignProbe),
                          (IMAGE_CHANNEL_PROBE, ImageChannelProbe), (CUE_PROBE, CueProbe)):
        if name not in gymnax.registered_envs:
            gymnax.register(name, factory)
