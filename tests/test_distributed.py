"""One sweep over several processes (jax.distributed): 2 local processes x 2
forced CPU devices, coordinator on 127.0.0.1, give bitwise the metrics and
final parameters of 1 process x 4 devices and of 1 process x 1 device; kill -9
of either process, then rerunning both (or one process alone), resumes to the
same result; bad input is one line, exit 2, nothing written.

Every process is a subprocess in its own session, with a timeout, killed
(its whole group) in a `finally`; only loopback addresses are used.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from harness import rundir  # noqa: E402
from test_reliability import SMALL, assert_one_line_error  # noqa: E402
from test_scale import assert_same_runs, results  # noqa: E402

SEEDS = ['--num-seeds', '8', '--seed', '3', '--epochs', '4']
TIMEOUT = 300  # seconds any one process may take


def free_port():
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return probe.getsockname()[1]


def environment(devices):
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(('SLURM_', 'OMPI_', 'PMI_', 'JAX_COORDINATOR', 'JAX_PROCESS',
                                   'JAX_NUM_PROCESSES', 'JAX_LOCAL_DEVICE'))
           and not name.lower().endswith('_proxy')}
    flags = ' '.join(flag for flag in env.get('XLA_FLAGS', '').split()
                     if 'xla_force_host_platform_device_count' not in flag)
    env['XLA_FLAGS'] = f'{flags} --xla_force_host_platform_device_count={devices}'.strip()
    return env


def command(algo, cache_dir, flags):
    return [sys.executable, os.path.join(ROOT, f'{algo}.py'), '--compile-cache', cache_dir,
            *SMALL[algo], *flags]


@contextlib.contextmanager
def processes(algo, cache_dir, flags, count=2, devices=2, per_process=None, cwds=None):
    """`count` processes of one run (process i gets per_process[i] flags too,
    and runs in cwds[i]); yields the Popen list; every group is killed on the
    way out."""
    port = free_port()
    started = []
    try:
        for index in range(count):
            process_flags = ['--coordinator-address', f'127.0.0.1:{port}', '--num-processes',
                             str(count), '--process-id', str(index),
                             *(per_process[index] if per_process else [])]
            started.append(subprocess.Popen(
                command(algo, cache_dir, [*flags, *process_flags]),
                cwd=cwds[index] if cwds else ROOT,
                env=environment(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, start_new_session=True))
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.communicate()


def finish(started):
    """[(returncode, stdout, stderr)] once each process ends (within TIMEOUT)."""
    deadline = time.time() + TIMEOUT
    outputs = [p.communicate(timeout=max(1, deadline - time.time())) for p in started]
    return [(p.returncode, *output) for p, output in zip(started, outputs)]


def run_two(algo, cache_dir, flags, **kwargs):
    with processes(algo, cache_dir, flags, **kwargs) as started:
        return finish(started)


def run_one(algo, cache_dir, flags, devices=1):
    result = subprocess.run(command(algo, cache_dir, flags), cwd=ROOT, env=environment(devices),
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('xla_cache'))


class _References(dict):
    """algo -> output dir of the run on 1 process x 1 device, made on first use."""

    def __init__(self, factory, cache_dir):
        super().__init__()
        self.factory, self.cache_dir = factory, cache_dir

    def __missing__(self, algo):
        out = str(self.factory.mktemp(f'{algo}_one_device'))
        run_one(algo, self.cache_dir, [*SEEDS, '--quiet', '--output-dir', out])
        self[algo] = out
        return out


@pytest.fixture(scope='module')
def references(tmp_path_factory, cache_dir):
    return _References(tmp_path_factory, cache_dir)


def assert_same_as(reference, out):
    expected, actual = results(reference), results(out)
    assert actual[1] == expected[1]
    assert_same_runs(actual[0], actual[2], expected[0], expected[2])


@pytest.mark.parametrize('algo', ['dqn', 'pg'])
def test_two_processes_equal_one_process(algo, references, cache_dir, tmp_path):
    """2 processes x 2 devices = 1 process x 4 devices = 1 process x 1 device,
    bitwise; process 0 alone writes and prints, process 1 prints nothing."""
    four = str(tmp_path / 'four_devices')
    run_one(algo, cache_dir, [*SEEDS, '--quiet', '--output-dir', four], devices=4)
    two = str(tmp_path / 'two_processes')
    (status_0, out_0, err_0), (status_1, out_1, err_1) = run_two(
        algo, cache_dir, [*SEEDS, '--output-dir', two])
    assert status_0 == 0 and status_1 == 0, err_0[-2000:] + err_1[-2000:]
    assert out_1 == '' and err_1 == ''
    lines = out_0.splitlines()
    assert [line.split('|')[0].split() for line in lines[:-1]] == [
        ['epoch', f'{epoch}/4'] for epoch in range(1, 5)], out_0
    assert lines[-1].startswith('done: 8 run(s)') and err_0 == '', out_0 + err_0
    assert_same_as(references[algo], four)
    assert_same_as(references[algo], two)
    assert sorted(os.listdir(two)) == sorted(os.listdir(references[algo]))
    summary = json.load(open(os.path.join(two, 'summary.json')))
    assert summary['seeds'] == list(range(3, 11))


@pytest.mark.parametrize('algo, victim', [('dqn', 1), ('pg', 0)])
def test_kill_9_of_one_process_then_rerun_resumes_bitwise(algo, victim, references, cache_dir,
                                                          tmp_path):
    """kill -9 of one process mid-run: the other stops by itself with one line;
    rerunning both resumes from the last checkpoint and ends bitwise equal to
    the uninterrupted run. DQN's is also resumed on 1 process x 1 device (the
    checkpoint is the same whatever the process count): equal too."""
    out = str(tmp_path / 'run')
    metrics = os.path.join(out, 'metrics.jsonl')
    with processes(algo, cache_dir, [*SEEDS, '--quiet', '--output-dir', out]) as started:
        deadline = time.time() + TIMEOUT
        while time.time() < deadline and started[0].poll() is None:  # epoch 2's 8 lines
            if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 16:
                break
            time.sleep(0.01)
        assert started[0].poll() is None, 'the run ended before the kill; make epochs longer'
        started[victim].send_signal(signal.SIGKILL)
        survivor = started[1 - victim]
        _, err = survivor.communicate(timeout=120)  # it must not hang
        assert survivor.returncode != 0
        # Its own line; when process 0 dies, JAX's coordination client (a thread
        # of its own) may also log, or abort the survivor first.
        assert 'lost contact with another process' in err or 'another task died' in err, err
    saved_epoch = rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch']
    assert 1 <= saved_epoch < 4
    if algo == 'dqn':  # the checkpoint does not depend on the process count
        alone = str(tmp_path / 'resumed_alone')
        shutil.copytree(out, alone)
        run_one(algo, cache_dir, [*SEEDS, '--quiet', '--output-dir', alone])
        assert_same_as(references[algo], alone)

    (status_0, _, err_0), (status_1, _, err_1) = run_two(
        algo, cache_dir, [*SEEDS, '--quiet', '--output-dir', out])
    assert status_0 == 0 and status_1 == 0, err_0[-2000:] + err_1[-2000:]
    assert_same_as(references[algo], out)


# ---------------------------------------------------------------------------
# Bad input: one line on stderr, exit status 2, nothing written.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('flags, needle', [
    (['--coordinator-address', '127.0.0.1:1234', '--num-processes', '2', '--process-id', '2'],
     '--process-id must be in [0, 2)'),
    (['--coordinator-address', '127.0.0.1:1234', '--num-processes', '2', '--process-id', '-1'],
     '--process-id must be in [0, 2)'),
    (['--num-processes', '2'], '--num-processes needs --coordinator-address'),
    (['--process-id', '0'], '--process-id needs --coordinator-address'),
    (['--coordinator-address', '127.0.0.1:1234'], 'needs --num-processes N and --process-id'),
    (['--coordinator-address', '127.0.0.1', '--num-processes', '2', '--process-id', '0'],
     'HOST:PORT'),
    (['--coordinator-address', '127.0.0.1:1234', '--num-processes', '2', '--process-id', '0',
      '--device', '0'], '--device'),
    (['--coordinator-address', '127.0.0.1:1234', '--num-processes', '0', '--process-id', '0'],
     '--num-processes must be >= 1'),
    (['--coordinator-timeout', '0'], '--coordinator-timeout'),
    (['--distributed', 'yes'], "invalid choice: 'yes'"),
])
def test_bad_process_flags(flags, needle, tmp_path, capsys):
    import dqn
    out = str(tmp_path / 'run')
    with pytest.raises(SystemExit) as error:
        dqn.main([*flags, '--output-dir', out])
    assert error.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert not os.path.exists(out)


def test_nobody_answers_is_one_line_in_bounded_time(cache_dir, tmp_path):
    """No coordinator (process 1 alone), or not every process (process 0 alone),
    or no cluster for --distributed auto: one line, exit 2, within the timeout."""
    out = str(tmp_path / 'run')
    port = free_port()  # nobody listens there
    for index, needle in ((1, 'no coordinator answered at 127.0.0.1'),
                          (0, 'not all 2 processes connected')):
        start = time.time()
        result = subprocess.run(
            command('dqn', cache_dir, ['--output-dir', out, '--coordinator-address',
                                       f'127.0.0.1:{port}', '--num-processes', '2',
                                       '--process-id', str(index), '--coordinator-timeout', '3']),
            cwd=ROOT, env=environment(2), capture_output=True, text=True, timeout=120,
            start_new_session=True)
        assert time.time() - start < 60
        assert result.returncode == 2
        assert_one_line_error(result, needle, '--coordinator-timeout')
    result = subprocess.run(command('dqn', cache_dir, ['--output-dir', out, '--distributed',
                                                       'auto']),
                            cwd=ROOT, env=environment(2), capture_output=True, text=True,
                            timeout=120, start_new_session=True)
    assert result.returncode == 2
    assert_one_line_error(result, 'no cluster detected')
    assert not os.path.exists(out)


@pytest.mark.parametrize('per_process, flags, needle', [
    ([['--num-seeds', '8'], ['--num-seeds', '4', '--lr', '0.01']], [],
     'different flags: --lr, --num-seeds differ between process 0 and process(es) 1'),
    (None, ['--num-seeds', '6'], '6 run(s) do not divide evenly over the 4 devices'),
    ([['--cpu-devices', '2'], ['--cpu-devices', '1']], [],  # a reshape error before
     'the processes have different numbers of devices (process 0: 2, process 1: 1)'),
])
def test_processes_refuse_together(per_process, flags, needle, cache_dir, tmp_path):
    """Processes started with different flags (compared by hash), or runs that
    do not divide over the global devices: process 0 says it in one line,
    process 1 says nothing, both exit 2, nothing is written."""
    out = str(tmp_path / 'run')
    (status_0, out_0, err_0), (status_1, out_1, err_1) = run_two(
        'dqn', cache_dir, ['--output-dir', out, *flags], per_process=per_process)
    assert (status_0, status_1) == (2, 2), err_0 + err_1
    lines = err_0.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err_0
    assert out_0 == out_1 == err_1 == ''
    assert not os.path.exists(out)


def test_processes_must_see_the_same_saved_run(references, cache_dir, tmp_path):
    """Process 1 does not see the run process 0 resumes (here: the same relative
    --output-dir from another working dir; on hosts, a dir not shared): said
    once, by process 0; both exit 2, nothing written."""
    first, second = tmp_path / 'host0', tmp_path / 'host1'
    shutil.copytree(references['dqn'], first / 'run')
    second.mkdir()
    before = sorted(os.listdir(first / 'run'))
    (status_0, out_0, err_0), (status_1, out_1, err_1) = run_two(
        'dqn', cache_dir, [*SEEDS, '--quiet', '--output-dir', 'run'],
        cwds=[str(first), str(second)])
    assert (status_0, status_1) == (2, 2), err_0 + err_1
    lines = err_0.strip().splitlines()
    assert len(lines) == 1 and 'process(es) 1 do not find the saved run' in lines[0], err_0
    assert 'filesystem every process shares' in lines[0]
    assert out_0 == out_1 == err_1 == ''
    assert sorted(os.listdir(first / 'run')) == before and os.listdir(second) == []


def test_an_error_only_one_process_meets_stops_both(references, cache_dir, tmp_path):
    """Process 1's copy of the checkpoint has another state structure (an
    error only it meets, when restoring): it says so, process 0 repeats it,
    both stop with status 1 and nothing is written."""
    first, second = tmp_path / 'host0', tmp_path / 'host1'
    for host in (first, second):
        shutil.copytree(references['dqn'], host / 'run')
    path = second / 'run' / 'checkpoint.npz'
    header, leaves = rundir._read_checkpoint(str(path))
    header['paths'], leaves = header['paths'][:-1], leaves[:-1]
    arrays = {f'leaf_{i:05d}': leaf for i, leaf in enumerate(leaves)}
    arrays['header'] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(str(path), **arrays)
    before = sorted(os.listdir(first / 'run'))
    (status_0, out_0, err_0), (status_1, out_1, err_1) = run_two(
        'dqn', cache_dir, [*SEEDS, '--quiet', '--output-dir', 'run'],
        cwds=[str(first), str(second)])
    assert (status_0, status_1) == (1, 1), err_0 + err_1
    for err, prefix in ((err_0, 'dqn.py: error: process 1: '), (err_1, 'dqn.py: error: ')):
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(prefix), err
        assert 'different state structure' in lines[0]
    assert out_0 == out_1 == ''
    assert sorted(os.listdir(first / 'run')) == before


def test_distributed_auto_reads_slurm(cache_dir, tmp_path):
    """--distributed auto under (simulated) SLURM: JAX reads the process count,
    ids and coordinator from SLURM's variables; here 2 processes x 2 devices,
    which 6 runs do not divide: said once, by process 0."""
    # JAX derives the coordinator port from the job id: 61440 + job id % 4096.
    for port in range(61440 + os.getpid() % 4000, 65536):
        with socket.socket() as probe:
            try:
                probe.bind(('127.0.0.1', port))
                break
            except OSError:
                continue
    out = str(tmp_path / 'run')
    started = []
    try:
        for index in range(2):
            env = dict(environment(2), SLURM_JOB_ID=str(port - 61440 + 4096),
                       SLURM_STEP_NODELIST='127.0.0.1', SLURM_NTASKS='2',
                       SLURM_PROCID=str(index), SLURM_LOCALID=str(index))
            started.append(subprocess.Popen(
                command('dqn', cache_dir, ['--distributed', 'auto', '--num-seeds', '6',
                                           '--output-dir', out]),
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True))
        (status_0, out_0, err_0), (status_1, out_1, err_1) = finish(started)
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    assert (status_0, status_1) == (2, 2), err_0 + err_1
    assert err_0.strip() == ('dqn.py: error: 6 run(s) do not divide evenly over the 4 devices '
                             'of 2 processes; use a multiple of 4 runs (--num-seeds times the '
                             'grid points)'), err_0
    assert out_0 == out_1 == err_1 == ''
    assert not os.path.exists(out)


def test_readme_localhost_example_runs_as_written(cache_dir, tmp_path):
    """docs/usage.md's two-process block, run by bash in a fresh dir with `python`
    this interpreter; only the port is swapped for a free one (and the compile
    cache is the tests', by JAX_COMPILATION_CACHE_DIR)."""
    text = open(os.path.join(ROOT, 'docs', 'usage.md')).read()
    start = text.index('```bash\nfor i in 0 1; do\n')
    block = text[start + len('```bash\n'):text.index('```', start + 3)]
    assert '--coordinator-address 127.0.0.1:23456' in block and 'wait' in block
    block = block.replace('127.0.0.1:23456', f'127.0.0.1:{free_port()}')
    bin_dir = os.path.dirname(sys.executable)  # a virtualenv's bin has `python`
    for script in ('dqn.py', 'pg.py', 'actor_critic.py', 'common.py', 'fields.py', 'harness'):
        (tmp_path / script).symlink_to(os.path.join(ROOT, script))
    env = dict(environment(1), PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}',
               JAX_COMPILATION_CACHE_DIR=cache_dir)
    del env['XLA_FLAGS']  # the block sets it (the tests' compile options are dropped too)
    process = subprocess.Popen(['bash', '-c', block], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 0 and err == '', err
    lines = out.splitlines()
    assert len(lines) == 3 and lines[-1].startswith('done: 8 run(s)'), out
    summary = json.load(open(tmp_path / 'runs' / 'two_processes' / 'summary.json'))
    assert summary['seeds'] == list(range(8)) and summary['epochs'] == 2
