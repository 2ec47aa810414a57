"""Rebuild requirements.lock from requirements.txt (not collected by pytest).

    python3 tests/lock.py

Installs requirements.txt into a fresh venv made by this Python (use 3.11 on
x86-64 Linux, the platform the lock is for) and writes that venv's
`pip freeze --all` (pip itself excluded) under the lock's header comment.
tests/test_lock.py reads the files through pins().
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
    """{normalised name: version} of a requirements file, every line `name==version`."""
    result = {}
    for line in open(path):
        line = line.split('#', 1)[0].strip()
        if line:
            match = PIN.fullmatch(line)
            if not match:
                raise ValueError(f'{os.path.basename(path)}: {line!r} is not name==version')
            result[normalise(match.group(1))] = match.group(2)
    return result


def refresh():
    with open(LOCK) as f:
        header = ''.join(itertools.takewhile(lambda line: line.startswith('#'), f))
    with tempfile.TemporaryDirectory() as venv:
        subprocess.run([sys.executable, '-m', 'venv', venv], check=True)
        pip = os.path.join(venv, 'bin', 'pip')
        subprocess.run([pip, 'install', '--quiet', '-r', REQUIREMENTS], check=True)
        freeze = subprocess.run([pip, 'freeze', '--all', '--exclude', 'pip'], check=True,
                                capture_output=True, text=True).stdout
    with open(LOCK, 'w') as f:
        f.write(header + freeze)


if __name__ == '__main__':
    refresh()
