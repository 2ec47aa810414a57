"""The policies of pg.py and actor_critic.py over gymnax envs: Categorical for
Discrete actions, Gaussian for Box ones (a learned state-independent log std,
or gSDE's state-dependent noise), the recurrent (GRU) torso, and their
rollouts and evaluation. DQN needs none of it: `cp dqn.py common.py fields.py` is
DQN alone; pg.py and actor_critic.py take this file too.
"""

import functools
import math
import typing

import chex
import jax
import jax.numpy as jnp
import numpy as np

import common

# The policies' torsos add the recurrent one to common.TORSOS.
TORSOS = common.TORSOS + ('gru',)


def feature_torso(torso, obs_shape):
    """The torso under a GRU: conv for rank-3 observations, else mlp."""
    return common.resolve_torso('auto', obs_shape) if torso == 'gru' else torso


def init_network(key, obs_shape, hidden_sizes, n_outputs, torso='mlp', conv_channels=(16,),
                 last_scale=1.0, gru_size=0, init='glorot'):
    """common.init_network's params, or for torso 'gru': {'base': that network
    (conv or flatten by the observations' rank) whose last layer is the GRU's
    input weights [.., 3 * gru_size], 'gru': the recurrent weights, 'head':
    the linear layer on its state}; `init` 'orthogonal': orthogonal()'s weights."""
    if init == 'orthogonal':
        glorot_key, key = jax.random.split(key)
        return orthogonal(key, init_network(glorot_key, obs_shape, hidden_sizes, n_outputs,
                                            torso, conv_channels, last_scale, gru_size),
                          last_scale)
    if torso != 'gru':
        return common.init_network(key, obs_shape, hidden_sizes, n_outputs, torso,
                                   conv_channels, last_scale)
    base_key, gru_key, head_key = jax.random.split(key, 3)
    return {'base': common.init_network(base_key, obs_shape, hidden_sizes, 3 * gru_size,
                                        feature_torso(torso, obs_shape), conv_channels),
            'gru': init_gru(gru_key, gru_size),
            'head': common.init_mlp(head_key, [gru_size, n_outputs], last_scale)}


def orthogonal(key, params, head_gain):
    """--init orthogonal (PureJaxRL's PPO, after CleanRL's): every weight of
    init_network's `params` (a conv's as [k * k * in, out]) drawn orthogonal
    with gain sqrt(2), the head's (the last layer's) with `head_gain`; biases
    stay zero and the GRU's recurrent weights Glorot-uniform."""
    head = (params['head'] if is_recurrent(params) else params['mlp'] if isinstance(
        params, dict) and 'conv' in params else params)[-1]['w']
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)

    def draw(key, path, leaf):
        if getattr(path[-1], 'key', None) != 'w':
            return leaf
        gain = head_gain if leaf is head else math.sqrt(2.0)
        shape = (int(np.prod(leaf.shape[:-1])), leaf.shape[-1])
        return jax.nn.initializers.orthogonal(gain)(key, shape).reshape(leaf.shape)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [draw(k, path, leaf) for k, (path, leaf)
                                                  in zip(keys, leaves)])


def is_recurrent(params):
    return isinstance(params, dict) and 'gru' in params


def network_head(params, features):
    """The network's last (linear) layer on its features (a recurrent
    network's: on its GRU state)."""
    if is_recurrent(params):
        return flat_matmul(features, params['head'][-1]['w']) + params['head'][-1]['b']
    last = (params['mlp'] if isinstance(params, dict) and 'conv' in params else params)[-1]
    return common.dense(features, last['w']) + last['b']


def flat_matmul(x, weights):
    """x [..., n] @ weights [n, m] as one [N, n] matmul: a sequence's [B, L, n]
    as is rounds its gradient differently for one run than for several in a
    vmapped grid on XLA CPU; flattened, a run's numbers stay its own."""
    return common.dense(x.reshape(-1, x.shape[-1]), weights).reshape(x.shape[:-1] + (-1,))


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


