"""requirements.lock, requirements.txt and the running environment agree, and
the README's set-up and .ci/run install from the lock."""

import importlib.metadata
import os
import re

from lock import LOCK, REQUIREMENTS, ROOT, normalise, pins

REFRESH = 'refresh the lock: python3 tests/lock.py, then pip install -r requirements.lock'
# The venv's installer and wheel builder, which the lock leaves to the venv.
TOOLING = {'pip', 'wheel'}
# What the README's GPU line (pip install jax[cuda12]==...) adds on top of the CPU lock.
GPU = re.compile(r'jax-cuda\d+-(plugin|pjrt)|nvidia-.+-cu\d+')


def installed():
    return {normalise(dist.metadata['Name']): dist.version
            for dist in importlib.metadata.distributions()}


def test_every_pin_is_installed_at_its_version():
    have = installed()
    for name, version in pins(LOCK).items():
        assert have.get(name) == version, (
            f'{name}: requirements.lock pins {version}, this environment has '
            f'{have.get(name, "none")}: pip install -r requirements.lock, or {REFRESH}')


def test_requirements_are_pinned_in_the_lock():
    lock = pins(LOCK)
    for name, version in pins(REQUIREMENTS).items():
        assert lock.get(name) == version, (
            f'{name}: requirements.txt pins {version}, requirements.lock '
            f'{lock.get(name, "nothing")}; {REFRESH}')


def test_nothing_installed_is_unpinned():
    lock = pins(LOCK)
    for name, version in installed().items():
        assert name in lock or name in TOOLING or GPU.fullmatch(name), (
            f'{name}=={version} is installed but not in requirements.lock: {REFRESH} '
            f'(a new direct requirement goes in requirements.txt first), or uninstall it')


def test_set_up_installs_the_lock():
    for path in ('README.md', os.path.join('.ci', 'run')):
        text = open(os.path.join(ROOT, path)).read()
        files = re.findall(r'pip"? install\b[^\n&]*?-r (\S+)', text)
        assert files and set(files) == {'requirements.lock'}, (
            f'{path} installs {files or "nothing"}: README.md and .ci/run install requirements.lock')
