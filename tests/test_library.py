"""Use from Python: an algorithm file plus common.py is the whole algorithm.

`import dqn` (or pg, actor_critic, common) does not import the harness;
copied alone into an empty folder with common.py, the file imports and runs a
seeds x grid sweep in one jit; and `common.run_sweep` gives bitwise the
numbers the command line writes to metrics.jsonl for the same seeds and
values.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402

ALGOS = [name for name in ('dqn', 'pg', 'actor_critic')
         if os.path.exists(os.path.join(ROOT, f'{name}.py'))]
IGNORED = ('timing/', 'rl/n_interactions_per_second')

# Small configs, as Config fields (library) and as the same flags (CLI).
SMALL = {
    'dqn': dict(n_envs=4, n_interactions_per_epoch=64, train_steps_per_epoch=32, batch_size=32,
                n_eval_episodes=2, eval_steps=(40,), n_replay_epochs=2, hidden_sizes=(16,),
                epochs=3),
    'pg': dict(n_trajectories_per_epoch=4, max_steps=40, n_eval_episodes=2, hidden_sizes=(16,),
               epochs=3),
    'actor_critic': dict(n_envs=4, n_interactions_per_epoch=64, batch_size=16,
                         value_batch_size=16, train_steps_per_epoch=4,
                         value_train_steps_per_epoch=4, n_eval_episodes=2, eval_steps=(40,),
                         hidden_sizes=(16,), epochs=3),
}
GRID = {'lr': [1e-2, 3e-3]}


def as_flags(fields):
    flags = []
    for name, value in fields.items():
        text = ','.join(map(str, value)) if isinstance(value, tuple) else str(value)
        flags += ['--' + name.replace('_', '-'), text]
    return flags


@pytest.mark.parametrize('algo', ALGOS)
def test_import_does_not_import_the_harness(algo):
    code = (f'import sys, {algo}, common; '
            "loaded = sorted(m for m in sys.modules if m == 'harness' or "
            "m.startswith('harness.')); print(loaded)")
    result = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '[]'


def test_algorithm_file_and_common_alone_run_a_sweep(tmp_path):
    """cp dqn.py common.py fields.py into an empty folder: import, then seeds x lr in one jit
    (and pg.py, actor_critic.py import there too, without the harness)."""
    for name in ('common.py', 'fields.py', 'policies.py', *(f'{algo}.py' for algo in ALGOS)):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    code = '\n'.join([
        f'import common, {", ".join(ALGOS)}',
        f'config = dqn.Config(**{SMALL["dqn"]!r})',
        f'runs, state, metrics = common.run_sweep(dqn.make_agent(config), config, num_seeds=2, '
        f'grid={GRID!r}, epochs=2)',
        "print(len(runs), metrics['rl/n_interactions'].shape, int(state.epoch.min()))",
    ])
    env = {name: value for name, value in os.environ.items() if name != 'PYTHONPATH'}
    result = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == '4 (2, 4) 2'


@pytest.mark.parametrize('algo', ALGOS)
def test_run_sweep_gives_the_command_lines_numbers(algo, tmp_path):
    import importlib
    module = importlib.import_module(algo)
    out = str(tmp_path / 'run')
    module.main([*as_flags(SMALL[algo]), '--lr', ','.join(map(str, GRID['lr'])),
                 '--num-seeds', '2', '--seed', '5', '--output-dir', out, '--quiet',
                 '--no-tensorboard', '--compile-cache', 'none'])
    records = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]

    # the command line's: CartPole-v1's settings (actor_critic's init), then the flags
    config = module.Config(**{**module.ENV_SETTINGS.get('CartPole-v1', {}), **SMALL[algo]})
    runs, state, metrics = common.run_sweep(module.make_agent(config), config, seed=5,
                                            num_seeds=2, grid=GRID)
    first = [record for record in records if record['epoch'] == 1]
    assert runs == [{key: record[key] for key in run} for run, record in zip(runs, first)]
    compared = 0
    for record in records:
        for name, value in record.items():
            if name in metrics and not name.startswith(IGNORED):
                got = float(np.asarray(metrics[name])[record['epoch'] - 1, record['run']])
                want = np.nan if value is None else value
                assert got == want or (np.isnan(got) and np.isnan(want)), (name, record)
                compared += 1
    assert compared >= 3 * 4 * 5
    assert np.asarray(state.epoch).tolist() == [3] * 4


# ---------------------------------------------------------------------------
# Python refuses what the command line refuses, with its message (issue 36
# item 4, issue 37 items 8 and 10): make_agent and run_sweep apply the same
# checks, before anything is compiled.
# ---------------------------------------------------------------------------

import dqn  # noqa: E402
import pg  # noqa: E402

# (module, Config fields, the same as flags, the message both give)
REFUSED = [
    (dqn, dict(gamma=1.0), ['--gamma', '1'], '--gamma 1 needs --no-scale-value-targets'),
    (dqn, dict(lr=1e300), ['--lr', '1e300'], '--lr must be finite, got inf (in float32'),
    (dqn, dict(gamma=0.99999999), ['--gamma', '0.99999999'], '--gamma 0.99999999 is 1'),
    (dqn, dict(conv_channels=(8,)), ['--conv-channels', '8'],
     '--conv-channels acts with the conv torso only'),
    (dqn, dict(advantage_estimator='td_lambda', max_slice_length=3),
     ['--advantage-estimator', 'td_lambda', '--max-slice-length', '3'],
     '--max-slice-length has no effect with --advantage-estimator td_lambda'),
    (dqn, dict(lr_schedule='linear_decay', lr=0.02), ['--lr-schedule', 'linear_decay', '--lr',
                                                      '0.02'], '--lr has no effect'),
    (pg, dict(init_log_std=-1.0), ['--init-log-std', '-1'], '--init-log-std acts on Box'),
    (pg, dict(conv_channels=(4,)), ['--conv-channels', '4'], '--conv-channels acts with'),
    (pg, dict(gru_size=8), ['--gru-size', '8'], '--gru-size acts with --torso gru only'),
]


@pytest.mark.parametrize('module,fields,flags,message', REFUSED,
                         ids=[' '.join(flags) for _, _, flags, _ in REFUSED])
def test_make_agent_refuses_what_the_command_line_refuses(module, fields, flags, message,
                                                          tmp_path):
    with pytest.raises(common.UsageError) as refused:
        module.make_agent(module.Config(**fields))
    assert message in str(refused.value)
    cli = subprocess.run([sys.executable, os.path.join(ROOT, f'{module.__name__}.py'), *flags,
                          '--output-dir', str(tmp_path / 'run')], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 2
    assert cli.stderr.strip() == f'{module.__name__}.py: error: {refused.value}'


@pytest.mark.parametrize('fields, needle', [
    (dict(epochs='50'), "--epochs must be int, got '50'"),
    (dict(hidden_sizes=64), '--hidden-sizes must be a tuple of int, got 64'),
    (dict(lr='0.01'), "--lr must be float, got '0.01'"),
    (dict(double_dqn=1), '--double-dqn must be bool, got 1'),
    (dict(eval_steps=[100]), '--eval-steps must be a tuple of int'),
    (dict(n_envs=2 ** 31), '--n-envs must be at most 2147483647 in size (int32)'),
    (dict(advantage_estimator='td'), '--advantage-estimator must be one of td_k, td_lambda'),
])
def test_a_wrong_type_or_value_names_the_field(fields, needle):
    with pytest.raises(common.UsageError, match=re.escape(needle)):
        dqn.make_agent(dqn.Config(**fields))


def test_run_sweep_refuses_a_bad_grid_and_another_configs_agent():
    config = dqn.Config(**SMALL['dqn'])
    agent = dqn.make_agent(config)
    for grid, needle in [({'lr': 0.01}, "grid['lr'] must be a non-empty list of values"),
                         ({'lr': []}, "grid['lr'] must be a non-empty list"),
                         ({'batch_size': [32, 64]}, 'are not sweepable'),
                         ({'gamma': [0.9, 1.0]}, '--gamma 1 needs --no-scale-value-targets'),
                         ({'lr': [1e-2, 1e300]}, '--lr 1e+300 is inf'),
                         ({'lr': [1e-2, '3e-3']}, "--lr must be float, got '3e-3'"),
                         ([('lr', [0.1])], 'grid must be a dict')]:
        with pytest.raises(common.UsageError, match=re.escape(needle)):
            common.run_sweep(agent, config, grid=grid)
    with pytest.raises(common.UsageError, match='not the one its agent was made from'):
        common.run_sweep(agent, dqn.Config(**{**SMALL['dqn'], 'gamma': 0.9}))


@pytest.mark.parametrize('kwargs,needle', [
    ({'seed': -1}, 'seed must be an int in [0, 2147483647], got -1'),
    ({'seed': 0.5}, 'seed must be an int'), ({'seed': True}, 'seed must be an int'),
    ({'num_seeds': 0}, 'num_seeds must be an int in [1, '), ({'num_seeds': -2}, 'num_seeds'),
    ({'epochs': 0}, 'epochs must be an int in [1, '), ({'epochs': -1}, 'epochs must be'),
    ({'epochs': 2 ** 31}, 'epochs must be'), ({'epochs': 2.0}, 'epochs must be an int'),
    ({'seed': 2 ** 31 - 2, 'num_seeds': 4}, 'seeds 2147483646..2147483649 pass 2147483647'),
    ({'batch_invariant': 'yes'}, "batch_invariant must be True or False, got 'yes'"),
    ({'epochs': 3}, 'epochs 3 is past the learning rate\'s linear decay, which reaches 0 at '
                    'epoch 2')])
def test_run_sweep_checks_its_own_arguments(kwargs, needle):
    """Each is a UsageError naming the argument, before anything is traced (issue
    53, item 4): never a JAX or numpy traceback, never an empty result."""
    config = dqn.Config(**{**SMALL['dqn'], 'epochs': 2})
    with pytest.raises(common.UsageError, match=re.escape(f'run_sweep: {needle}')):
        common.run_sweep(dqn.make_agent(config), config, **kwargs)
