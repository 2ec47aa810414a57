"""Runs that survive: resume after kill -9, config mismatch, resume from the
saved config, only-eval, bad input, corrupt checkpoints, the NaN guard and
Ctrl-C, TensorBoard events, one writer per run dir, for both scripts.

Most tests run the scripts as subprocesses, because the behaviour under test
is the CLI's: exit status, one line on stderr, what is (not) written.
"""

import json
import os
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
from harness import cli  # noqa: E402
from harness import flags  # noqa: E402
from harness import rundir  # noqa: E402

# Small, fast configs; a few hundred ms per epoch so a kill lands mid-run.
SMALL = {
    'dqn': ['--n-envs', '4', '--n-interactions-per-epoch', '64', '--train-steps-per-epoch', '1024',
            '--batch-size', '32', '--n-eval-episodes', '2', '--eval-steps', '40',
            '--n-replay-epochs', '3', '--hidden-sizes', '16', '--checkpoint-every', '1'],
    'pg': ['--n-trajectories-per-epoch', '4', '--n-interactions-per-epoch', 'none',
           '--max-steps', '40', '--train-steps-per-epoch', '256', '--n-eval-episodes', '2',
           '--eval-steps', '40', '--hidden-sizes', '16', '--checkpoint-every', '1'],
}
# (--checkpoint-every 1: a checkpoint, a chunk and a progress line every epoch,
# so kills and signals land between epochs of a run of a few seconds.)
ALGOS = sorted(SMALL)
# actor_critic.py's AWR, whose replay of 3 epochs wraps in 5: in the kill -9 test
# only (not in SMALL, which other test files take as each script's sizes).
SIZES = {**SMALL, 'actor_critic': [
    '--policy-loss', 'awr', '--n-replay-epochs', '3', '--n-envs', '4',
    '--n-interactions-per-epoch', '64', '--train-steps-per-epoch', '256', '--batch-size', '32',
    '--value-train-steps-per-epoch', '256', '--value-batch-size', '32', '--hidden-sizes', '16',
    '--n-eval-episodes', '2', '--eval-steps', '40', '--checkpoint-every', '1']}
# PPO with the recurrent torso: GRU states carried across epochs and stored.
SIZES['actor_critic-gru'] = [
    '--torso', 'gru', '--gru-size', '8', '--max-slice-length', '8', '--n-envs', '4',
    '--n-interactions-per-epoch', '64', '--train-steps-per-epoch', '256', '--batch-size', '32',
    '--value-train-steps-per-epoch', '256', '--value-batch-size', '32', '--hidden-sizes', '16',
    '--n-eval-episodes', '2', '--eval-steps', '40', '--checkpoint-every', '1']
# --joint: one optimiser over both networks, no value trainer state; separate
# torsos (PPO, as PureJaxRL), and one shared torso with its GRU (A2C). 512
# steps an epoch: with no value steps, 256 let a run end before the kill.
JOINT = ['--n-envs', '4', '--n-interactions-per-epoch', '64', '--train-steps-per-epoch', '512',
         '--batch-size', '32', '--hidden-sizes', '16', '--n-eval-episodes', '2',
         '--eval-steps', '40', '--checkpoint-every', '1', '--joint']
SIZES['actor_critic-joint'] = JOINT
SIZES['actor_critic-shared'] = [*JOINT, '--shared-torso', '--policy-loss', 'a2c', '--torso',
                                'gru', '--gru-size', '8', '--max-slice-length', '8']
IGNORED = ('timing/', 'rl/n_interactions_per_second')


@pytest.fixture(scope='session')
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('xla_cache'))


def script(algo):
    return algo.split('-')[0]  # 'actor_critic-gru': actor_critic.py with other sizes


def run_script(algo, args, cache_dir, extra=(), check=None, **kwargs):
    command = [sys.executable, os.path.join(ROOT, f'{script(algo)}.py'), '--quiet',
               '--compile-cache', cache_dir, *SIZES[algo], *args, *extra]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300,
                            **kwargs)
    if check is not None:
        assert result.returncode == check, result.stderr[-2000:]
    return result


def metrics_without_timing(path):
    records = [json.loads(line) for line in open(path)]
    return [{k: v for k, v in r.items() if not k.startswith(IGNORED)} for r in records]


def checkpoint_leaves(path):
    header, leaves = rundir._read_checkpoint(path)
    return header['metadata'], leaves


def assert_one_line_error(result, *needles):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert 'Traceback' not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


class _ReferenceRuns(dict):
    """algo -> output dir of an uninterrupted 5-epoch run, made on first use."""

    def __init__(self, factory, cache_dir):
        super().__init__()
        self.factory, self.cache_dir = factory, cache_dir

    def __missing__(self, algo):
        out = str(self.factory.mktemp(f'{algo}_reference'))
        run_script(algo, ['--epochs', '5', '--output-dir', out, '--seed', '3'], self.cache_dir,
                   check=0)
        self[algo] = out
        return out


@pytest.fixture(scope='session')
def reference_runs(tmp_path_factory, cache_dir):
    return _ReferenceRuns(tmp_path_factory, cache_dir)


