"""Faults a long run meets, made real where the machine allows: values that
only break in float32, flags that cannot act, a damaged run directory, a full
disk (a small tmpfs), a closed pipe and a full device on stdout, signals at
awkward moments, one run per device, and the messages that name paths.

Each fault must end in one line on stderr, the right status and a directory
that resumes (or a refusal that says what is damaged); nothing recorded is
overwritten with less and no temp file is left behind.
"""

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import warnings

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import fields  # noqa: E402
import dqn  # noqa: E402
import pg  # noqa: E402
from harness import cli  # noqa: E402
from harness import flags  # noqa: E402
from harness import rundir  # noqa: E402

# tests/test_reliability.py's small DQN: a few tens of ms per epoch.
SMALL = ['--n-envs', '4', '--n-interactions-per-epoch', '64', '--train-steps-per-epoch', '64',
         '--batch-size', '32', '--n-eval-episodes', '2', '--eval-steps', '40',
         '--n-replay-epochs', '3', '--hidden-sizes', '16', '--checkpoint-every', '1',
         '--no-tensorboard', '--quiet']
IGNORED = ('timing/', 'rl/n_interactions_per_second')


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('xla_cache'))


def run_main(main, args, cache_dir, capsys, small=SMALL):
    """main(argv) in this process -> (status, stderr lines)."""
    capsys.readouterr()
    try:
        main([*small, '--compile-cache', cache_dir, *args])
        status = 0
    except SystemExit as stop:
        status = stop.code
    return status, capsys.readouterr().err.strip().splitlines()


def script(args, cache_dir, env=None, **kwargs):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, 'dqn.py'), *SMALL,
                             '--compile-cache', cache_dir, *args], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def one_line(lines, *needles):
    assert len(lines) == 1, lines
    assert 'Traceback' not in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def metrics(out):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(IGNORED)}
            for line in open(os.path.join(out, 'metrics.jsonl'))]


def temp_files(out):
    return [name for name in os.listdir(out) if rundir.TEMP_MARK in name]


def wait_for_lines(path, count, process, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= count:
            return
        time.sleep(0.005)
    assert process.poll() is None, 'the run ended before the fault could be made'


@contextlib.contextmanager
def tmpfs(path, size):
    """A tmpfs of `size` at `path` (root with CAP_SYS_ADMIN), or a skip."""
    os.makedirs(path)
    result = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', path],
                            capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f'cannot mount a tmpfs here ({result.stderr.strip()[:100]})')
    try:
        yield path
    finally:
        subprocess.run(['umount', '-l', path], capture_output=True)


# ---------------------------------------------------------------------------
# 1. Values as the program uses them; flags that cannot act
# ---------------------------------------------------------------------------

REFUSED = [
    (dqn, ['--epochs', 'inf'], 'expected int'),
    (dqn, ['--seed', '1e999'], 'expected int'),
    (dqn, ['--hidden-sizes', '8,inf'], 'expected int'),
    (dqn, ['--epochs', '1e999999999999'], 'expected int'),
    (dqn, ['--num-seeds', '2.5'], 'expected int'),
    (dqn, ['--gamma', '0.99999999'], '--gamma 0.99999999 is 1'),
    (dqn, ['--gamma', '0.9,0.99999999'], '--gamma 0.99999999 is 1'),
    (dqn, ['--lr', '1e300'], 'is inf'),
    (dqn, ['--lr', '1e-50'], 'is 0'),
    (dqn, ['--eval-temperatures', '0,1e39'], 'is inf'),
    (dqn, ['--lr-schedule', '*'], 'names no factor'),
    (dqn, ['--lr-schedule', 'linear_decay', '--lr', '0.02'], '--lr has no effect'),
    (dqn, ['--lr-schedule', 'constant', '--lr-decay-epochs', '5'], '--lr-decay-epochs has no'),
    (dqn, ['--eval-steps', '100000'], 'use at most 500'),
    (dqn, ['--n-eval-episodes', '0', '--eval-every', '2'], 'no evaluation'),
    (pg, ['--state-dependent-exploration'], 'discrete actions'),
    (pg, ['--init-log-std', '-1'], 'discrete actions'),
    (pg, ['--env', 'Pendulum-v1', '--sde-sample-freq', '4'], 'with --state-dependent'),
]


@pytest.mark.parametrize('module,args,needle', REFUSED,
                         ids=[' '.join(args) for _, args, _ in REFUSED])
def test_values_that_do_not_fit_or_cannot_act_are_one_line(module, args, needle, tmp_path,
                                                           capsys):
    out = str(tmp_path / 'run')
    status, err = run_main(module.main, [*args, '--output-dir', out], 'none', capsys,
                           small=SMALL if module is dqn else ['--quiet'])
    assert status == 2
    one_line(err, needle)
    assert not os.path.exists(out)


def test_ints_parse_exactly_and_float32_keeps_what_fits():
    parse = fields.value_type(int, name='--epochs')
    assert parse('1e3') == 1000 and parse('12') == 12 and parse('-0') == 0
    assert parse(str(2 ** 70)) == 2 ** 70  # exact, and check_fields bounds it (int32)
    checked = []
    config = dqn.Config(gamma=0.9999999)  # float32 0.99999988: < 1, accepted
    fields.check_grid(config, {}, lambda c, runs: checked.append(c.gamma))
    assert checked == [0.9999999, float(np.float32(0.9999999))] and checked[1] < 1


def test_a_flag_at_its_default_is_never_refused_as_unable_to_act():
    pg.make_agent(pg.Config(), given={'state_dependent_exploration', 'init_log_std'})


