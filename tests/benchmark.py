"""Speed figures for dqn.py and actor_critic.py (PPO), CartPole and MinAtar (not collected by pytest).

    python tests/benchmark.py                          # every case, 1, 8 and 64 seeds, medians of 3
    python tests/benchmark.py --cases dqn-cartpole --seeds 1,8 --repeats 1
    python tests/benchmark.py --cases ppo-purejaxrl --seeds 8 \
        --peer 'cd ../peers && .venv/bin/python run_ppo.py --num-seeds 8'

Each run is a fresh process, as a user runs it (checkpoints, TensorBoard and
evaluation at their defaults), with the persistent compile cache off, so
compile time is always counted. Per case and seed count: wall seconds, compile
seconds, env steps per second of the whole run with compile included and
excluded, wall seconds until every seed's greedy return is >= 475 (CartPole),
the worst seed's final greedy return, the cost of N seeds relative to 1 (the
training loop, compile excluded) and peak resident memory. MinAtar cases run
a few epochs only (--minatar-epochs): a speed figure, not a learning one.
`--peer CMD` times a shell command (a peer's run of the same work, e.g.
PureJaxRL's ppo.py) after each repeat, in turn with ours, and prints the
ratio of the medians.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLVED = 475.0
# PureJaxRL ppo.py's own CartPole-v1 config (4 envs x 128 steps, 976 updates =
# 5e5 steps, 4 passes of 4 minibatches of 128, GAE 0.95, clip 0.2, entropy
# 0.01, grad norm 0.5) in our flags, with the learning rates that make every
# seed of 0-7 and 8-15 reach 500 (docs/actor_critic.md).
PUREJAXRL_PPO = ('--n-envs 4 --n-interactions-per-epoch 512 --epochs 976 '
                 '--train-steps-per-epoch 16 --batch-size 128 --value-train-steps-per-epoch 16 '
                 '--value-batch-size 128 --lr 1e-4 --value-lr 1e-3 --entropy-coeff 0.01 '
                 '--max-grad-norm 0.5 --lambda 0.95 --epsilon 0.2 --adam-b1 0.9 --adam-b2 0.999 '
                 '--adam-eps 1e-5 --advantage-estimator gae --added-policy-slice-length 128')
# The same work with --joint (separate torsos, one loss and one Adam, as
# PureJaxRL): PureJaxRL's own lr 2.5e-4 and value coefficient 0.5, and the
# value network predicting V * (1 - gamma), without which its critic at that
# lr left 1-2 of 8 seeds stuck near 230 (docs/benchmarks.md).
PUREJAXRL_PPO_JOINT = ('--joint --n-envs 4 --n-interactions-per-epoch 512 --epochs 976 '
                       '--train-steps-per-epoch 16 --batch-size 128 --lr 2.5e-4 '
                       '--entropy-coeff 0.01 --value-loss-coeff 0.5 --max-grad-norm 0.5 '
                       '--lambda 0.95 --epsilon 0.2 --adam-eps 1e-5 --advantage-estimator gae '
                       '--added-policy-slice-length 128 --scale-value-targets')
CASES = {  # name: (script, flags)
    'dqn-cartpole': ('dqn', ''),
    'ppo-cartpole': ('actor_critic', ''),
    'ppo-purejaxrl': ('actor_critic', PUREJAXRL_PPO),
    'ppo-purejaxrl-joint': ('actor_critic', PUREJAXRL_PPO_JOINT),
    'dqn-breakout': ('dqn', '--env Breakout-MinAtar'),
    'ppo-breakout': ('actor_critic', '--env Breakout-MinAtar'),
}


def run_once(script, seeds, extra):
    """One fresh training process -> its figures."""
    out = tempfile.mkdtemp(prefix=f'bench_{script}_')
    command = [sys.executable, os.path.join(ROOT, f'{script}.py'), '--quiet', '--compile-cache',
               'none', '--num-seeds', str(seeds), '--output-dir', out, *extra]
    start = time.time()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.time() - start
    if status != 0:
        raise SystemExit(f'{" ".join(command)} failed:\n{process.stderr.read().decode()}')
    summary = json.load(open(os.path.join(out, 'summary.json')))
    records = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
    key = summary['final_eval_key']
    solved_at = None
    for epoch in sorted({r['epoch'] for r in records}):
        rows = [r for r in records if r['epoch'] == epoch]
        if all((r.get(key) or 0) >= SOLVED for r in rows):
            solved_at = rows[0]['timing/since_start']
            break
    steps = sum(summary['env_steps_per_seed'])
    loop_s = summary['wall_s'] - summary['compile_s']
    return {
        'wall': wall,
        'compile': summary['compile_s'],
        'sps': steps / wall,
        'sps_no_compile': steps / loop_s,
        'loop_s': loop_s,
        'solved_wall': None if solved_at is None else solved_at + (wall - summary['wall_s']),
        'final_min': min(summary['final_eval_return']),
        'peak_mib': usage.ru_maxrss / 1024,
    }


def run_peer(command):
    start = time.time()
    subprocess.run(command, shell=True, check=True, stdout=subprocess.DEVNULL)
    return time.time() - start


def median(rows, name):
    values = [row[name] for row in rows if row[name] is not None]
    return statistics.median(values) if values else None


def fmt(value, spec='.1f'):
    return 'n/a' if value is None else format(value, spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--cases', default=','.join(CASES), help='comma list of ' + ', '.join(CASES))
    parser.add_argument('--seeds', default='1,8,64', help='seed counts to measure')
    parser.add_argument('--repeats', type=int, default=3, help='runs per figure (median)')
    parser.add_argument('--minatar-epochs', type=int, default=6, help='epochs of a MinAtar case')
    parser.add_argument('--extra', default='', help='extra flags for every script')
    parser.add_argument('--peer', default=None, help='a shell command to time beside each case')
    args = parser.parse_args()
    seed_counts = [int(s) for s in args.seeds.split(',')]
    import jax
    print(f'# machine: {os.cpu_count()} CPU cores, JAX {jax.__version__} on '
          f'{jax.devices()[0].device_kind}; medians of {args.repeats} runs')
    print('| case | seeds | wall s | compile s | steps/s | steps/s without compile | '
          'wall to >=475 s | final min | loop vs 1 seed | peak MiB | peer wall s | ours/peer |')
    print('|' + '---|' * 12)
    for case in args.cases.split(','):
        script, flags = CASES[case]
        extra = shlex.split(flags) + shlex.split(args.extra)
        if 'MinAtar' in flags:
            extra += ['--epochs', str(args.minatar_epochs)]
        base = None
        for seeds in seed_counts:
            rows, peer = [], []
            for _ in range(args.repeats):
                rows.append(run_once(script, seeds, extra))
                if args.peer:
                    peer.append(run_peer(args.peer))
            loop = median(rows, 'loop_s')
            base = base or loop
            peer_wall = statistics.median(peer) if peer else None
            ratio = None if peer_wall is None else median(rows, 'wall') / peer_wall
            print(f'| {case} | {seeds} | {fmt(median(rows, "wall"))} | '
                  f'{fmt(median(rows, "compile"))} | {fmt(median(rows, "sps"), ".4g")} | '
                  f'{fmt(median(rows, "sps_no_compile"), ".4g")} | '
                  f'{fmt(median(rows, "solved_wall"))} | {fmt(median(rows, "final_min"), ".0f")} | '
                  f'{fmt(loop / base, ".2f")}x | {fmt(median(rows, "peak_mib"), ".0f")} | '
                  f'{fmt(peer_wall)} | {fmt(ratio, ".2f")} |', flush=True)


if __name__ == '__main__':
    main()