def test_a_finished_run_dir_holds_only_what_usage_md_lists(reference_runs):
    """Every name a finished run leaves (run.lock included: kept, and safe)
    is one docs/usage.md's run-directory list explains."""
    usage = open(os.path.join(ROOT, 'docs', 'usage.md')).read()
    listed = usage[usage.index('## Flags, output and the run directory'):]
    listed = listed[:listed.index('\n## ', 3)]
    names = sorted(os.listdir(reference_runs['dqn']))
    assert {'config.json', 'metrics.jsonl', 'checkpoint.npz', 'summary.json', 'run.lock'} <= set(names)
    for name in names:
        assert f'`{name}' in listed, (name, 'docs/usage.md does not say what it is')
    assert 'safe to leave and safe to delete' in listed


# ---------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('algo', [*ALGOS, 'actor_critic', 'actor_critic-gru',
                                  'actor_critic-joint', 'actor_critic-shared'])
def test_kill_9_then_resume_is_bitwise_identical(algo, reference_runs, cache_dir, tmp_path):
    out = str(tmp_path / 'run')
    command = [sys.executable, os.path.join(ROOT, f'{script(algo)}.py'), '--quiet', '--compile-cache',
               cache_dir, *SIZES[algo], '--epochs', '5', '--output-dir', out, '--seed', '3']
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    metrics_path = os.path.join(out, 'metrics.jsonl')
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:  # wait for epoch 2
        if os.path.exists(metrics_path) and sum(1 for _ in open(metrics_path)) >= 2:
            break
        time.sleep(0.01)
    assert process.poll() is None, 'run finished before it could be killed; make epochs longer'
    process.send_signal(signal.SIGKILL)
    process.wait()
    saved_epoch = rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch']
    assert 1 <= saved_epoch < 5

    run_script(algo, ['--epochs', '5', '--output-dir', out, '--seed', '3'], cache_dir, check=0)
    reference = reference_runs[algo]
    assert metrics_without_timing(os.path.join(out, 'metrics.jsonl')) == \
        metrics_without_timing(os.path.join(reference, 'metrics.jsonl'))
    resumed_meta, resumed = checkpoint_leaves(os.path.join(out, 'checkpoint.npz'))
    reference_meta, expected = checkpoint_leaves(os.path.join(reference, 'checkpoint.npz'))
    assert resumed_meta['epoch'] == reference_meta['epoch'] == 5
    chex.assert_trees_all_equal(resumed, expected, strict=True)  # names a differing leaf


@pytest.mark.parametrize('algo', ALGOS)
def test_resume_extends_to_total_epochs(algo, reference_runs, cache_dir, tmp_path):
    out = str(tmp_path / 'run')
    # The lr decay horizon defaults to --epochs and is pinned in the config, so
    # plan the 5-epoch schedule from the start to extend a 2-epoch run.
    run_script(algo, ['--epochs', '2', '--lr-decay-epochs', '5', '--output-dir', out,
                      '--seed', '3'], cache_dir, check=0)
    assert len({r['epoch'] for r in metrics_without_timing(os.path.join(out, 'metrics.jsonl'))}) == 2
    # --epochs is the total; changing it is harmless.
    run_script(algo, ['--epochs', '5', '--output-dir', out, '--seed', '3'], cache_dir, check=0)
    assert metrics_without_timing(os.path.join(out, 'metrics.jsonl')) == \
        metrics_without_timing(os.path.join(reference_runs[algo], 'metrics.jsonl'))
    summary = json.load(open(os.path.join(out, 'summary.json')))
    assert summary['epochs'] == 5
    # More epochs without pinning the decay horizon would change the schedule:
    # refused, saying which flag keeps it.
    result = run_script(algo, ['--epochs', '7', '--output-dir', out, '--seed', '3'], cache_dir)
    assert result.returncode == 2
    assert_one_line_error(result, 'decays to 0 over 5 epochs', '--lr-decay-epochs 5')


@pytest.mark.parametrize('algo', ALGOS)
def test_time_limit_stops_with_a_checkpoint_and_the_run_goes_on(algo, reference_runs, cache_dir,
                                                                tmp_path):
    """--time-limit below one epoch: one epoch, then a finished run's files; the
    same command without it goes on to the total, bitwise the uninterrupted run."""
    out = str(tmp_path / 'run')
    flags = ['--epochs', '5', '--output-dir', out, '--seed', '3']
    result = run_script(algo, [*flags, '--time-limit', '0.001'], cache_dir, check=0)
    assert result.stderr == ''
    assert rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch'] == 1
    assert json.load(open(os.path.join(out, 'summary.json')))['epochs'] == 1
    assert json.load(open(os.path.join(out, 'config.json')))['epochs'] == 5
    run_script(algo, flags, cache_dir, check=0)
    assert metrics_without_timing(os.path.join(out, 'metrics.jsonl')) == \
        metrics_without_timing(os.path.join(reference_runs[algo], 'metrics.jsonl'))
    assert json.load(open(os.path.join(out, 'summary.json')))['epochs'] == 5
    # A limit the run does not reach stops nothing.
    far = str(tmp_path / 'far')
    run_script(algo, ['--epochs', '2', '--output-dir', far, '--time-limit', '1e9'], cache_dir,
               check=0)
    assert json.load(open(os.path.join(far, 'summary.json')))['epochs'] == 2


