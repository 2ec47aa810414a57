"""README.md's commands work: every `python dqn.py ...` / `python pg.py ...` line
of its code blocks runs, in order, in one fresh working directory, and exits 0
(or 2 where the line is marked `exits 2`).

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

COMMAND = re.compile(r'(?:^|[\s/])python ((?:dqn|pg)\.py\b[^#\n]*?)(?:\s*(?:#.*|&&.*|\|.*|;.*))?$')
EXIT_2 = '# exits 2'
# test_reliability's small sizes, with DQN's epochs short (those are long there so a kill lands).
SIZES = {algo: list(flags) for algo, flags in SMALL.items()}
SIZES['dqn'][SIZES['dqn'].index('--train-steps-per-epoch') + 1] = '16'


def readme_commands():
    """(script, argv, expected status) for each command line of README's code blocks."""
    commands, in_block = [], False
    for line in open(os.path.join(ROOT, 'README.md')):
        if line.lstrip().startswith('```'):
            in_block = not in_block
            continue
        match = COMMAND.search(line) if in_block else None
        if match:
            script, *argv = shlex.split(match.group(1))
            commands.append((script, argv, 2 if EXIT_2 in line else 0))
    return commands


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
        argv += SIZES[script[:-3]]
    return argv


def test_readme_has_the_commands_this_test_runs():
    commands = readme_commands()
    scripts = [script for script, _, _ in commands]
    assert 'dqn.py' in scripts and 'pg.py' in scripts
    assert any(status == 2 for _, _, status in commands)
    resumes = [argv for script, argv, _ in commands if argv[:2] == ['--output-dir', 'runs/breakout']]
    assert ['--output-dir', 'runs/breakout', '--epochs', '200'] in resumes
    assert ['--output-dir', 'runs/breakout', '--only-eval'] in resumes


def test_readme_commands_run(cache_dir, tmp_path):  # noqa: F811
    for script, argv, status in readme_commands():
        argv = small(script, argv, str(tmp_path))
        command = [sys.executable, os.path.join(ROOT, script), '--quiet',
                   '--compile-cache', cache_dir, *argv]
        result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path,
                                timeout=300)
        assert result.returncode == status, (shlex.join([script, *argv]), result.stderr[-2000:])
        if status == 2:
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    breakout = tmp_path / 'runs' / 'breakout'
    assert (breakout / 'eval.jsonl').exists()
    assert sorted(os.listdir(breakout / 'tb')) == ['seed=0']
    assert '"epochs": 3' in open(breakout / 'summary.json').read()


if __name__ == '__main__':
    for script, argv, status in readme_commands():
        print(status, script, shlex.join(argv))
    pytest.main([__file__, '-q'])
