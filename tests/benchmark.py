"""Speed figures for dqn.py and actor_critic.py (PPO), CartPole and MinAtar (not collected by pytest).

    python tests/benchmark.py                          # every case, 1, 8 and 64 seeds, medians of 3
    python tests/benchmark.py --cases dqn-cartpole --seeds 1,8 --repeats 1
    python tests/benchmark.py --cases ppo-purejaxrl --seeds 8 \
        --peer 'cd ../peers && .venv/bin/python run_ppo.py --num-seeds 8'
    python tests/benchmark.py --suite gpu --out DIR          # the GPU rows, <= 9 min
    python tests/benchmark.py --suite gpu --out DIR --smoke  # the same on CPU, about 1 min

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

`--suite gpu` (issue 38) writes DIR/gpu.json and DIR/gpu.md in at most 9
minutes on one GPU: the device, jax version and commit; CartPole DQN and PPO
at 1, 64 and 1024 seeds; Breakout-MinAtar PQN (dqn.PQN_MINATAR) and PPO
(gymnax-blines' config) towards 10M steps for one seed, as far as the time
allows; and the lambda estimators' sequential against associative scan.
Each run is one process as above, under a --time-limit that shares out the
time left, and reports the env steps it reached and the IQM over seeds of
its latest greedy evaluation. A run that fails is recorded and the suite goes
on. `--smoke` runs the same code with tiny epochs and seeds on CPU (CI: it
cannot rot before a GPU is found). `--suite scans` is the scan timing alone
(JSON on stdout); the gpu suite runs it as a child so that its own process
never holds the accelerator.
"""

import argparse
import collections
import datetime
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # common.py, for the scan timing
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stats  # noqa: E402  (tests/stats.py: numpy only)
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


KILL_GRACE_S = 120  # a run is killed this long past its --time-limit


def run_once(script, seeds, extra, time_limit=None, keep=None):
    """One fresh training process -> its figures. With `time_limit` it stops
    within that many seconds (--time-limit, at an epoch's end; killed
    KILL_GRACE_S later); `keep`: a folder for its config, metrics and summary."""
    out = tempfile.mkdtemp(prefix=f'bench_{script}_')
    command = [sys.executable, os.path.join(ROOT, f'{script}.py'), '--quiet', '--compile-cache',
               'none', '--num-seeds', str(seeds), '--output-dir', out, *extra]
    if time_limit is not None:
        command += ['--time-limit', f'{time_limit:.0f}']
    start = time.time()
    # stderr to a file: a pipe nobody reads would block a chatty child.
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
        killer = threading.Timer(time_limit + KILL_GRACE_S, process.kill) if time_limit else None
        if killer:
            killer.start()
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = status  # reaped here (wait4 gives the peak memory)
        if killer:
            killer.cancel()
        wall = time.time() - start
        if status != 0:
            stderr.seek(0)
            shutil.rmtree(out, ignore_errors=True)
            raise SystemExit(f'{" ".join(command)} failed ({status}):\n'
                             f'{stderr.read().decode(errors="replace")[-4000:]}')
    summary = json.load(open(os.path.join(out, 'summary.json')))
    config = json.load(open(os.path.join(out, 'config.json')))
    records = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
    if keep:
        os.makedirs(keep, exist_ok=True)
        for name in ('config.json', 'metrics.jsonl', 'summary.json'):
            shutil.copy(os.path.join(out, name), keep)
    shutil.rmtree(out, ignore_errors=True)  # checkpoints: 1 GB at 1024 DQN seeds
    key = summary['final_eval_key']
    solved_at = None
    for epoch in sorted({r['epoch'] for r in records}):
        rows = [r for r in records if r['epoch'] == epoch]
        if all((r.get(key) or 0) >= SOLVED for r in rows):
            solved_at = rows[0]['timing/since_start']
            break
    steps = sum(summary['env_steps_per_seed'])
    loop_s = summary['wall_s'] - summary['compile_s']
    finals = [x for x in summary['final_eval_return'] if x is not None]
    greedy = latest_greedy(records, key)
    return {
        'wall': wall,
        'compile': summary['compile_s'],
        'sps': steps / wall,
        'sps_no_compile': steps / loop_s,
        'loop_s': loop_s,
        'solved_wall': None if solved_at is None else solved_at + (wall - summary['wall_s']),
        'final_min': min(finals) if finals else None,
        'peak_mib': usage.ru_maxrss / 1024,
        'epochs': summary['epochs'],
        'epochs_asked': config['epochs'],
        'steps_per_seed': steps / len(summary['env_steps_per_seed']),
        'greedy_iqm': None if greedy is None else float(stats.iqm(greedy[2])),
        'greedy_at_steps': None if greedy is None else greedy[1],
    }