def gru_inputs(params, obs, obs_shape, activation='relu'):
    """A recurrent network's input projections of observations [..., *obs_shape]
    -> [..., 3H]: every step's at once, outside the recurrence."""
    return common.network(params['base'], obs, obs_shape, activation)


def recurrent_features(params, obs, obs_shape, hidden, reset, activation='relu'):
    """A recurrent network over sequences: obs [B, L, *obs_shape] from the
    states `hidden` [B, H] at their first steps; after a step with `reset`
    [B, L] (its episode ended there, or it is not a step of one) the state is
    zeros again. -> (the state after each step, before its reset [B, L, H]:
    what the head reads; the state after the last step, reset applied)."""
    inputs = gru_inputs(params, obs, obs_shape, activation)

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
    activation: str  # the hidden layers' (common.ACTIVATIONS)
    init: str  # the weights' (common.init_mlp): 'glorot' or 'orthogonal'


def policy_spec(config):
    """The PolicySpec of a config's env, torso and policy fields."""
    env, env_params = common.make_env(config.env, config.max_steps)
    space, obs_space = env.action_space(env_params), env.observation_space(env_params)
    kind = common.space_kind(space)
    obs_shape = tuple(obs_space.shape)
    torso = common.resolve_torso(config.torso, obs_shape, TORSOS)
    if feature_torso(torso, obs_shape) == 'conv':
        common.conv_output_shape(obs_shape, config.conv_channels)  # refuses too small
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
    flat_size = int(np.prod(common.conv_output_shape(obs_shape, config.conv_channels)
                            if torso == 'conv' else obs_shape))
    latent_size = gru_size or (config.hidden_sizes[-1] if config.hidden_sizes else flat_size)
    return PolicySpec(
        env=env, env_params=env_params, max_steps=common.env_max_steps(env_params),
        obs_shape=obs_shape, obs_dtype=jax.eval_shape(
            lambda k: env.reset(k, env_params)[0], jax.random.PRNGKey(0)).dtype,
        obs_bounds=(observation_bounds(obs_space, obs_shape)
                    if config.normalize_observations else None),
        kind=kind, action_shape=action_shape, n_outputs=n_outputs, action_bounds=action_bounds,
        sde=config.state_dependent_exploration and kind == 'box',
        sde_sample_freq=config.sde_sample_freq, torso=torso,
        conv_channels=config.conv_channels, hidden_sizes=config.hidden_sizes,
        latent_size=latent_size, gru_size=gru_size, activation=config.activation,
        init=config.init)


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
        return recurrent_features(net, x, spec.obs_shape, *memory, spec.activation)[0]
    return common.mlp_hidden(*common.torso(net, x, spec.obs_shape, spec.activation),
                             spec.activation)


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
                                  gru_size=spec.gru_size, init=spec.init)}
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
                              gru_inputs(net, observe(spec, obs), spec.obs_shape,
                                         spec.activation))
               for name, net in nets.items()}
    action, env_action = act(spec, noise, params, obs, temperature, stepped.get('policy'))
    step = (functools.partial(common.step_first_episode, spec.env) if one_episode
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
    for tag_key, (temperature, horizon) in zip(jax.random.split(common.evaluation_key(state),
                                                                len(eval_tags)),
                                               eval_tags):
        reset_key, rollout_key = jax.random.split(tag_key)
        obs, env_state = env_reset(spec, reset_key, n_episodes)
        _, rec = rollout(spec, rollout_key, state.params, obs, env_state, jnp.zeros(n_episodes),
                         horizon, temperature, True)
        metrics[common.return_tag(temperature, horizon)] = jnp.sum(
            rec['reward'] * rec['valid'], axis=0).mean()
    return state, metrics




def inert_fields(config, spec):
    """{field: why it cannot act} of the Box-only policy fields on discrete
    actions (fields.check_inert); what acts in which mode is each field's
    acts_with."""
    if spec.kind == 'box':
        return {}
    return dict.fromkeys(
        ('state_dependent_exploration', 'init_log_std', 'sde_sample_freq'),
        f'acts on Box (continuous) actions only; {config.env} has discrete actions')
