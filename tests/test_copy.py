"""Copy an algorithm and run it (issue 36): `cp dqn.py common.py fields.py`
into an empty folder, then `python dqn.py ...` runs there without harness/
(pg.py and actor_critic.py take policies.py too), says in one line what harness/
adds, and writes a metrics.jsonl bitwise the repo's command line's for the
same flags (timings aside); bad input is refused there with the command
line's message, exit 2.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = {'dqn': ['dqn.py', 'common.py', 'fields.py'],
         'pg': ['pg.py', 'common.py', 'fields.py', 'policies.py'],
         'actor_critic': ['actor_critic.py', 'common.py', 'fields.py', 'policies.py']}
# Small runs: 2 seeds x a 2-point grid (the grid's runs in the CLI's order).
FLAGS = {
    'dqn': ['--n-envs', '4', '--n-interactions-per-epoch', '64', '--train-steps-per-epoch', '16',
            '--batch-size', '32', '--n-replay-epochs', '2', '--hidden-sizes', '16',
            '--n-eval-episodes', '2', '--eval-steps', '40', '--epochs', '3'],
    'pg': ['--n-trajectories-per-epoch', '4', '--max-steps', '40', '--n-eval-episodes', '2',
           '--hidden-sizes', '16', '--epochs', '3', '--no-normalize-advantages'],
    'actor_critic': ['--policy-loss', 'a2c', '--n-envs', '4', '--n-interactions-per-epoch',
                     '64', '--train-steps-per-epoch', '2', '--value-batch-size', '16',
                     '--value-train-steps-per-epoch', '4', '--n-eval-episodes', '2',
                     '--eval-steps', '40', '--hidden-sizes', '16', '--epochs', '3'],
}
RUNS = ['--num-seeds', '2', '--seed', '3', '--lr', '1e-2,3e-3']
TIMING = ('timing/', 'rl/n_interactions_per_second')


def environment():
    return {name: value for name, value in os.environ.items() if name != 'PYTHONPATH'}


def records(path):
    with open(path) as f:
        return [{key: value for key, value in json.loads(line).items()
                 if not key.startswith(TIMING)} for line in f]


def copied(algo, folder):
    for name in FILES[algo]:
        shutil.copy(os.path.join(ROOT, name), folder / name)
    return folder


@pytest.mark.parametrize('algo', sorted(FILES))
def test_the_copied_files_run_with_the_command_lines_numbers(algo, tmp_path):
    os.mkdir(tmp_path / 'copy')
    folder = copied(algo, tmp_path / 'copy')
    argv = [*FLAGS[algo], *RUNS]
    plain = subprocess.run([sys.executable, f'{algo}.py', *argv, '--output-dir', 'out'],
                           cwd=folder, env=environment(), capture_output=True, text=True,
                           timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert set(os.listdir(folder)) - {'__pycache__'} == {*FILES[algo], 'out'}
    note = [line for line in plain.stderr.splitlines() if 'harness/' in line]
    assert len(note) == 1 and all(word in note[0] for word in (
        'checkpoints', 'resume', 'TensorBoard', 'processes')), plain.stderr
    lines = plain.stdout.splitlines()
    assert any(line.startswith('epoch 3/3 | return ') for line in lines), plain.stdout

    repo = subprocess.run([sys.executable, os.path.join(ROOT, f'{algo}.py'), *argv,
                           '--output-dir', str(tmp_path / 'repo'), '--quiet',
                           '--no-tensorboard', '--compile-cache', 'none'],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert repo.returncode == 0, repo.stderr[-3000:]
    want = records(tmp_path / 'repo' / 'metrics.jsonl')
    assert records(folder / 'out' / 'metrics.jsonl') == want
    assert len(want) == 3 * 4 and {record['lr'] for record in want} == {1e-2, 3e-3}
    # Provenance: config.json and summary.json with the CLI's keys and values
    # (harness/'s checkpoint_every aside, and the times), and the same final
    # figures per grid point in both final lines.
    for name, aside in (('config.json', {'checkpoint_every'}),
                        ('summary.json', {'wall_s', 'compile_s'})):
        copy, cli = (json.load(open(path / name)) for path in (folder / 'out', tmp_path / 'repo'))
        assert copy == {key: value for key, value in cli.items() if key not in aside} | {
            key: copy[key] for key in aside & set(copy)}, name
    points = json.load(open(folder / 'out' / 'summary.json'))['points']
    assert [point['lr'] for point in points] == [1e-2, 3e-3]
    assert all(point['seeds'] == 2 and point['worst'] <= point['mean'] for point in points)
    assert lines[-3].startswith('done: 4 run(s), final greedy return by grid point below, ')
    assert lines[-2].startswith('  --lr 0.01: mean ') and lines[-1].startswith('  --lr 0.003: ')
    quiet = repo.stdout.splitlines()  # --quiet: the one line, every point in it
    assert len(quiet) == 1 and quiet[0].startswith(
        f'done: 4 run(s), final greedy return by grid point: {lines[-2][2:]}; {lines[-1][2:]}, ')


@pytest.mark.parametrize('argv', [['--lr', '1e300'], ['--conv-channels', '8'],
                                  ['--gamma', '1'], ['--epochs', '2.5'],
                                  ['--eval-steps', '100000']])
def test_the_copy_refuses_with_the_command_lines_message(argv, tmp_path):
    folder = copied('dqn', tmp_path)
    plain = subprocess.run([sys.executable, 'dqn.py', *argv], cwd=folder, env=environment(),
                           capture_output=True, text=True, timeout=300)
    repo = subprocess.run([sys.executable, os.path.join(ROOT, 'dqn.py'), *argv,
                           '--output-dir', str(tmp_path / 'repo')],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert plain.returncode == repo.returncode == 2, (plain.stderr, repo.stderr)
    assert plain.stderr.startswith('dqn.py: error: ')
    assert repo.stderr == plain.stderr and len(plain.stderr.splitlines()) == 1
    assert not os.path.exists(tmp_path / 'repo') and not os.path.exists(folder / 'runs')


def test_the_copy_drops_an_env_setting_the_typed_flags_make_inert(tmp_path):
    """MetaMaze-misc's actor_critic settings tune a GRU (--max-slice-length 200);
    with `--torso mlp` typed, both command lines leave that setting out (it
    cannot act) and run the rest, with the same numbers."""
    folder = copied('actor_critic', tmp_path)
    argv = ['--env', 'MetaMaze-misc', '--torso', 'mlp', '--epochs', '1', '--n-envs', '4',
            '--n-interactions-per-epoch', '64', '--batch-size', '16', '--value-batch-size',
            '16', '--train-steps-per-epoch', '2', '--value-train-steps-per-epoch', '2',
            '--n-eval-episodes', '2', '--eval-steps', '20', '--hidden-sizes', '16']
    plain = subprocess.run([sys.executable, 'actor_critic.py', *argv, '--output-dir', 'out'],
                           cwd=folder, env=environment(), capture_output=True, text=True,
                           timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "not applied (inert with the flags given): {'max_slice_length': 200}" in plain.stdout
    repo = subprocess.run([sys.executable, os.path.join(ROOT, 'actor_critic.py'), *argv,
                           '--output-dir', str(tmp_path / 'repo'), '--no-tensorboard',
                           '--compile-cache', 'none'],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert repo.returncode == 0, repo.stderr[-3000:]
    assert 'not applied: --max-slice-length 200' in repo.stdout + repo.stderr
    assert records(folder / 'out' / 'metrics.jsonl') == records(
        tmp_path / 'repo' / 'metrics.jsonl')
