"""README.md's commands work: every `python dqn.py|pg.py|actor_critic.py ...`
line of its code blocks runs and exits 0 (or 2 where the line is marked
`exits 2`); its "Use from Python" block runs (with 2 epochs) and prints one
line per run. The lines naming one --output-dir run in order, in one fresh
working directory, as one test (a later one resumes or refuses the run an
earlier one made); every other line, which writes no run, is its own test in
its own fresh working directory, so the lines spread over the workers.

To keep this fast, a line that creates a run gets small sizes appended (the
ones tests/test_reliability.py uses, fewer DQN gradient steps) and `--epochs 2`; a line that resumes a
run (its --output-dir holds one) is run as typed except that `--epochs N`
becomes `--epochs 3`, so it still extends the run it resumes. Every line uses
the session's compile cache.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

from test_reliability import ROOT, SMALL, cache_dir  # noqa: F401  (cache_dir: the fixture)

COMMAND = re.compile(r'(?:^|[\s/])python ((?:dqn|pg|actor_critic)\.py\b[^#\n]*?)'
                     r'(?:\s*(?:#.*|&&.*|\|.*|;.*))?$')
EXIT_2 = '# exits 2'
PROCESSES = re.compile(r'--(?:distributed|coordinator-address)\b')
# test_reliability's small sizes, with DQN's epochs short (those are long there so a kill lands).
SIZES = {algo: list(flags) for algo, flags in SMALL.items()}
SIZES['dqn'][SIZES['dqn'].index('--train-steps-per-epoch') + 1] = '16'
SIZES.setdefault('actor_critic', ['--n-envs', '4', '--n-interactions-per-epoch', '64',
                                  '--batch-size', '16', '--value-batch-size', '16',
                                  '--train-steps-per-epoch', '4',
                                  '--value-train-steps-per-epoch', '4', '--n-eval-episodes', '2',
                                  '--eval-steps', '40', '--hidden-sizes', '16'])


def readme_commands():
    """(script, argv, expected status) for each command line of README's code blocks."""
    commands, in_block = [], False
    for line in open(os.path.join(ROOT, 'README.md')):
        if line.lstrip().startswith('```'):
            in_block = not in_block
            continue
        match = COMMAND.search(line) if in_block else None
        if match and not PROCESSES.search(line):  # several processes: test_distributed.py
            script, *argv = shlex.split(match.group(1))
            commands.append((script, argv, 2 if EXIT_2 in line else 0))
    return commands


def test_the_usage_block_runs_in_the_venv_the_set_up_makes():
    """The set-up commands make .venv and never activate it; the Usage
    block's `python` and `tensorboard` are that venv's: it activates it first."""
    text = open(os.path.join(ROOT, 'README.md')).read()
    setup = text[text.index('## Set-up on a fresh machine'):text.index('## Usage')]
    assert setup.count('python3 -m venv .venv && .venv/bin/pip install -r requirements.lock') == 2
    usage = text[text.index('## Usage'):]
    block = usage[usage.index('```bash\n') + len('```bash\n'):]
    first = block.splitlines()[0]
    assert first.split('#')[0].strip() == 'source .venv/bin/activate', first
    tensorboard = os.path.join(os.path.dirname(sys.executable), 'tensorboard')
    assert os.path.exists(tensorboard)  # the lock installs the viewer the block runs


def holds_run(cwd, argv):
    if '--output-dir' not in argv:
        return False
    path = os.path.join(cwd, argv[argv.index('--output-dir') + 1])
    return os.path.exists(os.path.join(path, 'checkpoint.npz'))


def small(script, argv, cwd):
    argv = list(argv)
    resuming = holds_run(cwd, argv)
    if '--epochs' in argv:
        argv[argv.index('--epochs') + 1] = '3' if resuming else '2'
    elif not resuming:
        argv += ['--epochs', '2']
    if not resuming:
        sizes = SIZES[script[:-3]]
        if '--joint' in argv:  # the value trainer's own flags act without --joint only
            sizes = [flag for i, flag in enumerate(sizes) if not flag.startswith('--value-')
                     and not (i and sizes[i - 1].startswith('--value-'))]
        argv += sizes
    return argv


def test_readme_has_the_commands_this_test_runs():
    commands = readme_commands()
    scripts = [script for script, _, _ in commands]
    assert {'dqn.py', 'pg.py', 'actor_critic.py'} <= set(scripts)
    assert any(status == 2 for _, _, status in commands)
    resumes = [argv for script, argv, _ in commands if argv[:2] == ['--output-dir', 'runs/breakout']]
    assert ['--output-dir', 'runs/breakout', '--epochs', '200'] in resumes
    assert ['--output-dir', 'runs/breakout', '--only-eval'] in resumes


def output_dir(argv):
    return argv[argv.index('--output-dir') + 1] if '--output-dir' in argv else None


def command_chains():
    """README's commands, in order, as chains: all the lines naming one
    --output-dir (in README's order), or one line naming none."""
    chains = {}
    for index, (script, argv, status) in enumerate(readme_commands()):
        chains.setdefault(output_dir(argv) or index, []).append((index, script, argv, status))
    return list(chains.values())


def chain_id(chain):
    index, script, argv, _ = chain[0]
    return f'cmd{index:02d}-{script[:-3]}' + (f'+{len(chain) - 1}' if len(chain) > 1 else '')


def test_the_chains_hold_every_command_once_in_order():
    chains = command_chains()
    assert sorted(i for chain in chains for i, *_ in chain) == list(range(len(readme_commands())))
    assert all([i for i, *_ in chain] == sorted(i for i, *_ in chain) for chain in chains)
    breakout = [chain for chain in chains if output_dir(chain[0][2]) == 'runs/breakout']
    assert len(breakout) == 1 and len(breakout[0]) == 4, breakout


@pytest.mark.parametrize('chain', command_chains(), ids=chain_id)
def test_readme_commands_run(chain, cache_dir, tmp_path):  # noqa: F811
    for _, script, argv, status in chain:
        argv = small(script, argv, str(tmp_path))
        command = [sys.executable, os.path.join(ROOT, script), '--quiet',
                   '--compile-cache', cache_dir, *argv]
        result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path,
                                timeout=300)
        assert result.returncode == status, (shlex.join([script, *argv]), result.stderr[-2000:])
        if status == 2:
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    if output_dir(chain[0][2]) == 'runs/breakout':
        breakout = tmp_path / 'runs' / 'breakout'
        assert (breakout / 'eval.jsonl').exists()
        assert sorted(os.listdir(breakout / 'tb')) == ['seed=0']
        assert '"epochs": 3' in open(breakout / 'summary.json').read()


def python_block():
    text = open(os.path.join(ROOT, 'README.md')).read()
    blocks = re.findall(r'```python\n(.*?)```', text, re.S)
    assert len(blocks) == 1, 'the README has one python block, under "Use from Python"'
    return blocks[0]


def test_readme_python_block_runs():
    code = python_block()
    assert 'common.run_sweep' in code and re.search(r'epochs=\d+', code)
    code = re.sub(r'epochs=\d+', 'epochs=2', code)
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 16, lines
    seeds_lrs = [tuple(line.split()[:2]) for line in lines]
    assert seeds_lrs == [(str(seed), lr) for lr in ('0.01', '0.003') for seed in range(8)]
    assert all(float(line.split()[2]) > 0 for line in lines)


if __name__ == '__main__':
    for script, argv, status in readme_commands():
        print(status, script, shlex.join(argv))
    pytest.main([__file__, '-q'])