@pytest.mark.parametrize('algo', ALGOS)
def test_resume_with_changed_config_is_refused(algo, reference_runs, cache_dir):
    out = reference_runs[algo]
    before = open(os.path.join(out, 'checkpoint.npz'), 'rb').read()
    result = run_script(algo, ['--epochs', '6', '--lr-decay-epochs', '5', '--output-dir', out, '--seed', '3',
                               '--hidden-sizes', '8', '--num-seeds', '2'], cache_dir)
    assert result.returncode == 2
    assert_one_line_error(result, 'hidden_sizes', 'num_seeds')
    result = run_script(algo, ['--epochs', '6', '--lr-decay-epochs', '5', '--output-dir', out, '--seed', '3',
                               '--env', 'Acrobot-v1'], cache_dir)
    assert_one_line_error(result, 'env')
    assert open(os.path.join(out, 'checkpoint.npz'), 'rb').read() == before


@pytest.mark.parametrize('algo', ALGOS)
def test_restored_trainer_step_is_validated(algo, reference_runs, cache_dir, tmp_path):
    import shutil
    out = str(tmp_path / 'run')
    shutil.copytree(reference_runs[algo], out)
    path = os.path.join(out, 'checkpoint.npz')
    header, leaves = rundir._read_checkpoint(path)
    index = [i for i, name in enumerate(header['paths']) if name.endswith('.train_step')][0]
    leaves[index] = leaves[index] + 1  # not at an epoch boundary any more
    arrays = {f'leaf_{i:05d}': leaf for i, leaf in enumerate(leaves)}
    arrays['header'] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(path, **arrays)
    result = run_script(algo, ['--epochs', '6', '--lr-decay-epochs', '5', '--output-dir', out, '--seed', '3'], cache_dir)
    assert_one_line_error(result, 'trainer step', 'epoch 5')


# ---------------------------------------------------------------------------
# only-eval
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('algo', ALGOS)
def test_only_eval_restores_and_never_writes_the_checkpoint(algo, reference_runs, cache_dir):
    out = reference_runs[algo]
    path = os.path.join(out, 'checkpoint.npz')
    before, mtime = open(path, 'rb').read(), os.stat(path).st_mtime_ns
    command = [sys.executable, os.path.join(ROOT, f'{algo}.py'), '--compile-cache', cache_dir,
               *SMALL[algo], '--epochs', '5', '--output-dir', out, '--seed', '3', '--only-eval']
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in open(os.path.join(out, 'eval.jsonl'))]
    assert records[-1]['epoch'] == 5
    greedy = records[-1]['rl/avg_return_temperature0.00_steps40']
    assert greedy is not None  # said as a run's result line is, not as a metric's key
    assert result.stdout.splitlines() == [
        f"evaluated epoch 5's parameters: 1 run(s), final greedy return {greedy:.1f}, wall "
        + result.stdout.split(', wall ')[1].rstrip('\n')]
    assert result.stdout.rstrip().endswith(f'results in {out}/eval.jsonl')
    assert open(path, 'rb').read() == before and os.stat(path).st_mtime_ns == mtime


@pytest.mark.parametrize('algo', ALGOS)
def test_only_eval_without_checkpoint_fails_cleanly(algo, cache_dir, tmp_path):
    out = str(tmp_path / 'empty')
    result = run_script(algo, ['--only-eval', '--output-dir', out], cache_dir)
    assert result.returncode == 2
    assert_one_line_error(result, 'no checkpoint')
    assert not os.path.exists(out)


# ---------------------------------------------------------------------------
# Bad input: one line, non-zero exit, nothing written
# ---------------------------------------------------------------------------

BAD_INPUT = [
    (['--env', 'NoSuchEnv-v0'], 'CartPole-v1'),
    (['--n-interactions-per-epoch', '64', '--n-trajectories-per-epoch', '4'], 'exactly one'),
    (['--n-interactions-per-epoch', 'none', '--n-trajectories-per-epoch', 'none'], 'exactly one'),
    (['--epochs', '0'], '--epochs'),
    (['--train-steps-per-epoch', '-3'], '--train-steps-per-epoch'),
    (['--train-steps-per-epoch', '10', '--evals-per-epoch', '3'], 'divisible'),
    (['--eval-steps', '10,0'], '--eval-steps'),
    (['--gamma', '1.5'], '--gamma'),
    (['--gamma', '0'], '--gamma'),
    (['--lr', 'fast'], '--lr'),
    (['--num-seeds', '0'], '--num-seeds'),
    (['--time-limit', '0'], '--time-limit'),
    (['--time-limit', 'soon'], '--time-limit'),
    (['--hidden-sizes', '16', '--epochs', '2,3'], '--epochs'),
]