def latest_greedy(records, key):
    """(epoch, env steps per seed, each seed's return) of the latest epoch
    whose metrics have `key` on every seed, else None: an epoch that is not
    evaluated lacks it, and a run stopped by --time-limit may end on one."""
    epochs = {}
    for record in records:
        epochs.setdefault(record['epoch'], {})[record['run']] = record
    for epoch in sorted(epochs, reverse=True):
        rows = [epochs[epoch][run] for run in sorted(epochs[epoch])]
        values = [row.get(key) for row in rows]
        if key and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            return epoch, rows[0].get('rl/n_interactions'), values
    return None


def run_peer(command):
    start = time.time()
    subprocess.run(command, shell=True, check=True, stdout=subprocess.DEVNULL)
    return time.time() - start


def median(rows, name):
    values = [row[name] for row in rows if row[name] is not None]
    return statistics.median(values) if values else None


def fmt(value, spec='.1f'):
    return 'n/a' if value is None else format(value, spec)


# ---------------------------------------------------------------------------
# --suite gpu (issue 38) and --suite scans
# ---------------------------------------------------------------------------

GPU_BUDGET_S = 540  # the whole suite, on one GPU
RUN_OVERHEAD_S = 10  # a run's start-up, final evaluation and writes, outside its --time-limit
MIN_RUN_S = 15  # a run with less time than this left is skipped
# The PPO entries run the joint actor-critic (one loss, one optimizer, as
# PureJaxRL and Trax's PPOJoint); '' here times the default two-network PPO.
PPO_JOINT = '--joint'
# The value network's own trainer; actor_critic.py refuses them under --joint,
# where the value trains in the policy's minibatch steps at --lr.
VALUE_TRAINER_FLAGS = ('--value-lr', '--value-batch-size', '--value-train-steps-per-epoch',
                       '--value-evals-per-epoch')
GPU_SEEDS, SMOKE_SEEDS = (1, 64, 1024), (2,)  # smoke: few processes (compile is most of it)
SCAN_SHAPES = ((1024, 16), (1024, 128), (4096, 128), (4096, 1024))  # batch x time
SMOKE_SCAN_SHAPES = ((64, 16),)
SCAN_SECONDS = 1.0  # per estimator, shape and scan: the big shapes are slow on CPU
GpuCase = collections.namedtuple('GpuCase', 'name script flags seeds limit_s smoke_flags')


def gpu_cases():
    """The suite's runs, in order. `limit_s`: each run's --time-limit when time
    is plentiful; `smoke_flags` (appended, so they win) shrink it for --smoke."""
    import results  # tests/results.py: the results table's gymnax-blines PPO flags
    minatar_smoke = '--epochs 1 --n-eval-episodes 4 --eval-every 1'
    return [
        GpuCase('dqn-cartpole', 'dqn', '', GPU_SEEDS, 40, '--epochs 2'),
        GpuCase('ppo-cartpole', 'actor_critic', ppo_flags(''), GPU_SEEDS, 40, '--epochs 2'),
        GpuCase('pqn-breakout-10M', 'dqn', '--env Breakout-MinAtar', (1,), 120, minatar_smoke),
        GpuCase('ppo-breakout-10M', 'actor_critic',
                ppo_flags(f'--env Breakout-MinAtar {results.PPO_BLINES}'), (1,), 120,
                minatar_smoke),
    ]


def ppo_flags(flags, joint=None):
    """A PPO entry's flags: `flags` and then `joint` (default PPO_JOINT);
    under --joint without VALUE_TRAINER_FLAGS (each with its value)."""
    joint = PPO_JOINT if joint is None else joint
    tokens, kept = shlex.split(flags), []
    while tokens:
        token = tokens.pop(0)
        if joint and token.split('=')[0] in VALUE_TRAINER_FLAGS:
            if '=' not in token:
                tokens.pop(0)
            continue
        kept.append(token)
    return shlex.join(kept + shlex.split(joint))


def time_share(limit, later_limits, left):
    """A run's --time-limit: its own `limit`, or less where it and the runs
    after it (`later_limits`) would not fit in `left` seconds; then each gets
    time in proportion to its limit."""
    return min(limit, left * limit / (limit + sum(later_limits)))


