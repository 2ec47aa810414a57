"""Behaviour unchanged (issue 36): record metrics.jsonl of a fixed set of short
commands, then check later code against that record, bitwise.

    python tests/record_metrics.py record DIR              # every case, into DIR
    python tests/record_metrics.py compare DIR [CASE ...]  # rerun, compare with DIR

Each case is a command line of the repo's CLI (dqn defaults, pg defaults,
PPO, A2C, AWR, GRU torsos, a conv MinAtar run, Box actions and gSDE, the
DQN estimators, a grid and 2 processes), kept short with --epochs and, where
the defaults are long, smaller sizes. Timing fields are dropped; every other
value must be equal (NaN equals NaN). Not collected by pytest.
"""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ('timing/', 'rl/n_interactions_per_second')
SMALL_AC = ['--n-envs', '4', '--n-interactions-per-epoch', '128', '--batch-size', '32',
            '--value-batch-size', '32', '--train-steps-per-epoch', '8',
            '--value-train-steps-per-epoch', '8']
MINATAR = ['--n-envs', '4', '--n-interactions-per-epoch', '64', '--n-eval-episodes', '2',
           '--eval-steps', '50']

CASES = {
    'dqn_defaults': ['dqn.py', '--epochs', '3'],
    'dqn_grid': ['dqn.py', '--epochs', '3', '--num-seeds', '2', '--lr', '1e-2,3e-3',
                 '--gamma', '0.99,0.9'],
    'dqn_td_lambda': ['dqn.py', '--epochs', '2', '--advantage-estimator', 'td_lambda',
                      '--num-seeds', '2'],
    'dqn_monte_carlo': ['dqn.py', '--epochs', '2', '--advantage-estimator', 'monte_carlo',
                        '--no-double-dqn', '--no-smoothl1loss'],
    'dqn_minatar_conv': ['dqn.py', '--env', 'Breakout-MinAtar', '--epochs', '2',
                         '--train-steps-per-epoch', '8', *MINATAR],
    'pg_defaults': ['pg.py', '--epochs', '3', '--num-seeds', '2'],
    'pg_gru': ['pg.py', '--torso', 'gru', '--epochs', '2', '--n-trajectories-per-epoch', '4'],
    'pg_box_interactions': ['pg.py', '--env', 'Pendulum-v1', '--epochs', '2',
                            '--n-interactions-per-epoch', '256', '--n-trajectories-per-epoch',
                            'none', '--batch-size', '64', '--n-eval-episodes', '2'],
    'ppo': ['actor_critic.py', '--epochs', '2', '--num-seeds', '2'],
    'a2c': ['actor_critic.py', '--policy-loss', 'a2c', '--epochs', '2'],
    'awr': ['actor_critic.py', '--policy-loss', 'awr', '--epochs', '3', *SMALL_AC],
    'ppo_gru': ['actor_critic.py', '--env', 'MemoryChain-bsuite', '--epochs', '2'],
    'ppo_gsde': ['actor_critic.py', '--env', 'MountainCarContinuous-v0', '--epochs', '2',
                 *SMALL_AC, '--n-eval-episodes', '2'],
    'ppo_minatar_conv': ['actor_critic.py', '--env', 'Breakout-MinAtar', '--epochs', '1',
                         *MINATAR, '--batch-size', '32', '--value-batch-size', '32',
                         '--train-steps-per-epoch', '2', '--value-train-steps-per-epoch', '2'],
    'dqn_2_processes': ['dqn.py', '--epochs', '2', '--num-seeds', '4'],  # see run_case
}
PROCESSES = {'dqn_2_processes': 2}


def free_port():
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return probe.getsockname()[1]


def run_case(name, out, cache):
    """Run case `name` with --output-dir out; raise if it fails."""
    script, *argv = CASES[name]
    base = [sys.executable, os.path.join(ROOT, script), *argv, '--output-dir', out, '--quiet',
            '--no-tensorboard', '--compile-cache', cache]
    env = dict(os.environ)
    count = PROCESSES.get(name)
    if not count:
        result = subprocess.run(base, capture_output=True, text=True, env=env, timeout=900)
        if result.returncode:
            raise RuntimeError(f'{name} failed:\n{result.stderr[-3000:]}')
        return
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2')
    address = f'127.0.0.1:{free_port()}'
    procs = [subprocess.Popen(base + ['--coordinator-address', address, '--num-processes',
                                      str(count), '--process-id', str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(count)]
    try:
        errors = [proc.communicate(timeout=900)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f'{name} failed:\n' + '\n'.join(e[-2000:] for e in errors))


def records(path):
    """metrics.jsonl's records without the timing fields."""
    with open(path) as f:
        return [{key: value for key, value in json.loads(line).items()
                 if not key.startswith(TIMING)} for line in f]


def same(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def differences(want, got):
    """Where two record lists differ (at most a few), [] if bitwise equal."""
    if len(want) != len(got):
        return [f'{len(got)} records, recorded {len(want)}']
    found = []
    for old, new in zip(want, got):
        for key in sorted(old):  # a field added since the record (a new sweep field) aside
            if not same(old.get(key), new.get(key)):
                found.append(f'epoch {old.get("epoch")} run {old.get("run")} {key}: '
                             f'{new.get(key)!r}, recorded {old.get(key)!r}')
    return found[:5]


def main(argv):
    if len(argv) < 2 or argv[0] not in ('record', 'compare'):
        sys.exit(__doc__)
    mode, directory, names = argv[0], argv[1], argv[2:] or list(CASES)
    cache = os.path.join(tempfile.gettempdir(), 'record_metrics_cache')
    failed = 0
    for name in names:
        work = tempfile.mkdtemp(prefix=f'{name}-')
        try:
            run_case(name, os.path.join(work, 'run'), cache)
            got = os.path.join(work, 'run', 'metrics.jsonl')
            recorded = os.path.join(directory, f'{name}.jsonl')
            if mode == 'record':
                os.makedirs(directory, exist_ok=True)
                shutil.copy(got, recorded)
                print(f'{name}: recorded {len(records(got))} records', flush=True)
                continue
            found = differences(records(recorded), records(got))
            failed += bool(found)
            print(f'{name}: ' + ('same' if not found else 'DIFFERS\n  ' + '\n  '.join(found)),
                  flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