# ---------------------------------------------------------------------------
# 2. A damaged run directory: rebuilt from the checkpoint, or refused in one line
# ---------------------------------------------------------------------------


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory, cache_dir):
    """A finished 3-epoch run (every fault below damages a copy); the tests
    below run the same program (SMALL, one seed, 3 epochs) to share its compile."""
    out = str(tmp_path_factory.mktemp('finished') / 'run')
    result = subprocess.run([sys.executable, os.path.join(ROOT, 'dqn.py'), *SMALL,
                             '--compile-cache', cache_dir, '--epochs', '3',
                             '--output-dir', out], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out


def _drop_config_from_header(out):
    path = os.path.join(out, 'checkpoint.npz')
    arrays = dict(np.load(path))
    header = json.loads(bytes(arrays['header']).decode())
    del header['metadata']['config']
    arrays['header'] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    with open(path, 'wb') as f:
        np.savez(f, **arrays)


def _truncate(name, size):
    return lambda out: os.truncate(os.path.join(out, name), size)


DAMAGE = {  # name: (damage, status, needle of the one line)
    'metrics deleted': (lambda out: os.remove(os.path.join(out, 'metrics.jsonl')), 1,
                        'metrics.jsonl is missing'),
    'torn last line': (lambda out: os.truncate(os.path.join(out, 'metrics.jsonl'), os.path.getsize(
        os.path.join(out, 'metrics.jsonl')) - 30), 1, 'lacks the records of 1 of epochs 1-3'),
    'header without config': (_drop_config_from_header, 1, 'lacks the run\'s config'),
    'run.lock a directory': (lambda out: (os.remove(os.path.join(out, 'run.lock')),
                                          os.mkdir(os.path.join(out, 'run.lock'))), 2,
                             'remove it'),
    'both checkpoints damaged': (lambda out: (_truncate('checkpoint.npz', 100)(out),
                                              _truncate('checkpoint.prev.npz', 100)(out)), 1,
                                 'is damaged too'),
    'one checkpoint damaged': (_truncate('checkpoint.npz', 100), 1, '(epoch 2) is intact'),
    'checkpoints deleted': (lambda out: (os.remove(os.path.join(out, 'checkpoint.npz')),
                                         os.remove(os.path.join(out, 'checkpoint.prev.npz'))), 2,
                            'holds a finished run'),
}


@pytest.mark.parametrize('damage', DAMAGE)
def test_a_damaged_run_dir_is_refused_in_one_line_and_left_as_it_was(damage, finished_run,
                                                                     cache_dir, tmp_path, capsys):
    out = str(tmp_path / 'run')
    shutil.copytree(finished_run, out)
    harm, status, needle = DAMAGE[damage]
    harm(out)
    before = {name: open(os.path.join(out, name), 'rb').read() for name in os.listdir(out)
              if os.path.isfile(os.path.join(out, name)) and name != 'run.lock'}
    got, err = run_main(dqn.main, ['--output-dir', out], cache_dir, capsys)
    assert got == status
    one_line(err, needle)
    after = {name: open(os.path.join(out, name), 'rb').read() for name in before}
    assert after == before  # nothing recorded was overwritten (summary.json included)


REPAIRED = {
    'config.json deleted': lambda out: os.remove(os.path.join(out, 'config.json')),
    'config.json edited': lambda out: open(os.path.join(out, 'config.json'), 'w').write('{}'),
    'lines that are not records': lambda out: open(os.path.join(out, 'metrics.jsonl'), 'a').write(
        '[1, 2]\n5\n{"epoch": "x"}\n'),
    'a dead writer\'s temp file': lambda out: open(
        os.path.join(out, 'checkpoint.npz.tmp-99999'), 'wb').write(b'partial'),
}


@pytest.mark.parametrize('damage', REPAIRED)
def test_what_the_checkpoint_can_rebuild_is_rebuilt(damage, finished_run, cache_dir, tmp_path,
                                                    capsys):
    out = str(tmp_path / 'run')
    shutil.copytree(finished_run, out)
    REPAIRED[damage](out)
    status, err = run_main(dqn.main, ['--output-dir', out], cache_dir, capsys)
    assert status == 0, err
    assert open(os.path.join(out, 'config.json')).read() == \
        open(os.path.join(finished_run, 'config.json')).read()
    assert metrics(out) == metrics(finished_run)
    summary, reference = (json.load(open(os.path.join(d, 'summary.json')))
                          for d in (out, finished_run))
    assert summary['final_eval_return'] == reference['final_eval_return']
    assert temp_files(out) == []


# ---------------------------------------------------------------------------
# 3. The OS saying no: a full disk, a closed pipe, a full device on stdout
# ---------------------------------------------------------------------------


def test_a_full_disk_is_one_line_keeps_the_checkpoint_and_leaves_no_temp_file(
        finished_run, cache_dir, tmp_path, capsys):
    # 40k holds one checkpoint (22 kB) and the small files, not a second one.
    with tmpfs(str(tmp_path / 'disk'), '40k') as disk:
        out = os.path.join(disk, 'run')
        for attempt in range(2):  # the run, then its rerun on the still full disk
            status, err = run_main(dqn.main, ['--epochs', '3', '--output-dir', out], cache_dir,
                                   capsys)
            assert status == 1
            one_line(err, 'No space left on device (ENOSPC)', 'checkpoint of epoch 1',
                     'rerun with --output-dir')
            assert temp_files(out) == []
            assert rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch'] == 1
        subprocess.run(['mount', '-o', 'remount,size=1m', disk], check=True)
        status, err = run_main(dqn.main, ['--epochs', '3', '--output-dir', out], cache_dir,
                               capsys)
        assert status == 0, err
        assert metrics(out) == metrics(finished_run)  # resumed bitwise
        assert temp_files(out) == []


def test_stdout_into_a_closed_pipe_stops_after_saving(finished_run, cache_dir, tmp_path):
    out = str(tmp_path / 'run')
    args = [a for a in SMALL if a != '--quiet']
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, 'dqn.py'), *args,
                                '--compile-cache', cache_dir, '--epochs', '3', '--output-dir',
                                out], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().startswith('epoch')  # `| head -1`
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1
    one_line(stderr.strip().splitlines(), 'cannot write to stdout (Broken pipe)', 'resume')
    epoch = rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch']
    assert 1 <= epoch < 3 and temp_files(out) == []


def test_stdout_on_a_full_device_stops_after_saving(finished_run, cache_dir, tmp_path, capsys,
                                                    monkeypatch):
    if not os.path.exists('/dev/full'):
        pytest.skip('no /dev/full here')
    out = str(tmp_path / 'run')
    full = open('/dev/full', 'w')
    monkeypatch.setattr(sys, 'stdout', full)
    args = [a for a in SMALL if a != '--quiet']
    status = 0
    try:
        dqn.main([*args, '--compile-cache', cache_dir, '--epochs', '3', '--output-dir', out])
    except SystemExit as stop:
        status = stop.code
    assert status == 1
    one_line(capsys.readouterr().err.strip().splitlines(), 'No space left on device')
    assert rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch'] >= 1


# ---------------------------------------------------------------------------
# 4. Signals at awkward moments
# ---------------------------------------------------------------------------


SLOW = ['--epochs', '2', '--train-steps-per-epoch', '131072']  # epochs of a second or so


def test_a_signal_during_the_imports_is_one_line(cache_dir, tmp_path):
    out = str(tmp_path / 'run')
    process = script(['--output-dir', out], cache_dir)
    time.sleep(0.5)  # importing JAX: Python's default would be a traceback or nothing
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM
    one_line(stderr.strip().splitlines(), 'interrupted (SIGTERM) before the first epoch')


def test_ctrl_c_while_compiling_is_one_line(tmp_path):
    out = str(tmp_path / 'run')
    process = script(['--output-dir', out], 'none')  # no cache: the compile takes seconds
    wait_for_lines(os.path.join(out, 'run.lock'), 1, process)  # locked: compiling next
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130
    one_line(stderr.strip().splitlines(), 'interrupted (SIGINT)')
    assert not os.path.exists(os.path.join(out, 'checkpoint.npz'))


def test_a_second_ctrl_c_abandons_the_chunk_in_one_line(cache_dir, tmp_path):
    out = str(tmp_path / 'run')
    process = script(['--output-dir', out, *SLOW], cache_dir)
    wait_for_lines(os.path.join(out, 'metrics.jsonl'), 1, process)
    process.send_signal(signal.SIGINT)  # both inside epoch 2's chunk
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    lines = stderr.strip().splitlines()
    assert process.returncode == 130, stderr
    assert lines[0].startswith('SIGINT: finishing this chunk')
    one_line(lines[1:], 'interrupted (SIGINT)', 'checkpoint of epoch 1')
    assert temp_files(out) == []


