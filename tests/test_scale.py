"""Sweeps at scale: hyperparameter grids as one vmapped program, sharding the
runs axis over devices, and the learning-curve plot."""

import itertools
import json
import os
import subprocess
import sys

import chex
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
from harness import flags  # noqa: E402
from harness import rundir  # noqa: E402
import dqn  # noqa: E402

TINY = ['--n-envs', '4', '--n-interactions-per-epoch', '64', '--train-steps-per-epoch', '32',
        '--batch-size', '32', '--n-eval-episodes', '2', '--eval-steps', '40',
        '--n-replay-epochs', '2', '--hidden-sizes', '16', '--epochs', '2', '--quiet']
IGNORED = ('timing/', 'rl/n_interactions_per_second')
# The conv torso on MinAtar's 10x10x4 grids (--torso auto picks it there).
CONV_TINY = [*TINY, '--env', 'Breakout-MinAtar', '--conv-channels', '4', '--eval-steps', '20']


def results(out):
    records = [{k: v for k, v in json.loads(line).items() if not k.startswith(IGNORED)}
               for line in open(os.path.join(out, 'metrics.jsonl'))]
    header, leaves = rundir._read_checkpoint(os.path.join(out, 'checkpoint.npz'))
    return records, header['paths'], leaves


def assert_same_runs(records_a, leaves_a, records_b, leaves_b):
    """Bitwise equal metrics and checkpointed state (common.compiler_options
    keeps XLA CPU from choosing kernels by the number of runs). The leaves are
    compared by chex: number, shapes, dtypes (strict) and exact values, and a
    failure names the leaf (exact, not bytes: -0.0 equals 0.0, NaN equals NaN,
    the determinism tests do not need more)."""
    assert len(records_a) == len(records_b)
    for a, b in zip(records_a, records_b):
        assert a == b
    chex.assert_trees_all_equal(list(leaves_a), list(leaves_b), strict=True)


def assert_grid_equals_separate_runs(main, flags, grid_out, tmp_path):
    """Rerun every run of the grid in grid_out alone (its seed and swept values
    as flags) and compare it, bitwise, with its slice of the grid; -> records."""
    records, paths, leaves = results(grid_out)
    summary = json.load(open(os.path.join(grid_out, 'summary.json')))
    for index, run in enumerate(summary['runs']):
        out = str(tmp_path / f'run{index}')
        values = [part for name, value in run.items()
                  for part in ('--' + name.replace('_', '-'), str(value))]
        main([*flags, '--output-dir', out, *values])
        single_records, single_paths, single_leaves = results(out)
        mine = [{k: v for k, v in r.items() if k != 'run'} for r in records if r['run'] == index]
        theirs = [{k: v for k, v in r.items() if k != 'run'} for r in single_records]
        assert single_paths == paths
        assert_same_runs(mine, [leaf[index] for leaf in leaves], theirs,
                         [leaf[0] for leaf in single_leaves])
    return records


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('xla_cache'))


def test_grid_parsing_and_runs_axis():
    parser = flags.build_parser(dqn.Config, 'dqn.py', '')
    args = parser.parse_args(['--lr', '1e-2,3e-3', '--gamma', '0.99,0.9', '--num-seeds', '2'])
    config, grid = flags.config_and_grid(dqn.Config, args)
    assert grid == {'lr': [1e-2, 3e-3], 'gamma': [0.99, 0.9]}
    runs = common.expand_runs(config, grid, args.seed, args.num_seeds)
    assert [(r['lr'], r['gamma'], r['seed']) for r in runs] == [
        (1e-2, 0.99, 0), (1e-2, 0.99, 1), (1e-2, 0.9, 0), (1e-2, 0.9, 1),
        (3e-3, 0.99, 0), (3e-3, 0.99, 1), (3e-3, 0.9, 0), (3e-3, 0.9, 1)]
    hp = common.hyperparameters(config, runs)
    np.testing.assert_allclose(hp['gamma'], [0.99, 0.99, 0.9, 0.9] * 2, rtol=1e-6)
    assert hp['sync_freq'].shape == (8,)
    # Shape-changing fields refuse a list.
    with pytest.raises(SystemExit) as error:
        parser.parse_args(['--batch-size', '32,64'])
    assert error.value.code == 2
    with pytest.raises(SystemExit):
        parser.parse_args(['--max-slice-length', '2,3'])


