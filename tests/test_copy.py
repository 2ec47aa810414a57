"""Copy an algorithm and run it (issue 36): `cp dqn.py common.py fields.py`
into an empty folder, then `python dqn.py ...` runs there without harness/
(pg.py and actor_critic.py take policies.py too), says in one line what harness/
adds, and writes a metrics.jsonl bitwise the repo's command line's for the
same flags (timings aside); bad input is refused there with the command
line's message, exit 2.
"""

import dataclasses
import json
import os
import shutil
import signal
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


sys.path.insert(0, ROOT)


def dqn_config():
    import dqn
    return dqn.Config


def fields_module():
    import fields
    return fields


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


# --- the copy's faults are one line, as the command line's (issue 53, item 3) --

LONG = [*FLAGS['dqn'][:-2], '--epochs', '100000', '--eval-every', '1']


def error_lines(stderr):
    """stderr without the copy's one note of what harness/ adds."""
    return [line for line in stderr.splitlines() if 'no harness/ here' not in line]


@pytest.mark.parametrize('argv,needle', [
    (['--quiet'], '--quiet is a flag of harness/, the full command line'),
    (['--no-tensorboard'], '--no-tensorboard is a flag of harness/'),
    (['--cpu-devices', '2'], '--cpu-devices is a flag of harness/'),
    (['--output-dir', 'a-file'], '--output-dir a-file: '),
    (['--output-dir', 'a-file/run'], 'is a file, not a folder')])
def test_the_copy_refuses_harness_flags_and_an_output_dir_it_cannot_use(argv, needle, tmp_path):
    folder = copied('dqn', tmp_path)
    (folder / 'a-file').write_text('')
    plain = subprocess.run([sys.executable, 'dqn.py', *argv], cwd=folder, env=environment(),
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2 and plain.stderr.count('\n') == 1, plain.stderr
    assert plain.stderr.startswith('dqn.py: error: ') and needle in plain.stderr, plain.stderr
    assert set(os.listdir(folder)) - {'__pycache__'} == {*FILES['dqn'], 'a-file'}


def test_the_copy_refuses_runs_that_cannot_fit_in_memory(tmp_path):
    """The replay of a million epochs: one line before compiling, nothing
    written (it hung or aborted with std::bad_alloc)."""
    folder = copied('actor_critic', tmp_path)
    plain = subprocess.run([sys.executable, 'actor_critic.py', '--policy-loss', 'awr',
                            '--n-replay-epochs', '1000000', '--output-dir', 'out'],
                           cwd=folder, env=environment(), capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 2 and plain.stderr.count('\n') == 1, plain.stderr
    assert 'GiB (their state x 2) but' in plain.stderr and 'lower --num-seeds' in plain.stderr
    assert not os.path.exists(folder / 'out')


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_copy_in_one_line(signum, tmp_path):
    """Started with SIGINT ignored, as a background job or a test worker that
    ran the command line in process passes it on: Ctrl-C still stops it."""
    folder = copied('dqn', tmp_path)
    process = subprocess.Popen([sys.executable, 'dqn.py', *LONG, '--output-dir', 'out'],
                               cwd=folder, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert process.stdout.readline().startswith('epoch ')  # running, past the compile
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    lines = error_lines(stderr)
    assert process.returncode == 128 + signum and len(lines) == 1, stderr
    assert lines[0].startswith(f'dqn.py: interrupted ({signal.Signals(signum).name}); ')
    assert (folder / 'out' / 'metrics.jsonl').stat().st_size > 0
    assert not [name for name in os.listdir(folder / 'out') if '.tmp-' in name]


def test_a_closed_stdout_stops_the_copy_in_one_line(tmp_path):
    folder = copied('dqn', tmp_path)
    process = subprocess.Popen([sys.executable, 'dqn.py', *LONG, '--output-dir', 'out'],
                               cwd=folder, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith('epoch ')
        process.stdout.close()  # as `| head -1` does
        stderr = process.stderr.read()
        process.wait(timeout=120)
    finally:
        process.kill()
    lines = error_lines(stderr)
    assert process.returncode == 1 and len(lines) == 1, stderr
    assert lines[0] == 'dqn.py: cannot write to stdout (a closed pipe); metrics.jsonl holds ' \
                       'the epochs done'


def test_a_projects_own_harness_package_leaves_the_copy_plain(tmp_path):
    folder = copied('dqn', tmp_path)
    os.mkdir(folder / 'harness')
    (folder / 'harness' / '__init__.py').write_text('"""the project\'s own"""\n')
    plain = subprocess.run([sys.executable, 'dqn.py', *FLAGS['dqn'], '--epochs', '1',
                            '--output-dir', 'out'], cwd=folder, env=environment(),
                           capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert (folder / 'out' / 'summary.json').exists()


def test_the_copys_harness_flags_are_the_harness_run_flags():
    from harness import flags as harness_flags
    parser = harness_flags.build_parser(dqn_config(), 'dqn.py', '')
    run_flags = {action.dest for action in parser._actions} - {
        field.name for field in dataclasses.fields(dqn_config())} - {'help'}
    assert run_flags - set(fields_module().RUN_FLAGS) == set(fields_module().HARNESS_FLAGS)