def scan_inputs(batch, length, seed=0):
    """Random estimator inputs [batch, length]: episode ends and discount-mask
    gaps (truncations) included."""
    import numpy as np
    rng = np.random.default_rng(seed)
    rewards, values = rng.normal(size=(2, batch, length)).astype(np.float32)
    return (rewards, rewards, values, rng.random((batch, length)) < 0.05,
            rng.random((batch, length)) > 0.02)


def time_scans(shapes, repeats):
    """Milliseconds a jitted call of td_lambda and gae takes (median of
    `repeats`, or of those that fit in SCAN_SECONDS; compile excluded),
    sequential and associative, per shape."""
    import jax
    import common
    rows = []
    for name in ('td_lambda', 'gae'):
        for batch, length in shapes:
            inputs = jax.device_put(scan_inputs(batch, length))
            row = {'estimator': name, 'batch': batch, 'time': length}
            for scan in ('sequential', 'associative'):
                call = jax.jit(getattr(common, name)(0.99, 0, 0.95, scan=scan))
                call(*inputs).block_until_ready()  # compile
                times = []
                while len(times) < repeats and sum(times) < SCAN_SECONDS:
                    start = time.perf_counter()
                    call(*inputs).block_until_ready()
                    times.append(time.perf_counter() - start)
                row[f'{scan}_ms'] = 1e3 * statistics.median(times)
            row['speedup'] = row['sequential_ms'] / row['associative_ms']
            rows.append(row)
    return rows


def machine():
    """The device and the jax version (the caller of --suite scans prints it)."""
    import jax
    return {'backend': jax.default_backend(), 'device': jax.devices()[0].device_kind,
            'device_count': jax.device_count(), 'jax': jax.__version__,
            'cpu_cores': os.cpu_count()}


def commit():
    """HEAD's hash (+dirty with uncommitted changes to tracked files), or 'unknown'."""
    def git(*args):
        result = subprocess.run(['git', *args], cwd=ROOT, capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else None
    head = git('rev-parse', 'HEAD')
    if head is None:
        return 'unknown'
    return head + ('+dirty' if git('status', '--porcelain', '--untracked-files=no') else '')


def child_scans(smoke):
    """--suite scans in a child process -> (machine, rows) or an error."""
    command = [sys.executable, os.path.abspath(__file__), '--suite', 'scans'] + (
        ['--smoke'] if smoke else [])
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return {'error': 'timed out'}, []
    if done.returncode != 0:
        return {'error': done.stderr[-4000:]}, []
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result['machine'], result['scans']


def run_gpu_suite(out, smoke):
    """Every run of gpu_cases() and the scan timing -> out/gpu.json, out/gpu.md."""
    start = time.time()
    deadline = start + GPU_BUDGET_S
    os.makedirs(out, exist_ok=True)
    device, scans = child_scans(smoke)
    print(f'# {device}\n{GPU_RUN_HEADER}', flush=True)
    plan = [(case, seeds) for case in gpu_cases()
            for seeds in (SMOKE_SEEDS if smoke and len(case.seeds) > 1 else case.seeds)]
    runs = []
    for index, (case, seeds) in enumerate(plan):
        later = [c.limit_s for c, _ in plan[index + 1:]]
        left = deadline - time.time() - RUN_OVERHEAD_S * (len(later) + 1)
        limit = time_share(case.limit_s, later, left)
        flags = shlex.split(case.flags) + (shlex.split(case.smoke_flags) if smoke else [])
        row = {'case': case.name, 'seeds': seeds, 'time_limit_s': round(limit),
               'command': shlex.join([f'{case.script}.py', '--num-seeds', str(seeds), *flags])}
        if limit < MIN_RUN_S:
            row['error'] = 'skipped: out of time'
        else:
            try:
                row.update(run_once(case.script, seeds, flags, time_limit=limit,
                                    keep=os.path.join(out, 'runs', f'{case.name}-{seeds}')))
            except SystemExit as failure:  # one failed run (e.g. out of memory) is one row
                row['error'] = str(failure)[-4000:]
        runs.append(row)
        print(gpu_run_line(row), flush=True)
    report = {'suite': 'gpu', 'smoke': smoke, 'date': datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec='seconds'), 'commit': commit(),
        'machine': device, 'budget_s': GPU_BUDGET_S, 'wall_s': time.time() - start,
        'runs': runs, 'scans': scans}
    with open(os.path.join(out, 'gpu.json'), 'w') as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, 'gpu.md'), 'w') as f:
        f.write(gpu_markdown(report))
    return report


GPU_RUN_HEADER = ('| case | seeds | wall s | compile s | steps/s | steps/s without compile | '
                  'env steps per seed | epochs done / asked | greedy IQM (at steps) | '
                  'time limit s | peak MiB |')