def test_grid_equals_the_separate_runs(cache_dir, tmp_path):
    """A 2 x 2 grid x 2 seeds in one program = the 8 runs one by one, bitwise."""
    grid_out = str(tmp_path / 'grid')
    dqn.main([*TINY, '--compile-cache', cache_dir, '--output-dir', grid_out,
              '--lr', '1e-2,3e-3', '--gamma', '0.99,0.9', '--num-seeds', '2'])
    summary = json.load(open(os.path.join(grid_out, 'summary.json')))
    assert len(summary['runs']) == 8 and len(summary['final_eval_return']) == 8
    assert {(r['lr'], r['gamma'], r['seed']) for r in summary['runs']} == {
        (lr, gamma, seed) for lr in (1e-2, 3e-3) for gamma in (0.99, 0.9) for seed in (0, 1)}
    records = assert_grid_equals_separate_runs(
        dqn.main, [*TINY, '--compile-cache', cache_dir], grid_out, tmp_path)
    # And the runs really differ from one another.
    returns = [r['metrics/value_loss'] for r in records if r['epoch'] == 2]
    assert len(set(returns)) == 8


def test_conv_grid_equals_the_separate_runs(cache_dir, tmp_path):
    """The conv torso too: a 2-point lr grid x 2 seeds = the 4 runs alone, bitwise."""
    grid_out = str(tmp_path / 'grid')
    dqn.main([*CONV_TINY, '--compile-cache', cache_dir, '--output-dir', grid_out,
              '--lr', '1e-2,3e-3', '--num-seeds', '2'])
    header, _ = rundir._read_checkpoint(os.path.join(grid_out, 'checkpoint.npz'))
    assert any("['conv']" in path for path in header['paths'])
    records = assert_grid_equals_separate_runs(
        dqn.main, [*CONV_TINY, '--compile-cache', cache_dir], grid_out, tmp_path)
    assert len({r['metrics/value_loss'] for r in records if r['epoch'] == 2}) == 4


