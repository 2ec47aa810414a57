"""Use from Python: an algorithm file plus common.py is the whole algorithm.

`import dqn` (or pg, actor_critic, common) does not import the harness;
copied alone into an empty folder with common.py, the file imports and runs a
seeds x grid sweep in one jit; and `common.run_sweep` gives bitwise the
numbers the command line writes to metrics.jsonl for the same seeds and
values.
"""

import json
import os
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
    """cp dqn.py common.py into an empty folder: import, then seeds x lr in one jit
    (and pg.py, actor_critic.py import there too, without the harness)."""
    for name in ('common.py', 'policies.py', *(f'{algo}.py' for algo in ALGOS)):
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

    config = module.Config(**SMALL[algo])
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