def test_a_signal_in_the_last_epoch_finishes_the_summary(cache_dir, tmp_path):
    out = str(tmp_path / 'run')
    process = script(['--output-dir', out, *SLOW], cache_dir)
    wait_for_lines(os.path.join(out, 'metrics.jsonl'), 1, process)
    time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert stderr.strip().splitlines() == ['SIGTERM: finishing this chunk of epochs, then saving '
                                           '(Ctrl-C again to abandon it)']
    summary = json.load(open(os.path.join(out, 'summary.json')))
    assert summary['epochs'] == 2 and None not in summary['final_eval_return']


def test_a_signal_swallowed_in_a_finaliser_is_raised_at_the_next_check():
    signals = cli._Signals()
    import gc

    def callback(phase, info):  # as JAX's gc callback: a signal lands inside it
        signals._handle(signal.SIGINT, sys._getframe())
    gc.callbacks.append(callback)
    try:
        gc.collect()  # no Interrupted escapes into the gc machinery
    finally:
        gc.callbacks.remove(callback)
    with pytest.raises(cli.Interrupted):
        signals.check()


# ---------------------------------------------------------------------------
# 5. One run per device
# ---------------------------------------------------------------------------


def test_one_run_per_device_is_bitwise_one_device(cache_dir, tmp_path):
    """2 runs on 2 devices = 2 on one, at XLA's default optimisation level (the
    suite's level 0 hides the difference a device of one run makes)."""
    env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2')
    outs = [str(tmp_path / name) for name in ('sharded', 'single')]
    for out, extra in zip(outs, ([], ['--device', '0'])):
        process = script(['--num-seeds', '2', '--epochs', '2', '--output-dir', out, *extra],
                         cache_dir, env=env)
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
    assert metrics(outs[0]) == metrics(outs[1])
    sharded, single = (rundir._read_checkpoint(os.path.join(out, 'checkpoint.npz'))
                       for out in outs)
    assert sharded[0]['metadata']['devices'] == 2 and single[0]['metadata']['devices'] == 1
    for a, b in zip(sharded[1], single[1]):
        np.testing.assert_array_equal(a, b)


def test_a_resume_on_another_device_count_is_refused_where_not_bitwise():
    """Wide observations, and Box actions: PPO on Pendulum-v1 (3 observation
    values) differed in the last bits as 2 runs on a device from 4 (issue 53,
    item 2), so a resume on another count would match neither uninterrupted
    run. CartPole-width discrete runs resume on any count (bitwise, tested in
    test_distributed)."""
    class Device:
        platform = 'cpu'

    def run(obs_shape, n_devices, kind='discrete'):
        return types.SimpleNamespace(
            output_dir='D', agent=types.SimpleNamespace(
                obs_shape=obs_shape, spec=types.SimpleNamespace(
                    policy=types.SimpleNamespace(kind=kind))),
            sharding=types.SimpleNamespace(device_set={Device() for _ in range(n_devices)}))
    cli._check_same_devices(run((4,), 1), 2)  # CartPole: bitwise on any count
    cli._check_same_devices(run((50,), 2), 2)
    cli._check_same_devices(run((50,), 1), None)  # a checkpoint from before the record
    with pytest.raises(cli.common.UsageError, match=r'resume on 2 device\(s\) '
                                                    r'\(--cpu-devices 2 on CPU\)$'):
        cli._check_same_devices(run((50,), 1), 2)
    with pytest.raises(cli.common.UsageError, match=r'3 observation values and Box actions.*'
                                                    r'resume on 1 device\(s\) \(--device 0'):
        cli._check_same_devices(run((3,), 2, 'box'), 1)


@pytest.mark.parametrize('num_seeds', [3, 1])
def test_runs_that_do_not_divide_over_the_cpu_devices_are_refused(num_seeds, tmp_path):
    """--cpu-devices 2 with 3 runs, or with 1: it ran on one device, silently."""
    out = tmp_path / 'run'
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'dqn.py'), *SMALL, '--epochs', '1',
         '--num-seeds', str(num_seeds), '--cpu-devices', '2', '--output-dir', str(out),
         '--compile-cache', 'none'], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.count('\n') == 1, result.stderr
    assert result.stderr.startswith(f'dqn.py: error: --cpu-devices 2: {num_seeds} run(s) do not '
                                    'divide evenly over 2 devices; use a multiple of 2 runs')
    assert not out.exists()


@pytest.mark.parametrize('script, argv, why', [
    ('actor_critic.py', ['--env', 'Pendulum-v1', '--n-envs', '8', '--n-interactions-per-epoch',
                         '64', '--batch-size', '8'], '3 observation values and Box actions'),
    ('dqn.py', ['--env', 'Catch-bsuite'], '50 observation values')])
def test_cpu_devices_that_would_not_be_bitwise_are_refused(script, argv, why, tmp_path):
    """PPO on Pendulum-v1 over --cpu-devices 2 differed from one device in the
    last bits from epoch 2 (issue 53, item 2; at XLA's optimisation level 2,
    not the suite's 0), and so do wide observations: refused before compiling,
    nothing written. CartPole over 2 devices is bitwise (test_scale)."""
    out = tmp_path / 'run'
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *argv, '--epochs', '1', '--num-seeds', '4',
         '--cpu-devices', '2', '--output-dir', str(out), '--compile-cache', 'none', '--quiet'],
        capture_output=True, text=True, timeout=300)
    error = result.stderr.splitlines()[-1]
    assert result.returncode == 2 and error.startswith(
        f'{script}: error: --cpu-devices 2: with {why} the numbers depend on the runs per '
        'device'), result.stderr
    assert error.endswith('run on one device (without --cpu-devices)')
    assert not out.exists()


# ---------------------------------------------------------------------------
# 7. Messages
# ---------------------------------------------------------------------------


def test_a_path_with_a_newline_is_one_line(tmp_path, capsys):
    out = str(tmp_path / 'a\nb')
    status, err = run_main(dqn.main, ['--only-eval', '--output-dir', out], 'none', capsys)
    assert status == 2
    one_line(err, 'a\\nb')


def test_a_compile_cache_that_cannot_write_is_one_note(tmp_path, capsys, monkeypatch):
    """A full disk under the cache: JAX's two-line UserWarning on each entry
    is one line, once; other warnings pass as before."""
    import warnings
    passed = []
    monkeypatch.setattr(warnings, 'showwarning', lambda message, *args: passed.append(message))
    monkeypatch.setattr(flags.jax.config, 'update', lambda *args: None)
    flags.enable_compile_cache(str(tmp_path / 'cache'))
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter('always')
        for name in ('jit_a', 'jit_b'):
            warnings.warn(f"Error writing persistent compilation cache entry for '{name}': "
                          "OSError: [Errno 28] No space left on device")
    err = capsys.readouterr().err
    one_line(err.strip().splitlines(), 'note: the compile cache', 'No space left on device')
    with warnings.catch_warnings():
        warnings.simplefilter('always')
        warnings.warn('something else')
    assert [str(message) for message in passed] == ['something else']


def test_a_compile_cache_that_is_a_file_is_one_line(tmp_path, capsys):
    cache = tmp_path / 'cache'
    cache.write_text('')
    status, err = run_main(dqn.main, ['--output-dir', str(tmp_path / 'run'), '--compile-cache',
                                      str(cache)], 'none', capsys)
    assert status == 2
    one_line(err, 'not a directory')