SCAN_HEADER = ('| estimator | batch x time | sequential ms | associative ms | '
               'sequential / associative |')


def gpu_run_line(row):
    """One markdown row of a gpu-suite run (its error, if it has one)."""
    if 'error' in row:
        first = row['error'].strip().splitlines()[-1] if row['error'].strip() else 'failed'
        return (f'| {row["case"]} | {row["seeds"]} | failed: {first[:120]} |' + ' |' * 8)
    greedy = ('n/a' if row['greedy_iqm'] is None
              else f'{row["greedy_iqm"]:.1f} ({row["greedy_at_steps"]:.4g})')
    return (f'| {row["case"]} | {row["seeds"]} | {fmt(row["wall"])} | {fmt(row["compile"])} | '
            f'{fmt(row["sps"], ".4g")} | {fmt(row["sps_no_compile"], ".4g")} | '
            f'{row["steps_per_seed"]:.4g} | {row["epochs"]} / {row["epochs_asked"]} | {greedy} | '
            f'{row["time_limit_s"]} | {fmt(row["peak_mib"], ".0f")} |')


def gpu_markdown(report):
    """gpu.md: the machine, then the runs' table and the scans' table."""
    device = report['machine']
    lines = [f'# tests/benchmark.py --suite gpu{" --smoke" if report["smoke"] else ""}', '',
             f'{report["date"]}, commit {report["commit"]}; device: '
             f'{device.get("device", "unknown")} ({device.get("backend", "?")}, '
             f'{device.get("device_count", "?")} device(s)), jax {device.get("jax", "?")}; '
             f'suite wall {report["wall_s"]:.0f} s of a {report["budget_s"]} s budget. '
             'Greedy IQM: over seeds, at the latest evaluation.', '',
             GPU_RUN_HEADER, '|' + '---|' * GPU_RUN_HEADER.count(' | ') + '---|']
    lines += [gpu_run_line(row) for row in report['runs']]
    lines += ['', 'Advantage estimators, one jitted call (median, compile excluded):', '',
              SCAN_HEADER, '|---|---|---|---|---|']
    if 'error' in device:
        lines.append(f'| failed: {device["error"].strip().splitlines()[-1][:120]} | | | | |')
    lines += [f'| {row["estimator"]} | {row["batch"]} x {row["time"]} | '
              f'{row["sequential_ms"]:.3f} | {row["associative_ms"]:.3f} | '
              f'{row["speedup"]:.2f}x |' for row in report['scans']]
    return '\n'.join(lines) + '\n'


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--cases', default=','.join(CASES), help='comma list of ' + ', '.join(CASES))
    parser.add_argument('--seeds', default='1,8,64', help='seed counts to measure')
    parser.add_argument('--repeats', type=int, default=3, help='runs per figure (median)')
    parser.add_argument('--minatar-epochs', type=int, default=6, help='epochs of a MinAtar case')
    parser.add_argument('--extra', default='', help='extra flags for every script')
    parser.add_argument('--peer', default=None, help='a shell command to time beside each case')
    parser.add_argument('--suite', default='speed', choices=('speed', 'gpu', 'scans'),
                        help='speed: the cases above; gpu: DIR/gpu.json and gpu.md (issue 38); '
                        'scans: the estimators\' scan timing alone, JSON on stdout')
    parser.add_argument('--out', default=None, help='--suite gpu: the folder it writes')
    parser.add_argument('--smoke', action='store_true',
                        help='--suite gpu / scans: tiny seeds, epochs and shapes (CPU, CI)')
    args = parser.parse_args()
    if args.suite == 'scans':
        shapes, repeats = (SMOKE_SCAN_SHAPES, 3) if args.smoke else (SCAN_SHAPES, 50)
        print(json.dumps({'machine': machine(), 'scans': time_scans(shapes, repeats)}))
        return
    if args.suite == 'gpu':
        if not args.out:
            parser.error('--suite gpu needs --out DIR')
        run_gpu_suite(args.out, args.smoke)
        return
    seed_counts = [int(s) for s in args.seeds.split(',')]
    # Asked of a child: in this process jax would reserve most of a GPU's
    # memory, which the runs below need.
    device = json.loads(subprocess.run(
        [sys.executable, os.path.abspath(__file__), '--suite', 'scans', '--smoke'], cwd=ROOT,
        check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])['machine']
    print(f'# machine: {os.cpu_count()} CPU cores, JAX {device["jax"]} on '
          f'{device["device"]}; medians of {args.repeats} runs')
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