def test_sharded_over_four_devices_matches_one_device(cache_dir, tmp_path):
    """The runs axis sharded over 4 (forced host) devices = all runs on one device,
    bitwise."""
    env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4')
    outs = {}
    for name, extra in (('sharded', []), ('single', ['--device', '0'])):
        outs[name] = str(tmp_path / name)
        command = [sys.executable, os.path.join(ROOT, 'dqn.py'), *TINY, '--compile-cache',
                   cache_dir, '--num-seeds', '8', '--output-dir', outs[name], *extra]
        result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT,
                                timeout=300)
        assert result.returncode == 0, result.stderr
    probe = subprocess.run(
        [sys.executable, '-c', 'import jax; print(len(jax.devices()))'], env=env,
        capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == '4'
    sharded, single = results(outs['sharded']), results(outs['single'])
    assert sharded[1] == single[1]
    assert_same_runs(sharded[0], sharded[2], single[0], single[2])


def test_cpu_devices_two_matches_one_device(cache_dir, tmp_path):
    """--cpu-devices 2: 4 runs split over two CPU devices, each computing the
    one-device program on its 2 runs; seeds 0-1 are bitwise those of the same
    2 seeds run on one device (which loads that program from the cache). PPO
    --joint on PureJaxRL's CartPole shapes, where the SPMD-partitioned
    program (shard_map) differed from one device from epoch 2."""
    outs = {}
    for name, extra in (('two', ['--cpu-devices', '2', '--num-seeds', '4']),
                        ('one', ['--num-seeds', '2'])):
        outs[name] = str(tmp_path / name)
        command = [sys.executable, os.path.join(ROOT, 'actor_critic.py'), '--joint',
                   '--n-envs', '4', '--n-interactions-per-epoch', '512', '--epochs', '3',
                   '--train-steps-per-epoch', '16', '--batch-size', '128',
                   '--value-loss-coeff', '0.5', '--max-grad-norm', '0.5', '--lambda', '0.95',
                   '--advantage-estimator', 'gae', '--added-policy-slice-length', '128',
                   '--scale-value-targets', '--quiet', '--compile-cache', cache_dir,
                   '--output-dir', outs[name], *extra]
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert result.returncode == 0, result.stderr
    two, one = results(outs['two']), results(outs['one'])
    header, _ = rundir._read_checkpoint(os.path.join(outs['two'], 'checkpoint.npz'))
    assert header['metadata']['devices'] == 2
    assert two[1] == one[1]
    assert_same_runs([r for r in two[0] if r['run'] < 2], [leaf[:2] for leaf in two[2]],
                     one[0], one[2])
    assert any(not np.array_equal(leaf[:2], leaf[2:]) for leaf in two[2])  # runs differ


def test_plot_writes_a_png(cache_dir, tmp_path):
    out = str(tmp_path / 'plot')
    dqn.main([*TINY, '--compile-cache', cache_dir, '--output-dir', out, '--num-seeds', '2',
              '--plot'])
    path = os.path.join(out, 'learning_curve.png')
    data = open(path, 'rb').read()
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 5000


PG_TINY = ['--n-trajectories-per-epoch', '4', '--max-steps', '40', '--n-eval-episodes', '2',
           '--hidden-sizes', '16', '--epochs', '2', '--quiet']


def test_pg_grid_equals_the_separate_runs(cache_dir, tmp_path):
    """pg's sweep fields too: a 2-point entropy x 2-point lr grid = the 4 runs."""
    import pg
    grid_out = str(tmp_path / 'grid')
    pg.main([*PG_TINY, '--compile-cache', cache_dir, '--output-dir', grid_out,
             '--entropy-coeff', '0,0.1', '--lr', '1e-2,3e-2'])
    summary = json.load(open(os.path.join(grid_out, 'summary.json')))
    # Outer to inner in the order of the fields in --help (lr before entropy).
    assert [(r['lr'], r['entropy_coeff']) for r in summary['runs']] == [
        (1e-2, 0.0), (1e-2, 0.1), (3e-2, 0.0), (3e-2, 0.1)]
    records = assert_grid_equals_separate_runs(
        pg.main, [*PG_TINY, '--compile-cache', cache_dir], grid_out, tmp_path)
    # Same seed everywhere, so only the hyperparameters make the runs differ
    # (the losses alone may not: entropy's gradient is ~0 at a uniform policy).
    _, paths, leaves = results(grid_out)
    params = [leaf for path, leaf in zip(paths, leaves) if path.startswith('.params')]
    for a, b in itertools.combinations(range(4), 2):
        assert any(not np.array_equal(leaf[a], leaf[b]) for leaf in params), (a, b)
    assert len(records) == 2 * 4


def test_pg_gru_grid_equals_the_separate_runs(cache_dir, tmp_path):
    """REINFORCE with the recurrent torso, episodes carried over epochs (the
    GRU states in the state, the waiting tail rerun from its first step)."""
    import pg
    flags = ['--n-trajectories-per-epoch', 'none', '--n-envs', '4',
             '--n-interactions-per-epoch', '64', '--max-steps', '40', '--torso', 'gru',
             '--gru-size', '8', '--hidden-sizes', '16', '--n-eval-episodes', '2', '--epochs', '3',
             '--quiet', '--compile-cache', cache_dir]
    grid_out = str(tmp_path / 'grid')
    pg.main([*flags, '--output-dir', grid_out, '--lr', '1e-2,3e-2', '--num-seeds', '2'])
    records = assert_grid_equals_separate_runs(pg.main, flags, grid_out, tmp_path)
    assert len({r['metrics/policy_loss'] for r in records if r['epoch'] == 3}) == 4


# PPO (actor_critic.py) in n_interactions mode, tiny: with the conv torso on MinAtar, and with
# gSDE (observations normalised) on MountainCarContinuous.
PG_PPO_TINY = ['--policy-loss', 'ppo', '--advantage-estimator', 'gae',
               '--n-trajectories-per-epoch', 'none', '--n-envs', '4',
               '--n-interactions-per-epoch', '64', '--batch-size', '16', '--value-batch-size', '16',
               '--train-steps-per-epoch', '4', '--value-train-steps-per-epoch', '4',
               '--hidden-sizes', '16', '--n-eval-episodes', '2', '--eval-steps', '20',
               '--epochs', '2', '--quiet']


@pytest.mark.parametrize('flags, leaf', [
    (['--env', 'Breakout-MinAtar', '--conv-channels', '4'], "['conv']"),
    (['--env', 'MountainCarContinuous-v0', '--state-dependent-exploration',
      '--sde-sample-freq', '8', '--normalize-observations'], "['log_std']"),
    # AWR: 3 epochs into a replay of 2, so the ring wraps.
    (['--policy-loss', 'awr', '--n-replay-epochs', '2', '--epochs', '3'], '.replay.'),
    # The recurrent torso: sequences of 4 of the rows' 16 steps, states stored.
    (['--torso', 'gru', '--gru-size', '8', '--max-slice-length', '4'], "['gru']"),
])
def test_pg_ppo_conv_and_gsde_grids_equal_the_separate_runs(flags, leaf, cache_dir, tmp_path):
    """PPO (actor_critic.py) with the conv torso, and with gSDE, and AWR with
    its replay: a 2-point lr grid x 2 seeds = the 4 runs alone, bitwise."""
    import actor_critic
    grid_out = str(tmp_path / 'grid')
    actor_critic.main([*PG_PPO_TINY, *flags, '--compile-cache', cache_dir, '--output-dir',
                       grid_out, '--lr', '1e-2,3e-3', '--num-seeds', '2'])
    header, _ = rundir._read_checkpoint(os.path.join(grid_out, 'checkpoint.npz'))
    assert any(leaf in path for path in header['paths'])
    records = assert_grid_equals_separate_runs(
        actor_critic.main, [*PG_PPO_TINY, *flags, '--compile-cache', cache_dir], grid_out,
        tmp_path)
    assert len({r['metrics/policy_loss'] for r in records if r['epoch'] == 2}) == 4


def test_each_phase_is_traced_once_for_the_memory_estimate_and_the_chunk():
    """The driver's memory estimate, the chunk's metric shapes and the chunk
    share Agent.batched's jit, so each phase's Python runs once (a trace)."""
    import dataclasses
    import jax
    import jax.numpy as jnp
    from harness import devices
    config, grid = flags.config_and_grid(
        dqn.Config, flags.build_parser(dqn.Config, 'dqn', '').parse_args(TINY))
    agent = dqn.make_agent(config)
    calls = {'collect': 0, 'train': 0, 'evaluate': 0}

    def counted(name):
        def phase(hp, state):
            calls[name] += 1
            return getattr(agent, name)(hp, state)
        return phase
    counting = dataclasses.replace(agent, **{name: counted(name) for name in calls})
    assert counting.batched('learn') is counting.batched('learn')
    runs = common.expand_runs(config, grid, 0, 2)
    hp, keys = common.hyperparameters(config, runs), common.run_keys(runs)
    devices.memory_needed(counting, hp, keys)
    assert calls == {'collect': 1, 'train': 1, 'evaluate': 1}
    state = jax.eval_shape(counting.batched('init'), keys, hp)
    plan = [jnp.int32(value) for value in (0, 1, 2, 1)]
    jax.jit(lambda hp, state, *plan: common.run_epochs(counting, 2, hp, state, *plan)).lower(
        hp, state, *plan)
    assert calls == {'collect': 1, 'train': 1, 'evaluate': 1}


@pytest.mark.parametrize('algo', ['dqn', 'pg', 'actor_critic'])
def test_fused_epoch_equals_the_phases(algo):
    """Agent.epoch (collect -> train -> evaluate as one pure function), scanned
    over epochs in one jit program, gives the driver's phase-by-phase results."""
    import jax
    import jax.numpy as jnp
    import actor_critic
    import pg
    module = {'dqn': dqn, 'pg': pg, 'actor_critic': actor_critic}[algo]
    argv = {'dqn': TINY, 'pg': PG_TINY, 'actor_critic': PG_PPO_TINY}[algo]
    config, grid = flags.config_and_grid(
        module.Config, flags.build_parser(module.Config, algo, '').parse_args(argv))
    agent = module.make_agent(config)
    runs = common.expand_runs(config, grid, 0, 2)
    hp = common.hyperparameters(config, runs)
    keys = jnp.stack([jax.random.PRNGKey(run['seed']) for run in runs])
    options = common.compiler_options()
    state = jax.jit(jax.vmap(agent.init)).lower(keys, hp).compile(options)(keys, hp)

    phased_state, phased = state, []
    phases = [jax.jit(jax.vmap(getattr(agent, name))).lower(hp, state).compile(options)
              for name in ('collect', 'train', 'evaluate')]
    for _ in range(2):
        metrics = {}
        for phase in phases:
            phased_state, phase_metrics = phase(hp, phased_state)
            metrics.update(phase_metrics)
        phased.append(metrics)

    def epochs(hp, state):
        return jax.lax.scan(lambda s, _: jax.vmap(agent.epoch)(hp, s), state, None, length=2)
    fused_state, fused = jax.jit(epochs).lower(hp, state).compile(options)(hp, state)

    assert set(fused) == set(phased[0])
    chex.assert_trees_all_equal(fused, {name: np.stack([m[name] for m in phased])
                                        for name in fused}, strict=True)
    chex.assert_trees_all_equal(fused_state, phased_state, strict=True)
    assert int(fused_state.epoch[0]) == 2 and int(fused_state.train_step[0]) >= 2


@pytest.mark.parametrize('algo', ['dqn', 'pg', 'actor_critic'])
def test_chunks_and_the_evaluation_cadence_never_change_training(algo, cache_dir, tmp_path,
                                                                  monkeypatch):
    """One epoch per compiled call and evaluating every epoch, against all
    epochs in one call evaluating every 2nd and the last: the same training,
    bitwise (metrics and checkpoint), and the same figures where both evaluated."""
    import actor_critic
    import pg
    from harness import cli
    module = {'dqn': dqn, 'pg': pg, 'actor_critic': actor_critic}[algo]
    argv = {'dqn': TINY, 'pg': PG_TINY, 'actor_critic': PG_PPO_TINY}[algo]
    argv = [*argv, '--epochs', '5', '--num-seeds', '2', '--compile-cache', cache_dir]
    monkeypatch.setattr(cli, 'CHUNK_SECONDS', 0.0)  # every chunk one epoch
    module.main([*argv, '--eval-every', '1', '--output-dir', str(tmp_path / 'each')])
    monkeypatch.setattr(cli, 'CHUNK_SECONDS', 1e9)  # one epoch, then the other four at once
    module.main([*argv, '--eval-every', '2', '--output-dir', str(tmp_path / 'some')])
    each, _, each_leaves = results(str(tmp_path / 'each'))
    some, _, some_leaves = results(str(tmp_path / 'some'))
    chex.assert_trees_all_equal(list(each_leaves), list(some_leaves), strict=True)
    evaluated = {record['epoch'] for record in some
                 if any(name.startswith('rl/avg_return_temperature') for name in record)}
    assert evaluated == {2, 4, 5}
    assert len(each) == len(some) == 10
    for a, b in zip(each, some):
        assert {k: v for k, v in a.items() if k in b} == b
        assert (set(a) == set(b)) == (b['epoch'] in evaluated)
        assert all(name.startswith('rl/avg_return_temperature') for name in set(a) - set(b))
