"""Speed figures for dqn.py, pg.py and actor_critic.py on CartPole-v1 (not collected by pytest).

    python tests/benchmark.py                 # full table, medians of 3 runs
    python tests/benchmark.py --repeats 1 --seeds 1,8 --algos dqn

For each algorithm: cold compile seconds, env steps per second while
collecting and over the whole training loop, the env-only ceiling (a random-
action gymnax rollout with the same number of envs, compiled the same way) and
the ratio, wall seconds (process start, compile included) until every seed's
greedy return is >= 475, and the cost of N seeds relative to 1 (vmap scaling),
with the peak resident memory of each run. Each run is a fresh process with
the persistent compile cache off, so compile time is always counted.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLVED = 475.0


def run_once(algo, seeds, extra):
    """One fresh training process -> its figures."""
    out = tempfile.mkdtemp(prefix=f'bench_{algo}_')
    command = [sys.executable, os.path.join(ROOT, f'{algo}.py'), '--quiet', '--compile-cache',
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
    epochs = sorted({r['epoch'] for r in records})
    key = summary['final_eval_key']
    solved_at = None
    for epoch in epochs:
        rows = [r for r in records if r['epoch'] == epoch]
        if all((r.get(key) or 0) >= SOLVED for r in rows):
            solved_at = rows[0]['timing/since_start']
            break
    first = [r for r in records if r['run'] == 0]
    collect_s = sum(r['timing/collect'] for r in first)
    train_s = sum(r['timing/epoch'] for r in first)
    steps = sum(summary['env_steps_per_seed'])
    return {
        'wall': wall,
        'compile': summary['compile_s'],
        'collect_sps': steps / collect_s,
        'loop_sps': steps / train_s,
        'loop_s': train_s,
        'solved_wall': None if solved_at is None else solved_at + (wall - summary['wall_s']),
        'final_min': min(summary['final_eval_return']),
        'peak_mib': usage.ru_maxrss / 1024,
    }


def env_ceiling(n_envs, seeds, steps, repeats):
    """Random-action CartPole rollout, seeds x n_envs envs, steps per second."""
    import jax
    import jax.numpy as jnp
    import gymnax
    env, params = gymnax.make('CartPole-v1')

    def rollout(key):
        obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, n_envs), params)

        def step(carry, key):
            state, total = carry
            action_key, step_key = jax.random.split(key)
            action = jax.random.randint(action_key, (n_envs,), 0, 2)
            _, state, reward, _, _, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(step_key, n_envs), state, action, params)
            return (state, total + reward.sum()), None

        (_, total), _ = jax.lax.scan(step, (state, 0.0), jax.random.split(key, steps))
        return total

    keys = jax.random.split(jax.random.PRNGKey(0), seeds)
    run = jax.jit(jax.vmap(rollout)).lower(keys).compile()
    jax.block_until_ready(run(keys))
    times = []
    for _ in range(repeats):
        start = time.time()
        jax.block_until_ready(run(keys))
        times.append(time.time() - start)
    return seeds * n_envs * steps / statistics.median(times)


def median(rows, name):
    values = [row[name] for row in rows if row[name] is not None]
    return statistics.median(values) if values else None


def fmt(value, spec='.1f'):
    return 'n/a' if value is None else format(value, spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--algos', default='dqn,pg',
                        help='comma list of dqn, pg, actor_critic')
    parser.add_argument('--seeds', default='1,8,64', help='seed counts to measure')
    parser.add_argument('--repeats', type=int, default=3, help='runs per figure (median)')
    parser.add_argument('--extra', default='', help='extra flags for every script')
    args = parser.parse_args()
    seed_counts = [int(s) for s in args.seeds.split(',')]
    import jax
    print(f'# machine: {os.cpu_count()} CPU cores, JAX {jax.__version__} on '
          f'{jax.devices()[0].device_kind}; medians of {args.repeats} runs')
    print('| algo | seeds | wall s | compile s | collect steps/s | loop steps/s | '
          'env-only steps/s | loop/env-only | wall to >=475 s | final min | vs 1 seed | '
          'peak MiB |')
    print('|' + '---|' * 12)
    sys.path.insert(0, ROOT)
    for algo in args.algos.split(','):
        config = __import__(algo).Config()
        if config.n_interactions_per_epoch:
            n_envs, steps = config.n_envs, config.n_interactions_per_epoch // config.n_envs
        else:  # complete CartPole episodes of at most 500 steps
            n_envs, steps = config.n_trajectories_per_epoch, 500
        base = None
        for seeds in seed_counts:
            rows = [run_once(algo, seeds, args.extra.split()) for _ in range(args.repeats)]
            loop = median(rows, 'loop_s')
            base = base or loop
            ceiling = env_ceiling(n_envs, seeds, steps * 10, args.repeats)
            loop_sps = median(rows, 'loop_sps')
            print(f'| {algo} | {seeds} | {fmt(median(rows, "wall"))} | '
                  f'{fmt(median(rows, "compile"))} | {fmt(median(rows, "collect_sps"), ".3g")} | '
                  f'{fmt(loop_sps, ".3g")} | {fmt(ceiling, ".3g")} | '
                  f'{fmt(loop_sps / ceiling, ".3f")} | {fmt(median(rows, "solved_wall"))} | '
                  f'{fmt(median(rows, "final_min"), ".0f")} | {fmt(loop / base, ".2f")}x | '
                  f'{fmt(median(rows, "peak_mib"), ".0f")} |', flush=True)


if __name__ == '__main__':
    main()