@pytest.mark.parametrize('algo', ALGOS)
@pytest.mark.parametrize('flags,needle', BAD_INPUT, ids=[' '.join(f) for f, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_writes_nothing(algo, flags, needle, cache_dir, tmp_path,
                                                  capfd):
    """In-process (no JAX start-up per case): exit 2, one stderr line, no output dir."""
    import importlib
    module = importlib.import_module(algo)
    out = str(tmp_path / 'out')
    with pytest.raises(SystemExit) as exit_info:
        module.main(['--quiet', '--compile-cache', cache_dir, *SMALL[algo], '--epochs', '2',
                     '--output-dir', out, *flags])
    assert exit_info.value.code == 2
    captured = capfd.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], captured.err
    assert not os.path.exists(out)


def _main_exit(algo, argv, capfd):
    """Run a script's main in-process; (exit status, stderr lines)."""
    import importlib
    module = importlib.import_module(algo)
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    return exit_info.value.code, capfd.readouterr().err.strip().splitlines()


def test_cpu_devices_after_the_backend_started_is_one_line_status_2(cache_dir, tmp_path,
                                                                    capfd):
    """--cpu-devices cannot change a CPU backend that already runs (an in-process
    main after other JAX work): refused in one line, nothing written."""
    started = len(jax.devices('cpu'))
    out = str(tmp_path / 'out')
    status, lines = _main_exit('pg', ['--quiet', '--compile-cache', cache_dir, *SMALL['pg'],
                                      '--epochs', '2', '--output-dir', out,
                                      '--cpu-devices', str(started + 2)], capfd)
    assert status == 2
    assert len(lines) == 1 and f"already runs with {started} device(s)" in lines[0], lines
    assert not os.path.exists(out) and len(jax.devices('cpu')) == started


# The commands that once crashed, hung or traced back; each with its default
# config and --epochs 1, as first reported. Every one is refused before compiling.
FORMERLY_CRASHING = [
    ('dqn', ['--hidden-sizes', '0'], '--hidden-sizes entries must be >= 1'),
    ('dqn', ['--hidden-sizes', '-3'], '--hidden-sizes entries must be >= 1'),
    ('pg', ['--hidden-sizes', '0'], '--hidden-sizes entries must be >= 1'),
    ('dqn', ['--lr', 'nan'], '--lr must be a number'),
    ('dqn', ['--lr', 'inf'], '--lr must be finite'),
    ('pg', ['--entropy-coeff', 'nan'], '--entropy-coeff must be a number'),
    ('dqn', ['--eval-temperatures', 'nan'], '--eval-temperatures entries must be a number'),
    ('dqn', ['--exploration-decay-factor', '2'], '--exploration-decay-factor must be in (0, 1]'),
    ('dqn', ['--max-slice-length', '100000'], '--max-slice-length must be at most 33'),
    ('dqn', ['--num-seeds', '100000'], 'GiB'),
    ('dqn', ['--batch-size', '100000000'], 'GiB'),
    ('dqn', ['--train-steps-per-epoch', '1000000000'], 'GiB'),
    ('dqn', ['--n-replay-epochs', '4000000'], 'GiB'),  # 2.05e9 rows: within int32
    ('pg', ['--n-trajectories-per-epoch', '4000000'], 'GiB'),  # x 500 steps: within int32
    ('pg', ['--max-steps', '60000000'], 'GiB'),  # x 32 episodes: within int32
]


@pytest.mark.parametrize('algo,flags,needle', FORMERLY_CRASHING,
                         ids=[f'{a} ' + ' '.join(f) for a, f, _ in FORMERLY_CRASHING])
def test_formerly_crashing_values_are_refused_before_compiling(algo, flags, needle, cache_dir,
                                                               tmp_path, capfd):
    out = str(tmp_path / 'out')
    status, lines = _main_exit(algo, ['--quiet', '--compile-cache', cache_dir, '--epochs', '1',
                                      '--output-dir', out, *flags], capfd)
    assert status == 2
    assert len(lines) == 1 and needle in lines[0], lines
    if needle == 'GiB':  # says what needs how much, what is free, and what to lower
        assert 'available; lower' in lines[0] and '--num-seeds' in lines[0], lines[0]
    assert not os.path.exists(out)


# One case per kind of declared constraint (fields.option's bounds).
CONSTRAINT_CLASSES = [
    ('dqn', ['--epochs', '0'], '--epochs must be >= 1'),  # positive int
    ('dqn', ['--epochs', '3000000000'], '--epochs must be at most 2147483647'),  # int32
    ('dqn', ['--eval-steps', '10,0'], '--eval-steps entries must be >= 1'),  # tuple entries
    ('pg', ['--init-log-std', 'inf'], '--init-log-std must be finite'),  # finite float
    ('pg', ['--init-log-std', 'nan'], '--init-log-std must be a number'),
    ('dqn', ['--gamma', '1.5'], '--gamma must be in (0, 1]'),  # float in a range
    ('dqn', ['--exploration-minimum', '1.5'], '--exploration-minimum must be in [0, 1]'),
    ('dqn', ['--exploration-constant', '-0.1'], '--exploration-constant must be in [0, 1]'),
    ('dqn', ['--exploration-decay-factor', '0'], '--exploration-decay-factor must be in (0, 1]'),
    ('pg', ['--eval-temperatures', '-1'], '--eval-temperatures entries must be >= 0'),
    ('pg', ['--adam-b1', '1'], '--adam-b1 must be in [0, 1)'),
    ('pg', ['--batch-size', '-1'], '--batch-size must be >= 0'),
    ('dqn', ['--lr', '1e-3,nan'], '--lr must be a number'),  # every value of a sweep
    ('pg', ['--gamma', '0.9,0'], '--gamma must be in (0, 1]'),
    ('dqn', ['--num-seeds', '0'], '--num-seeds must be >= 1'),  # run flags
    ('pg', ['--seed', '-1'], '--seed must be in [0,'),
    ('dqn', ['--cpu-devices', '0'], '--cpu-devices must be in [1, 4096]'),
]


@pytest.mark.parametrize('algo,flags,needle', CONSTRAINT_CLASSES,
                         ids=[f'{a} ' + ' '.join(f) for a, f, _ in CONSTRAINT_CLASSES])
def test_each_constraint_class_is_one_line_status_2(algo, flags, needle, cache_dir, tmp_path,
                                                    capfd):
    out = str(tmp_path / 'out')
    status, lines = _main_exit(algo, ['--quiet', '--compile-cache', cache_dir, *SMALL[algo],
                                      '--epochs', '2', '--output-dir', out, *flags], capfd)
    assert status == 2
    assert len(lines) == 1 and needle in lines[0], lines
    assert not os.path.exists(out)


@pytest.mark.parametrize('algo', ALGOS)
def test_out_of_memory_from_xla_is_one_line_status_1_and_keeps_the_checkpoint(
        algo, reference_runs, cache_dir, tmp_path, capfd, monkeypatch):
    """The backstop behind check_memory: XLA's RESOURCE_EXHAUSTED (here raised
    when the train phase of a resumed run is traced) ends in one line."""
    import importlib
    import shutil
    module = importlib.import_module(algo)
    out = str(tmp_path / 'run')
    shutil.copytree(reference_runs[algo], out)
    before = open(os.path.join(out, 'checkpoint.npz'), 'rb').read()
    make_agent = module.make_agent

    def exhausted(hp, state):
        raise jax.errors.JaxRuntimeError(
            'RESOURCE_EXHAUSTED: Out of memory allocating 123456789 bytes.\nmore detail')

    def make_failing_agent(config, given=None):
        agent = make_agent(config, given)
        agent.train = exhausted
        return agent
    monkeypatch.setattr(module, 'make_agent', make_failing_agent)
    status, lines = _main_exit(algo, ['--quiet', '--compile-cache', cache_dir, *SMALL[algo],
                                      '--epochs', '6', '--lr-decay-epochs', '5', '--seed', '3',
                                      '--output-dir', out], capfd)
    assert status == 1
    assert len(lines) == 1 and 'out of memory: RESOURCE_EXHAUSTED' in lines[0], lines
    assert 'checkpoint' in lines[0]
    assert open(os.path.join(out, 'checkpoint.npz'), 'rb').read() == before


def test_dqn_refuses_continuous_actions(cache_dir, tmp_path):
    result = run_script('dqn', ['--env', 'Pendulum-v1', '--output-dir', str(tmp_path / 'o')],
                        cache_dir)
    assert result.returncode == 2
    assert_one_line_error(result, 'pg.py')


@pytest.mark.parametrize('algo', ALGOS)
def test_output_dir_that_is_a_file(algo, cache_dir, tmp_path):
    path = tmp_path / 'afile'
    path.write_text('keep me')
    result = run_script(algo, ['--epochs', '1', '--output-dir', str(path)], cache_dir)
    assert result.returncode == 2
    assert_one_line_error(result, 'not a directory')
    assert path.read_text() == 'keep me'
    result = run_script(algo, ['--epochs', '1', '--output-dir', str(path / 'sub')], cache_dir)
    assert result.returncode == 2
    assert_one_line_error(result, 'output-dir')


@pytest.mark.skipif(os.geteuid() == 0, reason='root can write to a read-only directory')
def test_output_dir_not_writable(cache_dir, tmp_path):
    path = tmp_path / 'ro'
    path.mkdir()
    path.chmod(0o500)
    result = run_script('dqn', ['--epochs', '1', '--output-dir', str(path)], cache_dir)
    assert_one_line_error(result, 'not writable')


@pytest.mark.parametrize('algo', ALGOS)
def test_truncated_checkpoint_is_reported_and_previous_survives(algo, reference_runs, cache_dir,
                                                                tmp_path):
    import shutil
    out = str(tmp_path / 'run')
    shutil.copytree(reference_runs[algo], out)
    path = os.path.join(out, 'checkpoint.npz')
    data = open(path, 'rb').read()
    open(path, 'wb').write(data[:len(data) // 2])
    previous = os.path.join(out, 'checkpoint.prev.npz')
    previous_bytes = open(previous, 'rb').read()
    result = run_script(algo, ['--epochs', '6', '--lr-decay-epochs', '5', '--output-dir', out, '--seed', '3'], cache_dir)
    assert result.returncode == 1
    assert_one_line_error(result, 'corrupt or truncated', 'checkpoint.prev.npz')
    assert open(previous, 'rb').read() == previous_bytes
    assert rundir.read_checkpoint_metadata(previous)['epoch'] == 4
    # Following the message's advice resumes from the previous checkpoint.
    os.replace(previous, path)
    run_script(algo, ['--epochs', '5', '--output-dir', out, '--seed', '3'], cache_dir, check=0)
    assert metrics_without_timing(os.path.join(out, 'metrics.jsonl')) == \
        metrics_without_timing(os.path.join(reference_runs[algo], 'metrics.jsonl'))


# ---------------------------------------------------------------------------
# NaN guard and Ctrl-C
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('algo', ALGOS)
def test_nan_guard_stops_and_keeps_last_good_checkpoint(algo, cache_dir, tmp_path, capsys):
    """A network that turns non-finite in epoch 3 stops the run; epoch 2's checkpoint stays."""
    import importlib
    import jax
    import jax.numpy as jnp
    module = importlib.import_module(algo)
    parser = flags.build_parser(module.Config, f'{algo}.py', '')
    out = str(tmp_path / 'run')
    args = parser.parse_args([*SMALL[algo], '--epochs', '4', '--output-dir', out, '--quiet',
                              '--compile-cache', cache_dir])
    config, grid = flags.config_and_grid(module.Config, args)

    def make_poisoned_agent(config, given=None):
        agent = module.make_agent(config, given)
        train = agent.train

        def poisoned_train(hp, state):
            state, metrics = train(hp, state)
            poison = jnp.where(state.epoch >= 3, jnp.nan, 1.0)
            return state._replace(params=jax.tree.map(lambda p: p * poison, state.params)), \
                metrics
        agent.train = poisoned_train
        return agent

    with pytest.raises(SystemExit) as exit_info:
        cli.run_experiment(make_poisoned_agent, config, grid, args, f'{algo}.py')
    assert exit_info.value.code == 1
    message = capsys.readouterr().err
    assert 'non-finite' in message and 'epoch 3' in message
    assert rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch'] == 2
    assert {r['epoch'] for r in map(json.loads, open(os.path.join(out, 'metrics.jsonl')))} == {1, 2}


@pytest.mark.parametrize('algo', ALGOS)
def test_ctrl_c_finishes_the_epoch_and_leaves_a_loadable_checkpoint(algo, reference_runs,
                                                                    cache_dir, tmp_path):
    out = str(tmp_path / 'run')
    command = [sys.executable, os.path.join(ROOT, f'{algo}.py'), '--quiet', '--compile-cache',
               cache_dir, *SIZES[algo], '--epochs', '5', '--output-dir', out, '--seed', '3']
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    metrics_path = os.path.join(out, 'metrics.jsonl')
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if os.path.exists(metrics_path) and sum(1 for _ in open(metrics_path)) >= 1:
            break
        time.sleep(0.01)
    assert process.poll() is None
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert 'Traceback' not in stderr and 'resume' in stderr
    epoch = rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch']
    assert 1 <= epoch < 5
    run_script(algo, ['--epochs', '5', '--output-dir', out, '--seed', '3'], cache_dir, check=0)
    assert metrics_without_timing(metrics_path) == \
        metrics_without_timing(os.path.join(reference_runs[algo], 'metrics.jsonl'))


# ---------------------------------------------------------------------------
# Resume from the saved config; TensorBoard; one writer per run dir
# ---------------------------------------------------------------------------


def quiet_result(result, start):
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), result.stdout
    assert '(best)' in lines[0] and 'results in ' in lines[0]


def run_bare(algo, args, cache_dir, **kwargs):
    """The script with only `args` (no SMALL sizes): what a user types to resume."""
    command = [sys.executable, os.path.join(ROOT, f'{algo}.py'), '--quiet',
               '--compile-cache', cache_dir, *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          **kwargs)


@pytest.mark.parametrize('algo', ALGOS)
def test_resume_takes_the_saved_config(algo, cache_dir, tmp_path, capfd):
    """--output-dir DIR --epochs N extends a run, and --output-dir DIR --only-eval
    evaluates it, with every other flag (grid and seeds too) taken from the save."""
    out = str(tmp_path / 'run')
    result = run_script(algo, ['--epochs', '2', '--lr-decay-epochs', '3', '--output-dir', out,
                               '--seed', '5', '--num-seeds', '2', '--gamma', '0.9,0.99',
                               '--no-tensorboard'], cache_dir, check=0)
    # --quiet: the result alone, one line, each grid point's figures in it.
    quiet_result(result, 'done: 4 run(s), final greedy return by grid point: --gamma 0.9: mean ')
    assert not os.path.exists(os.path.join(out, 'tb'))
    first = json.load(open(os.path.join(out, 'summary.json')))
    assert [(r['seed'], r['gamma']) for r in first['runs']] == \
        [(5, 0.9), (6, 0.9), (5, 0.99), (6, 0.99)]

    result = run_bare(algo, ['--output-dir', out, '--epochs', '3'], cache_dir)
    assert result.returncode == 0, result.stderr
    quiet_result(result, 'done: 4 run(s), final greedy return by grid point: --gamma 0.9: ')
    summary = json.load(open(os.path.join(out, 'summary.json')))
    assert [{k: p[k] for k in ('gamma', 'seeds')} for p in summary['points']] == [
        {'gamma': 0.9, 'seeds': 2}, {'gamma': 0.99, 'seeds': 2}]
    assert summary['epochs'] == 3 and summary['runs'] == first['runs']
    records = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
    assert sorted((r['epoch'], r['run']) for r in records) == \
        [(epoch, run) for epoch in (1, 2, 3) for run in range(4)]
    saved = rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))
    assert saved['epoch'] == 3 and saved['config']['grid'] == {'gamma': [0.9, 0.99]}
    # TensorBoard was off for the first part; the resumed run writes all of it.
    assert sorted(os.listdir(os.path.join(out, 'tb'))) == \
        sorted(f'gamma={g},seed={s}' for g in (0.9, 0.99) for s in (5, 6))

    result = run_bare(algo, ['--output-dir', out, '--only-eval'], cache_dir)
    assert result.returncode == 0, result.stderr
    quiet_result(result, "evaluated epoch 3's parameters: 4 run(s), final greedy return by "
                         'grid point: --gamma 0.9: ')
    evals = [json.loads(line) for line in open(os.path.join(out, 'eval.jsonl'))]
    assert [(r['epoch'], r['seed'], r['gamma']) for r in evals] == \
        [(3, 5, 0.9), (3, 6, 0.9), (3, 5, 0.99), (3, 6, 0.99)]

    # The same value given explicitly is no difference. Without --quiet a
    # resumed run says so, and the result has a line per grid point.
    result = subprocess.run([sys.executable, os.path.join(ROOT, f'{algo}.py'), '--compile-cache',
                             cache_dir, '--output-dir', out, '--gamma', '0.9,0.99', '--seed', '5'],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f'resumed {out} at epoch 3 of 3' in lines, lines
    assert lines[-3].startswith('done: 4 run(s), final greedy return by grid point below, ')
    assert lines[-2].startswith('  --gamma 0.9: mean ') and lines[-1].startswith('  --gamma 0.99:')

    # In-process from here (each is refused before compiling): a flag given with
    # another value is refused, naming it, and so is --epochs past the saved
    # learning-rate horizon, saying how to keep the schedule; nothing is written.
    import importlib
    module = importlib.import_module(algo)
    before = open(os.path.join(out, 'checkpoint.npz'), 'rb').read()
    for flags, needles in ((['--gamma', '0.5'], ['different config', 'gamma']),
                           (['--num-seeds', '3'], ['different config', 'num_seeds']),
                           (['--seed', '0'], ['different config', 'seed']),
                           (['--hidden-sizes', '8'], ['different config', 'hidden_sizes']),
                           (['--epochs', '4'], ['decays to 0 over 3 epochs',
                                                '--lr-decay-epochs 3'])):
        with pytest.raises(SystemExit) as exit_info:
            module.main(['--quiet', '--compile-cache', cache_dir, '--output-dir', out, *flags])
        assert exit_info.value.code == 2
        lines = capfd.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and all(needle in lines[0] for needle in needles), lines
    assert open(os.path.join(out, 'checkpoint.npz'), 'rb').read() == before


def read_events(directory, purge=True):
    """{tag: [(step, value)]} and the text summaries of one TensorBoard run
    directory, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(directory, size_guidance={'scalars': 0, 'tensors': 0},
                                   purge_orphaned_data=purge)
    accumulator.Reload()
    tags = accumulator.Tags()
    scalars = {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
               for tag in tags['scalars']}
    texts = {tag: [event.tensor_proto.string_val[0].decode()
                   for event in accumulator.Tensors(tag)] for tag in tags['tensors']}
    return scalars, texts


def assert_events_match_metrics(out, n_epochs):
    records = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
    runs = json.load(open(os.path.join(out, 'summary.json')))['runs']
    names = sorted(os.listdir(os.path.join(out, 'tb')))
    assert names == sorted(f'lr={format(r["lr"], "g")},seed={r["seed"]}' for r in runs)
    for index, run in enumerate(runs):
        directory = os.path.join(out, 'tb', f'lr={format(run["lr"], "g")},seed={run["seed"]}')
        assert len(os.listdir(directory)) == 1  # one event file, the old ones replaced
        scalars, texts = read_events(directory, purge=False)  # no reader-side de-duplication
        mine = sorted((r for r in records if r['run'] == index), key=lambda r: r['epoch'])
        assert [r['epoch'] for r in mine] == list(range(1, n_epochs + 1))
        tags = {tag for r in mine for tag, value in r.items()
                if value is not None and tag not in ('run', *run)}
        assert {'epoch', 'rl/avg_return', 'rl/n_interactions', 'timing/epoch',
                'timing/since_start', 'metrics/value_loss',
                'rl/avg_return_temperature0.00_steps40'} <= tags
        assert set(scalars) == tags
        for tag in tags:  # x: env steps per seed, an epoch's multiple (SMALL: 64 an epoch)
            want = [(64 * r['epoch'], float(np.float32(r[tag])))
                    for r in mine if r[tag] is not None]
            assert scalars[tag] == want, tag  # one value per step, that of metrics.jsonl
        assert scalars['rl/n_interactions'] == [(64 * r['epoch'], 64.0 * r['epoch']) for r in mine]
        [text] = texts['config/text_summary']
        assert f'| seed | {run["seed"]} |' in text and '| env | "CartPole-v1" |' in text


def test_tensorboard_events_match_metrics_and_a_resume_writes_no_duplicates(cache_dir,
                                                                           tmp_path):
    import shutil
    out = str(tmp_path / 'run')
    run_script('dqn', ['--epochs', '3', '--output-dir', out, '--lr', '1e-2,3e-3',
                       '--train-steps-per-epoch', '16'], cache_dir, check=0)
    assert_events_match_metrics(out, 3)
    # A crash after epoch 3's metrics and events, before its checkpoint: the
    # resumed run redoes epoch 3, and TensorBoard still holds one value per step.
    shutil.copy(os.path.join(out, 'checkpoint.prev.npz'), os.path.join(out, 'checkpoint.npz'))
    assert rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch'] == 2
    result = run_bare('dqn', ['--output-dir', out], cache_dir)
    assert result.returncode == 0, result.stderr
    assert_events_match_metrics(out, 3)


def start_long_run(algo, out, cache_dir):
    command = [sys.executable, os.path.join(ROOT, f'{algo}.py'), '--quiet', '--compile-cache',
               cache_dir, *SMALL[algo], '--epochs', '100000', '--output-dir', out]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    metrics_path = os.path.join(out, 'metrics.jsonl')
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:  # wait for epoch 1
        if os.path.exists(metrics_path) and os.path.getsize(metrics_path) > 0:
            break
        time.sleep(0.05)
    assert process.poll() is None, 'the first run ended early'
    return process


@pytest.mark.parametrize('algo', ALGOS)
def test_one_writer_per_run_dir_and_kill_9_leaves_no_lock(algo, cache_dir, tmp_path):
    out = str(tmp_path / 'run')
    process = start_long_run(algo, out, cache_dir)
    try:
        for flags in ([], ['--only-eval']):
            result = run_bare(algo, ['--output-dir', out, *flags], cache_dir)
            assert result.returncode == 2
            assert_one_line_error(result, f'another run (pid {process.pid}) is writing {out}')
        assert process.poll() is None  # the first run was not disturbed
    finally:
        process.kill()
        process.wait()
    # kill -9 leaves the lock file but no lock: the next run takes the dir over.
    assert os.path.exists(os.path.join(out, rundir.LOCK_FILE))
    result = run_bare(algo, ['--output-dir', out, '--only-eval'], cache_dir)
    assert result.returncode == 0, result.stderr
    epoch = rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch']
    result = run_bare(algo, ['--output-dir', out, '--epochs', str(epoch + 1)], cache_dir)
    assert result.returncode == 0, result.stderr
    assert json.load(open(os.path.join(out, 'summary.json')))['epochs'] == epoch + 1


def test_output_dir_lock_in_process(tmp_path):
    """The lock refuses a second holder even in the same process and is released
    when the block ends."""
    with rundir.output_dir_lock(str(tmp_path)):
        assert open(tmp_path / rundir.LOCK_FILE).read().strip() == str(os.getpid())
        with pytest.raises(common.UsageError, match=f'another run \\(pid {os.getpid()}\\)'):
            with rundir.output_dir_lock(str(tmp_path)):
                pass
    with rundir.output_dir_lock(str(tmp_path)):
        pass


def _without_checkpoint_every(argv):
    index = argv.index('--checkpoint-every')
    return argv[:index] + argv[index + 2:]


@pytest.mark.parametrize('seconds, saved', [(1e9, [5]), (0.0, [1, 2, 3, 4, 5])])
def test_checkpoints_follow_the_wall_clock_from_a_background_thread(seconds, saved, cache_dir,
                                                                    tmp_path, monkeypatch):
    """Without --checkpoint-every a checkpoint is due every CHECKPOINT_SECONDS
    (and at the last epoch), written by a thread other than the driver's."""
    import threading
    import dqn
    writes = []
    save = rundir.save_checkpoint

    def recording_save(path, state, metadata, previous=None):
        writes.append((metadata['epoch'], threading.current_thread() is threading.main_thread()))
        save(path, state, metadata, previous)
    monkeypatch.setattr(rundir, 'save_checkpoint', recording_save)
    monkeypatch.setattr(cli, 'CHECKPOINT_SECONDS', seconds)
    monkeypatch.setattr(cli, 'CHUNK_SECONDS', 0.0)  # a chunk per epoch
    out = str(tmp_path / 'run')
    dqn.main([*_without_checkpoint_every(SMALL['dqn']), '--epochs', '5', '--quiet',
              '--output-dir', out, '--compile-cache', cache_dir, '--no-tensorboard'])
    assert writes == [(epoch, False) for epoch in saved]
    assert rundir.read_checkpoint_metadata(os.path.join(out, 'checkpoint.npz'))['epoch'] == 5


def test_an_error_in_the_checkpoint_thread_reaches_the_driver(cache_dir, tmp_path, monkeypatch,
                                                              capsys):
    import errno
    import dqn

    def failing_save(path, state, metadata, previous=None):
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(rundir, 'save_checkpoint', failing_save)
    with pytest.raises(SystemExit) as stop:  # the driver's one line (tests/test_faults.py)
        dqn.main([*SMALL['dqn'], '--epochs', '2', '--quiet', '--output-dir',
                  str(tmp_path / 'run'), '--compile-cache', cache_dir, '--no-tensorboard'])
    assert stop.value.code == 1
    assert 'No space left on device (ENOSPC)' in capsys.readouterr().err