def test_a_read_only_home_is_a_note_not_library_warnings(tmp_path, monkeypatch, capsys):
    with tmpfs(str(tmp_path / 'home'), '16k') as home:
        subprocess.run(['mount', '-o', 'remount,ro', home], check=True)
        cache = os.path.join(home, '.cache', 'trax-rl-jax')
        flags.enable_compile_cache(cache, explicit=False)  # the default: a note, no cache
        one_line(capsys.readouterr().err.strip().splitlines(), 'note: no compile cache')
        with pytest.raises(cli.common.UsageError, match='Read-only'):
            flags.enable_compile_cache(cache, explicit=True)
        monkeypatch.setenv('HOME', home)
        monkeypatch.delenv('XDG_CONFIG_HOME', raising=False)
        monkeypatch.delenv('MPLCONFIGDIR', raising=False)
        monkeypatch.delitem(sys.modules, 'matplotlib', raising=False)
        with rundir.matplotlib_config_dir():
            config_dir = os.environ.get('MPLCONFIGDIR')
            assert config_dir and os.path.isdir(config_dir)
        assert not os.path.exists(config_dir) and 'MPLCONFIGDIR' not in os.environ


def test_a_plot_with_nothing_to_show_says_so_without_warnings(tmp_path):
    agent = types.SimpleNamespace(eval_tags=[(0.0, 500)])
    history = [{'epoch': 1, 'run': 0, 'rl/avg_return': None, 'rl/n_interactions': 64}]
    path = str(tmp_path / 'curve.png')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        rundir.plot_learning_curves(history, agent, 'CartPole-v1', path)
    assert os.path.getsize(path) > 0 and temp_files(str(tmp_path)) == []


# ---------------------------------------------------------------------------
# 8. Background writers (issue 37, class 1): TensorBoard, metrics, checkpoints
# ---------------------------------------------------------------------------


def failing_fsync(monkeypatch, needle, code, after):
    """os.fsync raising OSError(code) for files whose path holds `needle`,
    once `after` such calls have succeeded: a disk that fills, or one EIO,
    under whichever writer writes that file (tensorboardX's writer, the
    metrics and the checkpoint thread all fsync what they write)."""
    real, calls = os.fsync, []

    def fsync(fd):
        try:
            path = os.readlink(f'/proc/self/fd/{fd}')
        except OSError:
            path = ''
        if needle in path:
            calls.append(path)
            if len(calls) > after:
                raise OSError(code, os.strerror(code))
        return real(fd)
    monkeypatch.setattr(os, 'fsync', fsync)
    return calls


WRITERS = {  # writer: (path needle, errno, good fsyncs before the failure, named in the line)
    # the event files' flush at opening and after epoch 1; epoch 2's fails
    'tensorboard': ('/tb/', errno.ENOSPC, 2, 'events.out.tfevents'),
    # metrics.jsonl's rewrite at the start and epoch 1's lines; epoch 2's fail
    'metrics': ('metrics.jsonl', errno.EIO, 2, 'metrics.jsonl'),
    # epoch 1's checkpoint; epoch 2's fails in the checkpoint thread
    'checkpoint': ('checkpoint.npz', errno.EIO, 1, 'checkpoint.npz'),
}


@pytest.mark.parametrize('writer', WRITERS)
def test_a_failing_writer_ends_the_run_in_one_line_naming_its_file(writer, finished_run,
                                                                   cache_dir, tmp_path, capsys,
                                                                   monkeypatch):
    needle, code, after, named = WRITERS[writer]
    out = str(tmp_path / 'run')
    threads = set(threading.enumerate())
    with monkeypatch.context() as patch:
        failing_fsync(patch, needle, code, after)
        status, err = run_main(dqn.main, ['--epochs', '3', '--output-dir', out, '--tensorboard'],
                               cache_dir, capsys)
    assert status == 1
    line = one_line(err, named, f'({errno.errorcode[code]})', 'checkpoint of epoch 1',
                    'rerun with --output-dir')  # no 'Exception in thread' lines around it
    assert repr(out) in line or out in line
    assert set(threading.enumerate()) <= threads  # no writer thread left behind
    assert temp_files(out) == []
    assert rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch'] == 1
    # The disk is back: the same command resumes, bitwise.
    status, err = run_main(dqn.main, ['--epochs', '3', '--output-dir', out, '--tensorboard'],
                           cache_dir, capsys)
    assert status == 0, err
    assert metrics(out) == metrics(finished_run)


def test_a_full_disk_at_the_run_lock_names_it(tmp_path, capsys, monkeypatch):
    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(os, 'pwrite', pwrite)
    out = str(tmp_path / 'run')
    status, err = run_main(dqn.main, ['--output-dir', out], 'none', capsys)
    assert status == 1
    one_line(err, 'run.lock', '(ENOSPC)', 'no checkpoint was saved')


def test_tensorboard_events_are_written_in_the_callers_thread(tmp_path):
    """No writer thread: nothing can die out of sight, fill a queue and block
    the run, or be joined at exit."""
    threads = set(threading.enumerate())
    record = {'epoch': 1, 'run': 0, 'seed': 0, 'rl/avg_return': 1.0}
    with rundir.Summaries(str(tmp_path), [{'seed': 0}], {'grid': {}}, []) as summaries:
        summaries.write([record])
        assert set(threading.enumerate()) == threads
    [name] = os.listdir(tmp_path / 'tb' / 'seed=0')
    assert name.startswith('events.out.tfevents.')


def test_a_tensorboard_write_error_names_the_event_file(tmp_path, monkeypatch):
    from tensorboardX import record_writer
    with rundir.Summaries(str(tmp_path), [{'seed': 0}], {'grid': {}}, []) as summaries:
        def write(self, data):
            raise OSError(errno.ENOSPC, 'No space left on device')
        monkeypatch.setattr(record_writer.RecordWriter, 'write', write)
        with pytest.raises(OSError) as error:
            summaries.write([{'epoch': 1, 'run': 0, 'seed': 0, 'rl/avg_return': 1.0}])
    assert error.value.errno == errno.ENOSPC
    assert os.path.basename(error.value.filename).startswith('events.out.tfevents.')


# ---------------------------------------------------------------------------
# 9. The user's files (issue 37, class 2)
# ---------------------------------------------------------------------------


def test_the_temp_file_sweep_removes_only_the_programs_own_names(finished_run, cache_dir,
                                                                  tmp_path, capsys):
    mine = {'notes.tmp-old': b'notes', 'data.csv.tmp-backup': b'a,b\n',
            'checkpoint.npz.tmp-backup': b'kept', 'my.tmp-123': b'mine too'}
    dead = ['checkpoint.npz.tmp-99999', 'metrics.jsonl.tmp-4242',
            'learning_curve.png.tmp-77.png']
    for directory in (str(tmp_path / 'new'), str(tmp_path / 'resumed')):
        if directory.endswith('resumed'):
            shutil.copytree(finished_run, directory)
        os.makedirs(directory, exist_ok=True)
        for name, data in mine.items():
            open(os.path.join(directory, name), 'wb').write(data)
        for name in dead:
            open(os.path.join(directory, name), 'wb').write(b'partial')
        status, err = run_main(dqn.main, ['--epochs', '3', '--output-dir', directory],
                               cache_dir, capsys)
        assert status == 0, err
        for name, data in mine.items():
            assert open(os.path.join(directory, name), 'rb').read() == data, name
        assert not any(os.path.exists(os.path.join(directory, name)) for name in dead)


