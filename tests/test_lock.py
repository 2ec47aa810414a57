"""requirements.lock, requirements.txt and the running environment agree, and
the README's set-up and .ci/run install from the lock."""

import importlib.metadata
import os
import re

import pytest

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


# --- the lock tool (issue 53, item 7) ---------------------------------------

import lock as lock_tool  # noqa: E402


def test_a_pin_listed_twice_is_an_error_that_says_so(tmp_path):
    path = tmp_path / 'requirements.txt'
    path.write_text('jax==0.10.2\nnumpy==2.0.0\nJAX==0.10.1\n')
    with pytest.raises(ValueError, match=r'JAX is pinned twice \(0.10.2 and 0.10.1\)'):
        pins(str(path))


def test_without_a_package_index_the_tool_says_so_in_one_line_and_keeps_the_lock(
        tmp_path, monkeypatch):
    lock, requirements = tmp_path / 'requirements.lock', tmp_path / 'requirements.txt'
    lock.write_text('# header\nsix==1.16.0\n')
    requirements.write_text('six==1.16.0\n')
    monkeypatch.setenv('PIP_NO_INDEX', '1')  # and no pip config: nothing to install from
    monkeypatch.setenv('PIP_CONFIG_FILE', os.devnull)
    with pytest.raises(SystemExit) as stop:
        lock_tool.main(str(lock), str(requirements))
    message = str(stop.value.code)
    assert message.startswith('lock.py: pip install failed: ') and '\n' not in message
    assert 'requirements.lock is unchanged' in message
    assert lock.read_text() == '# header\nsix==1.16.0\n'
    assert sorted(os.listdir(tmp_path)) == ['requirements.lock', 'requirements.txt']


def test_the_lock_keeps_its_other_pins_and_is_written_whole(tmp_path, monkeypatch, capsys):
    lock, requirements = tmp_path / 'requirements.lock', tmp_path / 'requirements.txt'
    lock.write_text('# header\na==1\nb==2\n')
    requirements.write_text('a==1\n')
    asked = []

    def freeze(path, kept):  # the constraints pip is given: every pin but the direct ones
        asked.append(kept)
        return None if kept else 'a==1\nb==3\n'  # b==2 conflicts: re-resolved without
    monkeypatch.setattr(lock_tool, 'freeze', freeze)
    lock_tool.main(str(lock), str(requirements))
    assert asked == [{'b': '2'}, {}]
    error = capsys.readouterr().err
    assert 're-resolved' in error and 'b 2 -> 3' in error
    assert lock.read_text() == '# header\na==1\nb==3\n'  # header kept, the file replaced whole
    assert sorted(os.listdir(tmp_path)) == ['requirements.lock', 'requirements.txt']
