"""Rebuild requirements.lock from requirements.txt (not collected by pytest).

    python3 tests/lock.py

Installs requirements.txt into a fresh venv made by this Python (use 3.11 on
x86-64 Linux, the platform the lock is for) and writes that venv's
`pip freeze --all` (pip itself excluded) under the lock's header comment,
atomically. The lock's transitive pins are kept (given to pip as
constraints) unless the direct requirements need others: then it re-resolves
and says which pins moved. A failure (no package index, a conflict) is one
line on stderr, exit status 1, the lock untouched. tests/test_lock.py reads
the files through pins().
"""

import itertools
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(ROOT, 'requirements.lock')
REQUIREMENTS = os.path.join(ROOT, 'requirements.txt')
PIN = re.compile(r'([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)')


def normalise(name):
    """PEP 503: case and runs of -_. do not matter."""
    return re.sub(r'[-_.]+', '-', name).lower()


def pins(path):
    """{normalised name: version} of a requirements file, every line
    `name==version`, each name once."""
    result = {}
    for line in open(path):
        line = line.split('#', 1)[0].strip()
        if line:
            match = PIN.fullmatch(line)
            if not match:
                raise ValueError(f'{os.path.basename(path)}: {line!r} is not name==version')
            name = normalise(match.group(1))
            if name in result:
                raise ValueError(f'{os.path.basename(path)}: {match.group(1)} is pinned twice '
                                 f'({result[name]} and {match.group(2)}); keep one line')
            result[name] = match.group(2)
    return result


def pip(venv, *args):
    """The venv's pip, quiet; CalledProcessError carrying its last error line."""
    done = subprocess.run([os.path.join(venv, 'bin', 'pip'), *args], capture_output=True,
                          text=True)
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()
                 and not line.startswith('WARNING')] or ['(no message)']
        raise subprocess.CalledProcessError(done.returncode, 'pip ' + args[0],
                                            stderr=lines[-1].strip())
    return done.stdout


def freeze(requirements, kept):
    """pip freeze of a fresh venv with `requirements` installed, the `kept`
    pins ({name: version}) as constraints; None where they conflict."""
    with tempfile.TemporaryDirectory() as folder:
        venv = os.path.join(folder, 'venv')
        subprocess.run([sys.executable, '-m', 'venv', venv], check=True, capture_output=True)
        constraints = os.path.join(folder, 'constraints.txt')
        with open(constraints, 'w') as f:
            f.write(''.join(f'{name}=={version}\n' for name, version in kept.items()))
        try:
            pip(venv, 'install', '--quiet', '-r', requirements, '-c', constraints)
        except subprocess.CalledProcessError as error:
            if not kept or 'conflict' not in (error.stderr or '').lower() and \
                    'ResolutionImpossible' not in (error.stderr or ''):
                raise
            return None
        return pip(venv, 'freeze', '--all', '--exclude', 'pip')


def refresh(lock=LOCK, requirements=REQUIREMENTS):
    with open(lock) as f:
        header = ''.join(itertools.takewhile(lambda line: line.startswith('#'), f))
    direct, before = pins(requirements), pins(lock)
    kept = {name: version for name, version in before.items() if name not in direct}
    frozen = freeze(requirements, kept)
    if frozen is None:  # the direct requirements need other transitive pins
        frozen = freeze(requirements, {})
        after = pins_of(frozen)
        moved = sorted(f'{name} {before[name]} -> {after[name]}' for name in kept
                       if name in after and after[name] != before[name])
        print(f'lock.py: re-resolved (requirements.txt needs other pins): '
              f'{", ".join(moved) or "none moved"}', file=sys.stderr)
    tmp = f'{lock}.tmp-{os.getpid()}'
    with open(tmp, 'w') as f:
        f.write(header + frozen)
    os.replace(tmp, lock)


def pins_of(text):
    return {normalise(name): version for name, version in PIN.findall(text)}


def main(lock=LOCK, requirements=REQUIREMENTS):
    try:
        refresh(lock, requirements)
    except (OSError, ValueError) as error:
        sys.exit(f'lock.py: {error}; requirements.lock is unchanged')
    except subprocess.CalledProcessError as error:
        sys.exit(f'lock.py: {error.cmd} failed: {error.stderr or error}; requirements.lock '
                 'is unchanged (no package index reachable? pip config?)')


if __name__ == '__main__':
    main()