def test_own_temp_names():
    own = ['checkpoint.npz.tmp-1', 'config.json.tmp-99', 'metrics.jsonl.tmp-7',
           'summary.json.tmp-12', 'learning_curve.png.tmp-5.png']
    others = ['notes.tmp-old', 'data.csv.tmp-backup', 'checkpoint.npz.tmp-', 'x.npz.tmp-1',
              'checkpoint.npz.tmp-1.bak', 'learning_curve.png.tmp-5', 'summary.json']
    assert [rundir.is_own_temp_file(name) for name in own] == [True] * len(own)
    assert [rundir.is_own_temp_file(name) for name in others] == [False] * len(others)


# ---------------------------------------------------------------------------
# 10. The environment (issue 37, class 3): JAX_ENABLE_X64
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('name', ['dqn', 'pg', 'actor_critic'])
def test_jax_enable_x64_is_refused_in_one_line(name, tmp_path):
    out = str(tmp_path / 'run')
    result = subprocess.run([sys.executable, os.path.join(ROOT, f'{name}.py'), '--epochs', '2',
                             '--output-dir', out, '--compile-cache', 'none'], cwd=ROOT,
                            env=dict(os.environ, JAX_ENABLE_X64='1'), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2
    one_line(result.stderr.strip().splitlines(), 'JAX_ENABLE_X64=1 is set', 'float32 and int32')
    assert not os.path.exists(out)


def test_x64_is_refused_by_the_library_too(monkeypatch):
    import jax
    import common
    monkeypatch.delenv('JAX_ENABLE_X64', raising=False)
    config = dqn.Config(epochs=1)
    jax.config.update('jax_enable_x64', True)
    try:
        with pytest.raises(common.UsageError, match='jax_enable_x64 is on'):
            common.run_sweep(None, config)
    finally:
        jax.config.update('jax_enable_x64', False)


# ---------------------------------------------------------------------------
# 11. Integer sizes (issue 37, class 4): every derived count checked before tracing
# ---------------------------------------------------------------------------

import actor_critic  # noqa: E402

PRODUCTS = [
    (actor_critic, ['--policy-loss', 'awr', '--n-replay-epochs', '2000000'],
     'replay steps per run would be --n-replay-epochs 2000000 x --n-interactions-per-epoch'),
    (dqn, ['--epochs', '20000000'],
     'gradient steps per run would be --epochs 20000000 x --train-steps-per-epoch 128'),
    (dqn, ['--lr-schedule', 'constant * linear_decay', '--lr-decay-epochs', '2147483647'],
     "schedule's steps per run would be --lr-decay-epochs 2147483647 x "
     '--train-steps-per-epoch 128 = 274877906816'),
    (actor_critic, ['--lr-decay-epochs', '2147483647', '--lr-schedule',
                    'constant * linear_decay'],
     "schedule's steps per run would be --lr-decay-epochs 2147483647"),
    (actor_critic, ['--epochs', '40000000', '--value-train-steps-per-epoch', '64',
                    '--train-steps-per-epoch', '1'], 'value gradient steps per run'),
    (pg, ['--epochs', '100000000'],
     "env steps per run would be --epochs 100000000 x --n-trajectories-per-epoch 32 x "
     "CartPole-v1's episode cap 500"),
    (dqn, ['--epochs', '5000000', '--train-steps-per-epoch', '1'],
     'env steps per run would be --epochs 5000000 x --n-interactions-per-epoch 512'),
    (dqn, ['--n-replay-epochs', '10000000'], 'replay rows per run would be'),
    (pg, ['--n-interactions-per-epoch', '1024', '--n-envs', '1024', '--max-steps', '3000000',
          '--n-trajectories-per-epoch', 'none'], 'batch steps per run would be --n-envs 1024 x'),
]


@pytest.mark.parametrize('module,args,needle', PRODUCTS,
                         ids=[f'{m.__name__} ' + ' '.join(a) for m, a, _ in PRODUCTS])
def test_a_derived_count_past_int32_is_one_line_naming_the_product(module, args, needle,
                                                                   tmp_path, capsys):
    out = str(tmp_path / 'run')
    status, err = run_main(module.main, [*args, '--output-dir', out], 'none', capsys,
                           small=['--quiet'])
    assert status == 2
    one_line(err, needle, 'past 2147483647')
    assert not os.path.exists(out)


def test_the_library_refuses_a_derived_count_past_int32_too():
    with pytest.raises(dqn.common.UsageError, match='gradient steps per run'):
        dqn.make_agent(dqn.Config(epochs=20000000))


# ---------------------------------------------------------------------------
# 12. A divergence keeps its lead-up (issue 37, class 5)
# ---------------------------------------------------------------------------


def _diverging_run(tmp_path, grid, poisoned, at_epoch, capsys):
    """dqn with --checkpoint-every 3 over 8 epochs (chunks 1, 2-3, 4-6, 7-8), its
    parameters made NaN from epoch `at_epoch` on in the runs where
    `poisoned(hp)` holds -> (status, stderr lines, metrics records, out)."""
    import jax
    import jax.numpy as jnp
    parser = flags.build_parser(dqn.Config, 'dqn.py', '')
    out = str(tmp_path / 'run')
    small = [a for a in SMALL]
    small[small.index('--checkpoint-every') + 1] = '3'
    args = parser.parse_args([*small, '--epochs', '8', '--output-dir', out, '--compile-cache',
                              'none', *grid])
    config, grid = flags.config_and_grid(dqn.Config, args)

    def make_poisoned_agent(config, given=None):
        agent = dqn.make_agent(config, given)
        train = agent.train

        def poisoned_train(hp, state):
            state, metrics = train(hp, state)
            poison = jnp.where((state.epoch >= at_epoch) & poisoned(hp), jnp.nan, 1.0)
            return state._replace(params=jax.tree.map(lambda p: p * poison, state.params)), \
                metrics
        agent.train = poisoned_train
        return agent

    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli.run_experiment(make_poisoned_agent, config, grid, args, 'dqn.py')
    records = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
    return stop.value.code, capsys.readouterr().err.strip().splitlines(), records, out


def test_a_divergence_inside_a_chunk_keeps_the_epochs_before_it(tmp_path, capsys):
    status, err, records, out = _diverging_run(tmp_path, [], lambda hp: True, 5, capsys)
    assert status == 1
    one_line(err, 'non-finite', 'in epoch 5', 'checkpoint of epoch 3')
    assert [r['epoch'] for r in records] == [1, 2, 3, 4]  # 4 ran in epoch 5's chunk
    assert rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch'] == 3


def test_a_divergence_in_a_grid_names_the_run_and_keeps_the_healthy_runs_epochs(tmp_path,
                                                                               capsys):
    status, err, records, out = _diverging_run(
        tmp_path, ['--lr', '1e-2,3e-3', '--num-seeds', '2'],
        lambda hp: hp['lr'] < 5e-3, 5, capsys)
    assert status == 1
    line = one_line(err, 'non-finite', 'in epoch 5 of 2 of 4 runs', 'checkpoint of epoch 3',
                    'the other 2 run(s), finite through epoch 6')
    diverged = {(r['lr'], r['seed']) for r in records if r['epoch'] == 4} - \
        {(r['lr'], r['seed']) for r in records if r['epoch'] == 5}
    assert diverged and all(lr == 0.003 for lr, _ in diverged)
    for lr, seed in diverged:
        assert f'lr=0.003,seed={seed}' in line
    assert diverged == {(0.003, 0), (0.003, 1)}
    healthy = {(r['lr'], r['seed']) for r in records if r['epoch'] == 6}
    assert healthy == {(0.01, 0), (0.01, 1)}  # their epochs 5 and 6 are kept
    assert sorted(r['epoch'] for r in records if (r['lr'], r['seed']) in diverged) == \
        sorted([1, 2, 3, 4] * 2)
    for record in records:
        assert all(value is None or np.isfinite(value) for name, value in record.items()
                   if name.startswith('metrics/'))


# ---------------------------------------------------------------------------
# 13. Rerun after an early kill (issue 37, class 6)
# ---------------------------------------------------------------------------


def _killed_before_its_first_checkpoint(finished_run, out):
    """What a run killed in its first minute leaves: config.json and the
    lines of the epochs it ran, no checkpoint, no summary."""
    shutil.copytree(finished_run, out)
    for name in ('checkpoint.npz', 'checkpoint.prev.npz', 'summary.json'):
        os.remove(os.path.join(out, name))


def test_a_run_killed_before_its_first_checkpoint_reruns_with_its_flags(finished_run, cache_dir,
                                                                       tmp_path, capsys):
    out = str(tmp_path / 'run')
    _killed_before_its_first_checkpoint(finished_run, out)
    capsys.readouterr()
    try:  # --output-dir alone, as the README says: every flag from config.json
        dqn.main(['--output-dir', out, '--compile-cache', cache_dir])
        status = 0
    except SystemExit as stop:
        status = stop.code
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert 'stopped before its first checkpoint: running it again from epoch 1' in captured.out
    assert metrics(out) == metrics(finished_run)
    assert json.load(open(os.path.join(out, 'config.json'))) == \
        json.load(open(os.path.join(finished_run, 'config.json')))


def test_other_flags_on_a_run_killed_before_its_first_checkpoint_say_so(finished_run, cache_dir,
                                                                       tmp_path, capsys):
    out = str(tmp_path / 'run')
    _killed_before_its_first_checkpoint(finished_run, out)
    before = metrics(out)
    status, err = run_main(dqn.main, ['--output-dir', out, '--gamma', '0.5'], cache_dir, capsys)
    assert status == 2
    one_line(err, 'stopped before its first checkpoint', 'gamma', f'--output-dir {out}')
    assert metrics(out) == before


# ---------------------------------------------------------------------------
# 14. Messages name the real cause (issue 37, class 7)
# ---------------------------------------------------------------------------

AS_TYPED = [
    (dqn, ['--exploration-minimum', '1.0000001'], 'must be in [0, 1], got 1.0000001'),
    (dqn, ['--gamma', '1.0000001'], 'must be in (0, 1], got 1.0000001'),
    (dqn, ['--gamma', '0.9,1.0000001'], 'must be in (0, 1], got 1.0000001'),
    (pg, ['--eval-temperatures', '0,-0.0000001'], 'must be >= 0, got 0,-1e-07'),
    (dqn, ['--coordinator-timeout', '86400.0000001'], 'got 86400.0000001'),
    (dqn, ['--gamma', '1.5'], 'must be in (0, 1], got 1.5'),  # short where that is exact
]


@pytest.mark.parametrize('module,args,needle', AS_TYPED,
                         ids=[' '.join(args) for _, args, _ in AS_TYPED])
def test_a_bound_message_prints_the_value_as_typed(module, args, needle, tmp_path, capsys):
    out = str(tmp_path / 'run')
    status, err = run_main(module.main, [*args, '--output-dir', out], 'none', capsys,
                           small=['--quiet'])
    assert status == 2
    one_line(err, needle)
    assert not os.path.exists(out)


def test_a_float32_value_is_printed_exactly():
    assert fields._show32(float(np.float32(0.99999997))) == '0.99999994'
    assert fields._show32(1.0) == '1' and fields._show32(float(np.float32(0.5))) == '0.5'


MEMORY = [  # the flag that grew the state, and flags the script's list names but did not
    (actor_critic, ['--policy-loss', 'awr', '--n-replay-epochs', '1000000'],
     '--n-replay-epochs 1000000', ['--max-steps', '--n-trajectories-per-epoch']),
    # (--n-trajectories-per-epoch typed at its default: GRU_SETTINGS' 64 would be named too)
    (pg, ['--torso', 'gru', '--gru-size', '200000', '--batch-size', '0',
          '--n-trajectories-per-epoch', '32'], '--gru-size 200000',
     ['--max-steps', '--n-trajectories-per-epoch', '--batch-size']),
    (dqn, ['--n-replay-epochs', '4000000'], '--n-replay-epochs 4000000',
     ['--batch-size', '--train-steps-per-epoch']),
]


@pytest.mark.parametrize('module,args,grown,innocent', MEMORY,
                         ids=[' '.join(args) for _, args, _, _ in MEMORY])
def test_the_memory_refusal_names_the_flags_that_grew_the_state(module, args, grown, innocent,
                                                                tmp_path, capsys):
    out = str(tmp_path / 'run')
    status, err = run_main(module.main, [*args, '--output-dir', out], 'none', capsys,
                           small=['--quiet'])
    assert status == 2
    line = one_line(err, 'GiB', f'lower {grown} (above its default), or --num-seeds')
    assert not any(flag in line for flag in innocent), line
    assert not os.path.exists(out)


def test_an_env_setting_the_typed_flags_make_inert_is_not_applied(tmp_path, capsys):
    """--env MetaMaze-misc --torso mlp: its --max-slice-length 200 (GRU
    sequences) cannot act, so it is not applied, and the line says so; the
    run goes on (here to --only-eval's refusal, before compiling)."""
    out = str(tmp_path / 'run')
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        actor_critic.main(['--env', 'MetaMaze-misc', '--torso', 'mlp', '--only-eval',
                           '--output-dir', out, '--compile-cache', 'none'])
    captured = capsys.readouterr()
    assert stop.value.code == 2
    one_line(captured.err.strip().splitlines(), '--only-eval: no checkpoint')
    assert 'not applied: --max-slice-length 200 (inert with the flags given)' in captured.out
    assert '--batch-size 800' in captured.out  # the others are applied


def test_a_refusal_says_which_value_came_from_the_env_settings(tmp_path, capsys):
    out = str(tmp_path / 'run')
    status, err = run_main(actor_critic.main, ['--env', 'MetaMaze-misc', '--n-envs', '7',
                                               '--output-dir', out], 'none', capsys,
                           small=['--quiet'])
    assert status == 2
    one_line(err, 'must be a multiple of --n-envs (7)',
             '(--n-interactions-per-epoch 3200 is from the settings for MetaMaze-misc, not the '
             'command line)')
    assert not os.path.exists(out)


def test_a_refusal_says_which_value_came_from_the_saved_run(tmp_path, capsys):
    import dataclasses
    out = str(tmp_path / 'run')
    os.makedirs(out)
    config = actor_critic.Config(env='MetaMaze-misc', **{
        k: v for k, v in actor_critic.ENV_SETTINGS['MetaMaze-misc'].items()})
    run_config = json.loads(json.dumps({'algorithm': 'actor_critic', **dataclasses.asdict(config),
                                        'grid': {}, 'seed': 0, 'num_seeds': 1}))
    rundir.save_checkpoint(os.path.join(out, 'checkpoint.npz'), {},
                           {'config': run_config, 'epoch': 1})
    before = open(os.path.join(out, 'checkpoint.npz'), 'rb').read()
    # A GRU run resumed with --torso mlp: the refusal is of the torso typed
    # (issue 53, item 8), not of a GRU field it would leave without effect.
    status, err = run_main(actor_critic.main, ['--output-dir', out, '--torso', 'mlp'], 'none',
                           capsys, small=['--quiet'])
    assert status == 2
    one_line(err, f"{out} holds a run with a different config; differing: torso (saved 'gru', "
                  "now 'mlp')")
    # A saved value that cannot act (an older version saved it): the note says
    # where it came from, once.
    run_config['torso'] = 'mlp'
    rundir.save_checkpoint(os.path.join(out, 'checkpoint.npz'), {},
                           {'config': run_config, 'epoch': 1})
    before = open(os.path.join(out, 'checkpoint.npz'), 'rb').read()
    status, err = run_main(actor_critic.main, ['--output-dir', out], 'none', capsys,
                           small=['--quiet'])
    assert status == 2
    line = one_line(err, '--max-slice-length acts with --torso gru only',
                    f'(--max-slice-length 200 is from the run saved in {out}, not the command line)')
    assert line.count('is from the run saved in') == 1
    assert open(os.path.join(out, 'checkpoint.npz'), 'rb').read() == before


# ---------------------------------------------------------------------------
# 15. Resume and evaluation edges (issue 37, class 9)
# ---------------------------------------------------------------------------


# Every schedule form resumes (issue 53, item 1): the command line pinned
# --lr-decay-epochs for every run, and a schedule without linear_decay then
# refused that pinned value as a field set to no effect on every resume.
SCHEDULES = ['constant', 'constant * linear_decay', 'constant * linear_warmup * rsqrt_decay',
             'constant * decay_every']
SMALL_OF = {'dqn': SMALL,
            'pg': ['--n-trajectories-per-epoch', '2', '--n-eval-episodes', '2',
                   '--hidden-sizes', '8', '--no-tensorboard', '--quiet'],
            'actor_critic': ['--n-envs', '4', '--n-interactions-per-epoch', '32',
                             '--batch-size', '16', '--train-steps-per-epoch', '2',
                             '--value-train-steps-per-epoch', '2', '--n-eval-episodes', '2',
                             '--hidden-sizes', '8', '--no-tensorboard', '--quiet']}


@pytest.mark.parametrize('schedule', SCHEDULES)
@pytest.mark.parametrize('name', ['dqn', 'pg', 'actor_critic'])
def test_a_run_of_every_schedule_form_resumes_and_evaluates(name, schedule, cache_dir, tmp_path,
                                                           capsys):
    import importlib
    main = importlib.import_module(name).main
    out = str(tmp_path / 'run')
    first = ['--lr-schedule', schedule, '--epochs', '1', '--output-dir', out]
    if 'linear_decay' in schedule:  # its horizon is pinned: give room to extend
        first += ['--lr-decay-epochs', '2']
    status, err = run_main(main, first, cache_dir, capsys, small=SMALL_OF[name])
    assert (status, err) == (0, [])
    saved = json.load(open(os.path.join(out, 'config.json')))['lr_decay_epochs']
    assert saved == (2 if 'linear_decay' in schedule else None)
    for resume in (['--epochs', '2'], ['--only-eval']):  # the flags not typed: the saved run's
        status, err = run_main(main, ['--output-dir', out, *resume], cache_dir, capsys,
                               small=['--quiet'])
        assert (status, err) == (0, [])
    assert [record['epoch'] for record in metrics(out)][-1] == 2


def test_a_run_saved_with_a_pinned_horizon_it_cannot_use_resumes(cache_dir, tmp_path, capsys):
    """A run saved before the fix (constant schedule, lr_decay_epochs pinned to
    --epochs) resumes and extends; --lr-decay-epochs none is accepted too."""
    out = str(tmp_path / 'run')
    status, _ = run_main(pg.main, ['--lr-schedule', 'constant', '--epochs', '1',
                                   '--output-dir', out], cache_dir, capsys, small=SMALL_OF['pg'])
    assert status == 0
    path = os.path.join(out, 'checkpoint.npz')  # as the command line used to pin it:
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    header = json.loads(bytes(arrays['header']).decode())
    header['metadata']['config']['lr_decay_epochs'] = 1
    arrays['header'] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(path, **arrays)
    config = json.load(open(os.path.join(out, 'config.json')))
    with open(os.path.join(out, 'config.json'), 'w') as f:
        json.dump({**config, 'lr_decay_epochs': 1}, f)
    for resume in (['--epochs', '2'], ['--epochs', '3', '--lr-decay-epochs', 'none']):
        status, err = run_main(pg.main, ['--output-dir', out, *resume], cache_dir, capsys,
                               small=['--quiet'])
        assert (status, err) == (0, [])


def _files(out):
    return {name: open(os.path.join(out, name), 'rb').read() for name in sorted(os.listdir(out))
            if os.path.isfile(os.path.join(out, name)) and name != 'run.lock'}


def test_epochs_below_those_done_are_refused_and_nothing_is_rewritten(finished_run, cache_dir,
                                                                     tmp_path, capsys):
    out = str(tmp_path / 'run')
    shutil.copytree(finished_run, out)
    before = _files(out)
    status, err = run_main(dqn.main, ['--output-dir', out, '--epochs', '2'], cache_dir, capsys)
    assert status == 2
    one_line(err, '--epochs 2 is below the 3 epochs the run in', '--epochs 3 or more')
    assert _files(out) == before  # config.json keeps its 3 epochs


def test_only_eval_while_another_run_writes_names_the_writer(tmp_path, capsys):
    out = str(tmp_path / 'run')
    os.makedirs(out)
    with rundir.output_dir_lock(out):  # a run in its first minute: no checkpoint yet
        status, err = run_main(dqn.main, ['--only-eval', '--output-dir', out], 'none', capsys)
    assert status == 2
    one_line(err, f'another run (pid {os.getpid()}) is writing {out}', 'no checkpoint yet')
    assert rundir.lock_holder(out) is None  # the probe left no lock behind


def test_only_eval_on_a_run_killed_before_its_first_checkpoint_says_so(finished_run, tmp_path,
                                                                      capsys):
    out = str(tmp_path / 'run')
    _killed_before_its_first_checkpoint(finished_run, out)
    status, err = run_main(dqn.main, ['--only-eval', '--output-dir', out], 'none', capsys)
    assert status == 2
    one_line(err, 'stopped before its first checkpoint', f'rerun it with --output-dir {out}')


def test_only_eval_with_plot_draws_the_learning_curves(finished_run, cache_dir, tmp_path,
                                                       capsys):
    out = str(tmp_path / 'run')
    shutil.copytree(finished_run, out)
    assert not os.path.exists(os.path.join(out, 'learning_curve.png'))
    status, err = run_main(dqn.main, ['--only-eval', '--plot', '--output-dir', out], cache_dir,
                           capsys)
    assert status == 0, err
    assert os.path.getsize(os.path.join(out, 'learning_curve.png')) > 0
    assert temp_files(out) == []


def test_a_time_limit_stop_evaluates_the_parameters_it_stops_with(cache_dir, tmp_path, capsys):
    """--time-limit ends after epoch 1 of 5, whose evaluation is due only at
    epoch 5: summary.json's return is an evaluation of epoch 1's parameters
    (it had none), and metrics.jsonl holds no evaluation an unstopped run
    would not make."""
    out = str(tmp_path / 'run')
    status, err = run_main(dqn.main, ['--epochs', '5', '--eval-every', '5', '--time-limit',
                                      '0.001', '--output-dir', out], cache_dir, capsys)
    assert status == 0, err
    summary = json.load(open(os.path.join(out, 'summary.json')))
    assert summary['epochs'] == 1 and summary['final_eval_epoch'] == 1
    assert all(value is not None for value in summary['final_eval_return'])
    assert all(record.get(summary['final_eval_key']) is None for record in metrics(out))


def test_a_time_limit_stop_reports_the_latest_evaluation_and_says_which():
    agent = types.SimpleNamespace(name='dqn', eval_tags=[(0.0, 40)])
    config = types.SimpleNamespace(env='CartPole-v1', n_eval_episodes=2, epochs=100)
    key = 'rl/avg_return_temperature0.00_steps40'
    history = [{'epoch': epoch, 'run': run, 'seed': run, 'rl/n_interactions': 64 * epoch,
                **({key: 10.0 * epoch + run} if epoch % 5 == 0 else {})}
               for epoch in range(1, 8) for run in range(2)]
    summary = fields.summary(agent, config, [{'seed': 0}, {'seed': 1}], {}, history, 0.0, 0.0)
    assert summary['epochs'] == 7 and summary['final_eval_epoch'] == 5
    assert summary['final_eval_return'] == [50.0, 51.0]
    run = types.SimpleNamespace(history=history, agent=agent, config=config)
    assert "final_eval_return is epoch 5's evaluation" in cli._evaluation_note(run)
    run.history = history[:8]  # epochs 1-4: no evaluation yet
    assert 'no evaluation yet' in cli._evaluation_note(run)
    summary = fields.summary(agent, config, [{'seed': 0}, {'seed': 1}], {}, history[:8], 0, 0)
    assert summary['final_eval_return'] == [None, None] and summary['final_eval_epoch'] is None


def test_a_signal_after_the_summary_does_not_ask_for_a_rerun(finished_run, cache_dir, tmp_path,
                                                            capsys, monkeypatch):
    out = str(tmp_path / 'run')
    shutil.copytree(finished_run, out)
    say = cli.say

    def say_then_signal(text):  # SIGTERM while the done line is said
        if text.startswith('done:'):
            os.kill(os.getpid(), signal.SIGTERM)
        say(text)
    monkeypatch.setattr(cli, 'say', say_then_signal)
    loud = [a for a in SMALL if a != '--quiet']
    status, err = run_main(dqn.main, ['--output-dir', out], cache_dir, capsys, small=loud)
    assert status == 128 + signal.SIGTERM
    line = one_line(err, 'interrupted (SIGTERM) after the run finished', 'nothing to rerun')
    assert 'rerun with' not in line
    assert json.load(open(os.path.join(out, 'summary.json')))['epochs'] == 3


def test_a_signal_after_done_changes_nothing(finished_run, cache_dir, tmp_path, capsys,
                                            monkeypatch):
    out = str(tmp_path / 'run')
    shutil.copytree(finished_run, out)
    finish = cli._finish

    def finish_then_signal(run, args):
        finish(run, args)
        os.kill(os.getpid(), signal.SIGTERM)  # after `done:`
    monkeypatch.setattr(cli, '_finish', finish_then_signal)
    status, err = run_main(dqn.main, ['--output-dir', out], cache_dir, capsys)
    assert status == 0 and err == []


# ---------------------------------------------------------------------------
# Classes 8 and 10: a flag that cannot act is refused the same way whatever it
# is, by the command line and by Python, with one message (tests/test_library.py
# holds the full table of refusals shared by both).
# ---------------------------------------------------------------------------

@pytest.mark.parametrize('script,fields,flags,message', [
    ('actor_critic', dict(conv_channels=(8,)), ['--conv-channels', '8'],
     "--conv-channels acts with the conv torso only (--torso conv, or auto on "
     "[height, width, channels] observations); CartPole-v1's observations are flat"),
    ('dqn', dict(advantage_estimator='monte_carlo', max_slice_length=3),
     ['--advantage-estimator', 'monte_carlo', '--max-slice-length', '3'],
     '--max-slice-length has no effect with --advantage-estimator monte_carlo'),
    ('actor_critic', dict(max_slice_length=50), ['--max-slice-length', '50'],
     '--max-slice-length acts with --torso gru only'),
])
def test_an_inert_flag_is_refused_alike_by_the_cli_and_python(script, fields, flags, message,
                                                              tmp_path):
    module = __import__(script)
    with pytest.raises(common.UsageError) as refused:
        module.make_agent(module.Config(**fields))
    assert str(refused.value).startswith(message)
    out = tmp_path / 'run'
    result = subprocess.run([sys.executable, os.path.join(ROOT, f'{script}.py'), *flags,
                             '--output-dir', str(out)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr == f'{script}.py: error: {refused.value}\n'
    assert not out.exists()  # refused before anything is written


# --joint on the GRU envs' settings, and what a joint run's refusals say
# (issue 53, item 5).

@pytest.mark.parametrize('env', ['MetaMaze-misc', 'BernoulliBandit-misc', 'PointRobot-misc'])
def test_joint_takes_the_gru_envs_settings(env, monkeypatch):
    captured = {}
    monkeypatch.setattr(cli, 'run_experiment',
                        lambda make_agent, config, grid, args, prog, agent: captured.update(
                            agent=make_agent(config), config=config))
    actor_critic.main(['--env', env, '--joint', '--quiet'])  # checked, built, not run
    assert captured['config'].joint and captured['config'].torso == 'gru'


def test_a_joint_run_is_not_held_to_the_value_trainers_int32_counts():
    """--joint has no value trainer: 40M epochs x 64 value steps (its default,
    unused) past int32 is no refusal; the policy's own counts still are."""
    small = dict(n_envs=1, n_interactions_per_epoch=16, batch_size=16, hidden_sizes=(8,),
                 epochs=40_000_000, train_steps_per_epoch=1, joint=True)
    actor_critic.make_agent(actor_critic.Config(**small))  # no UsageError
    with pytest.raises(common.UsageError, match='policy gradient steps per run would be'):
        actor_critic.make_agent(actor_critic.Config(**{**small, 'train_steps_per_epoch': 64}))


def test_a_resume_that_changes_joint_says_so(tmp_path, capsys):
    import dataclasses
    out = str(tmp_path / 'run')
    os.makedirs(out)
    config = actor_critic.Config()
    run_config = json.loads(json.dumps({'algorithm': 'actor_critic', **dataclasses.asdict(config),
                                        'grid': {}, 'seed': 0, 'num_seeds': 1}))
    rundir.save_checkpoint(os.path.join(out, 'checkpoint.npz'), {},
                           {'config': run_config, 'epoch': 1})
    status, err = run_main(actor_critic.main, ['--output-dir', out, '--joint'], 'none', capsys,
                           small=['--quiet'])
    assert status == 2
    one_line(err, f"{out} holds a run without --joint: a saved run's --joint cannot change")
