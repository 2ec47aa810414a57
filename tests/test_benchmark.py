"""tests/benchmark.py's GPU suite (issue 38): its pure helpers against hand
values, and `--suite gpu --smoke` run end to end on CPU, as CI runs it, so
the one-command GPU run cannot rot before a GPU is found. No timing asserts.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import benchmark  # noqa: E402

GREEDY = 'rl/avg_return_temperature0.00_steps500'


def test_latest_greedy_takes_the_latest_epoch_evaluated_on_every_seed():
    records = [
        {'epoch': 1, 'run': 0, 'rl/n_interactions': 10.0, GREEDY: 20.0},
        {'epoch': 1, 'run': 1, 'rl/n_interactions': 10.0, GREEDY: 30.0},
        {'epoch': 2, 'run': 1, 'rl/n_interactions': 20.0, GREEDY: 50.0},
        {'epoch': 2, 'run': 0, 'rl/n_interactions': 20.0, GREEDY: 40.0},
        {'epoch': 3, 'run': 0, 'rl/n_interactions': 30.0},  # not evaluated (--time-limit stop)
        {'epoch': 3, 'run': 1, 'rl/n_interactions': 30.0},
    ]
    assert benchmark.latest_greedy(records, GREEDY) == (2, 20.0, [40.0, 50.0])
    records[2][GREEDY] = float('nan')  # one seed's NaN: that epoch does not count
    assert benchmark.latest_greedy(records, GREEDY) == (1, 10.0, [20.0, 30.0])
    assert benchmark.latest_greedy(records[4:], GREEDY) is None
    assert benchmark.latest_greedy(records, None) is None  # a run without evaluation


def test_time_share():
    assert benchmark.time_share(40, [40, 120], 1000) == 40  # time enough: its own limit
    assert benchmark.time_share(40, [40, 120], 100) == 20  # 100 s for 200 s of limits
    assert benchmark.time_share(120, [], 50) == 50  # the last run gets what is left


def test_ppo_flags_drop_the_value_trainer_under_joint():
    flags = ('--env X --value-lr 5e-4 --batch-size 1024 --value-batch-size=1024 '
             '--value-train-steps-per-epoch 32 --value-evals-per-epoch 2')
    assert benchmark.ppo_flags(flags, joint='') == flags
    assert benchmark.ppo_flags(flags, joint='--joint') == '--env X --batch-size 1024 --joint'


def test_failed_run_keeps_the_table_shape():
    failed = benchmark.gpu_run_line({'case': 'x', 'seeds': 1, 'error': 'a\nRESOURCE_EXHAUSTED'})
    assert 'failed: RESOURCE_EXHAUSTED' in failed
    assert failed.count('|') == benchmark.GPU_RUN_HEADER.count('|')


def test_gpu_suite_smoke(tmp_path):
    """--suite gpu --smoke on CPU: every case's run and the scan timing, in
    gpu.json and gpu.md."""
    subprocess.run([sys.executable, str(TESTS / 'benchmark.py'), '--suite', 'gpu', '--smoke',
                    '--out', str(tmp_path)], check=True, timeout=600)
    report = json.loads((tmp_path / 'gpu.json').read_text())
    assert report['suite'] == 'gpu' and report['smoke']
    assert report['machine']['backend'] == 'cpu' and report['machine']['jax']
    assert report['commit']
    cases = benchmark.gpu_cases()
    want = [(case.name, seeds) for case in cases
            for seeds in (benchmark.SMOKE_SEEDS if len(case.seeds) > 1 else case.seeds)]
    assert [(row['case'], row['seeds']) for row in report['runs']] == want
    for row in report['runs']:
        assert 'error' not in row, row['error']
        assert row['epochs'] == row['epochs_asked'] >= 1
        assert row['wall'] > 0 and row['compile'] > 0 and row['sps'] > 0
        assert row['steps_per_seed'] > 0 and math.isfinite(row['greedy_iqm'])
        kept = tmp_path / 'runs' / f'{row["case"]}-{row["seeds"]}'
        assert json.loads((kept / 'summary.json').read_text())['epochs'] == row['epochs']
    assert [(s['estimator'], s['batch'], s['time']) for s in report['scans']] == [
        (name, *shape) for name in ('td_lambda', 'gae') for shape in benchmark.SMOKE_SCAN_SHAPES]
    assert all(s['sequential_ms'] > 0 and s['associative_ms'] > 0 for s in report['scans'])
    md = (tmp_path / 'gpu.md').read_text()
    assert benchmark.GPU_RUN_HEADER in md and benchmark.SCAN_HEADER in md
    assert report['commit'] in md
    for row in report['runs']:
        assert benchmark.gpu_run_line(row) in md
    assert '| td_lambda | 64 x 16 |' in md and '| gae | 64 x 16 |' in md


def test_docs_have_the_gpu_rows_and_the_command_that_fills_them():
    doc = (TESTS.parent / 'docs' / 'benchmarks.md').read_text()
    assert 'python tests/benchmark.py --suite gpu --out' in doc
    assert benchmark.GPU_RUN_HEADER in doc and benchmark.SCAN_HEADER in doc
    for case in benchmark.gpu_cases():
        for seeds in case.seeds:
            assert f'| {case.name} | {seeds} |' in doc
    for batch, length in benchmark.SCAN_SHAPES:
        assert f'| gae | {batch} x {length} |' in doc
