"""tests/stats.py (IQM, stratified bootstrap intervals) and tests/results.py
(run dirs -> docs/results.json -> results.md, results.png, README's block).
Nothing is trained here: the run dirs are written by hand, as the CLI does."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402
import stats  # noqa: E402

ROOT = results.ROOT


# --- the IQM ---------------------------------------------------------------

def test_iqm_of_eight_values_is_the_mean_of_the_middle_four():
    # sorted 1..8; int(0.25 * 8) = 2 cut from each end: (3 + 4 + 5 + 6) / 4 = 4.5
    assert stats.iqm([8, 1, 7, 2, 6, 3, 5, 4]) == 4.5
    # sorted -50, 1, 2, 3, 4, 5, 6, 100: the outliers are cut, (2 + 3 + 4 + 5) / 4 = 3.5
    assert stats.iqm([100, -50, 1, 2, 3, 4, 5, 6]) == 3.5


def test_iqm_of_counts_not_divisible_by_four_cuts_as_trim_mean():
    # 10 values: int(2.5) = 2 cut from each end, the middle 6 kept:
    # sorted 0..8, 1000 -> 2, 3, 4, 5, 6, 7 -> 27 / 6 = 4.5
    assert stats.iqm([1000, *range(9)]) == 4.5
    # 7 values: int(1.75) = 1 cut from each end: 1, 2, 3, 4, 5 -> 3
    assert stats.iqm([70, 0, 1, 2, 3, 4, 5]) == 3
    # 5 values: int(1.25) = 1: sorted -10, 1, 2, 3, 10 -> (1 + 2 + 3) / 3 = 2
    assert stats.iqm([10, 1, 2, 3, -10]) == 2
    # 3 values: int(0.75) = 0, nothing cut: (1 + 2 + 9) / 3 = 4
    assert stats.iqm([1, 9, 2]) == 4
    scipy_stats = pytest.importorskip('scipy.stats')
    values = np.random.default_rng(0).normal(size=(6, 13))
    for n in range(1, 14):
        np.testing.assert_allclose(stats.iqm(values[:, :n]),
                                   scipy_stats.trim_mean(values[:, :n], 0.25, axis=1))


def test_iqm_along_an_axis():
    scores = np.array([[8, 1, 7, 2, 6, 3, 5, 4], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(stats.iqm(scores), [4.5, 1])
    np.testing.assert_array_equal(stats.iqm(scores.T, axis=0), [4.5, 1])


# --- the intervals ---------------------------------------------------------

def coverage(draw_tasks, truth, datasets=500, seed=0):
    """Share of `datasets` synthetic datasets whose 95% interval holds `truth`."""
    rng = np.random.default_rng(seed)
    hits = 0
    for index in range(datasets):
        _, low, high = stats.iqm_interval(draw_tasks(rng), reps=1000, seed=index)
        hits += low <= truth <= high
    return hits / datasets


def test_interval_covers_the_true_iqm_about_95_percent_of_the_time():
    # Exponential(1): quartiles a = ln(4/3), b = ln 4; the IQM is the mean of
    # x between them, 2 * integral_a^b x e^-x dx = 2 [(a + 1) e^-a - (b + 1) e^-b].
    a, b = np.log(4 / 3), np.log(4)
    truth = 2 * ((a + 1) * 0.75 - (b + 1) * 0.25)  # 0.7384
    assert abs(stats.iqm(np.random.default_rng(1).exponential(size=10**6)) - truth) < 0.005
    share = coverage(lambda rng: [rng.exponential(size=32)], truth)
    assert 0.90 <= share <= 0.985, share


def test_stratified_interval_covers_the_pooled_iqm_about_95_percent_of_the_time():
    # Three tasks of other shapes, scales and seed counts; the truth: the IQM of
    # a huge sample with the same share of each task.
    draws = [lambda rng, n: rng.normal(size=n), lambda rng, n: 3 * rng.exponential(size=n),
             lambda rng, n: rng.uniform(1, 2, size=n)]
    counts = [16, 32, 12]
    big = np.random.default_rng(123)
    truth = stats.iqm(np.concatenate([draw(big, n * 50000) for draw, n in zip(draws, counts)]))
    share = coverage(lambda rng: [draw(rng, n) for draw, n in zip(draws, counts)], truth)
    assert 0.90 <= share <= 0.985, share


def test_the_bootstrap_resamples_each_task_within_itself():
    tasks = [np.arange(4.0), 100 + np.arange(6.0)]
    draws = stats.stratified_resample(tasks, 500, np.random.default_rng(0))
    assert draws.shape == (500, 10)
    assert np.isin(draws[:, :4], tasks[0]).all() and np.isin(draws[:, 4:], tasks[1]).all()
    # Two constant tasks of 4 seeds each: every stratified resample has four 0s
    # and four 10s, IQM (0 + 0 + 10 + 10) / 4 = 5, so the interval is [5, 5];
    # resampling the 8 seeds together would move it.
    assert stats.iqm_interval([np.zeros(4), np.full(4, 10.0)]) == (5, 5, 5)
    pooled = np.concatenate([np.zeros(4), np.full(4, 10.0)])
    together = stats.iqm(pooled[np.random.default_rng(0).integers(0, 8, (500, 8))])
    assert together.min() < 5 < together.max()


def test_a_constant_sample_has_a_zero_width_interval():
    assert stats.iqm_interval([np.full(32, 3.5)]) == (3.5, 3.5, 3.5)
    middle, low, high = stats.curve_band(np.full((5, 8), 2.0))
    for band in (middle, low, high):
        np.testing.assert_array_equal(band, np.full(5, 2.0))


def test_curve_band_is_per_evaluation_point():
    curve = np.random.default_rng(0).normal(size=(7, 16)) + np.arange(7)[:, None]
    middle, low, high = stats.curve_band(curve)
    assert middle.shape == low.shape == high.shape == (7,)
    assert (low <= middle).all() and (middle <= high).all() and (low < high).all()
    np.testing.assert_array_equal(middle, stats.iqm(curve, axis=1))


def test_normalised_scores():
    np.testing.assert_allclose(stats.normalised([20, 500, 260], 20, 500), [0, 1, 0.5])


# --- the row table ---------------------------------------------------------

def test_the_row_table():
    rows = results.row_table()
    assert len({row.id for row in rows}) == len(rows)
    cartpole = [row.command for row in rows if row.group == 'CartPole commands']
    assert cartpole == ['python dqn.py', 'python pg.py', 'python pg.py --torso gru',
                        'python actor_critic.py', 'python actor_critic.py --policy-loss a2c',
                        'python actor_critic.py --policy-loss awr',
                        'python actor_critic.py --joint',
                        'python actor_critic.py --joint --shared-torso']
    assert all(row.plain for row in rows if row.group == 'CartPole commands')
    import dqn
    assert results.ROWS['pqn-Breakout-MinAtar'].command == 'python dqn.py --env Breakout-MinAtar'
    pqn = results.row_config(results.ROWS['pqn-Breakout-MinAtar'])  # --env's: PQN's recipe
    assert {name: pqn[name] for name in dqn.PQN_MINATAR} == {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in dqn.PQN_MINATAR.items()}
    memory = {row.env: results.BASELINES[row.env] for row in rows if row.group == 'memory'}
    assert memory == {'MemoryChain-bsuite': 1, 'MetaMaze-misc': 32,
                      'BernoulliBandit-misc': 90, 'PointRobot-misc': 10}
    configs = {row.id: results.row_config(row) for row in rows}  # each command is valid
    assert all(configs[row.id]['env'] == row.env for row in rows)
    for game in ('Breakout', 'SpaceInvaders'):  # flags, or the env's settings where PPO wins
        config = configs[f'ppo-{game}-MinAtar']
        assert (config['hidden_sizes'], config['epochs'], config['gamma']) == (
            [256, 256], 1221, 0.999)
    assert results.ROWS['ppo-SpaceInvaders-MinAtar'].command == \
        'python actor_critic.py --env SpaceInvaders-MinAtar'
    assert configs['ppo-MemoryChain-bsuite']['torso'] == 'gru'  # the env's settings apply


# --- run: the command in process, plain or not -----------------------------

def test_run_script_runs_the_command_as_typed_and_plain_drops_the_options(tmp_path):
    out = tmp_path / 'seen.json'
    script = tmp_path / 'probe.py'
    script.write_text(f'import json, sys\nimport common\nwith open({str(out)!r}, "w") as f:\n'
                      '    json.dump([sys.argv[1:], common.compiler_options()], f)\n'
                      'sys.exit(3)\n')
    options = results.common.compiler_options
    assert results.run_script([str(script), '--a', '1'], plain=False) == 3
    assert json.loads(out.read_text()) == [['--a', '1'], options()]
    assert results.run_script([str(script)], plain=True) == 3
    assert json.loads(out.read_text()) == [[], None]
    assert results.common.compiler_options is options


# --- report: run dirs -> results.json -> the documents ---------------------

MACHINE = {'cpu': 'Test CPU', 'cores': 2, 'jax': '0.0', 'commit': 'abcdef1234567',
           'dirty': False, 'devices': '1 x cpu (cpu)'}


def write_run(directory, row_id, seeds, curve, epochs_run=None, plain=False, info=True):
    """A CLI output dir of the row's command, as far as `epochs_run` (default:
    all its epochs): config.json; metrics.jsonl, 100 steps an epoch, with
    the greedy evaluations `curve` [points][seeds] spread evenly up to the
    last epoch run; summary.json if every epoch ran; `run`'s row.json."""
    row = results.ROWS[row_id]
    os.makedirs(directory)
    config = {**results.row_config(row), 'seed': seeds[0], 'num_seeds': len(seeds)}
    epochs_run = epochs_run or config['epochs']
    evaluated = {epochs_run * (i + 1) // len(curve): returns for i, returns in enumerate(curve)}
    key = results.common.return_tag(0.0, 500)
    with open(os.path.join(directory, 'config.json'), 'w') as f:
        json.dump(config, f)
    with open(os.path.join(directory, 'metrics.jsonl'), 'w') as f:
        for epoch in range(1, epochs_run + 1):
            for run, seed in enumerate(seeds):
                record = {'epoch': epoch, 'run': run, 'seed': seed,
                          'rl/n_interactions': 100.0 * epoch, 'timing/since_start': 2.0 * epoch}
                if epoch in evaluated:
                    record[key] = evaluated[epoch][run]
                f.write(json.dumps(record) + '\n')
    if epochs_run == config['epochs']:
        with open(os.path.join(directory, 'summary.json'), 'w') as f:
            json.dump({'final_eval_key': key, 'final_eval_return': curve[-1], 'wall_s': 12.5,
                       'compile_s': 4.0}, f)
    if info:
        with open(os.path.join(directory, 'row.json'), 'w') as f:
            json.dump({'id': row_id, 'plain': plain, 'machine': MACHINE, 'load_start': 1.5,
                       'load_end': 2.5, 'start': '2026-01-01T00:00:00+00:00',
                       'end': '2026-01-01T00:01:00+00:00', 'exit_status': 0}, f)
    return directory


@pytest.fixture
def paths(tmp_path):
    """Scratch paths for `report`; results.json starts with the random returns
    cached (so nothing compiles) and README with an empty block."""
    paths = {name: str(tmp_path / name) for name in ('results.json', 'results.md',
                                                     'results.png', 'README.md')}
    paths['runs'] = str(tmp_path / 'runs')
    random = {env: {'return': value, 'episodes': 256, 'seed': 0}
              for env, value in (('CartPole-v1', 20.0), ('Catch-bsuite', -0.6))}
    with open(paths['results.json'], 'w') as f:
        json.dump({'format': results.FORMAT, 'rows': {}, 'random': random}, f)
    with open(paths['README.md'], 'w') as f:
        f.write(f'# x\n\nbefore\n\n{results.BEGIN}\nold\n{results.END}\n\nafter\n')
    return paths


def report(paths, *extra):
    results.main(['report', '--runs', paths['runs'], '--json', paths['results.json'],
                  '--md', paths['results.md'], '--png', paths['results.png'],
                  '--readme', paths['README.md'], *extra])


def contents(paths):
    names = ('results.json', 'results.md', 'results.png', 'README.md')
    return {name: open(paths[name], 'rb').read() if os.path.exists(paths[name]) else None
            for name in names}


def cartpole_curve(seeds, final):
    return [[100.0 + seed for seed in range(seeds)], [final + seed for seed in range(seeds)]]


def test_report_writes_the_documents_and_rewrites_them_byte_for_byte(paths):
    runs = paths['runs']
    write_run(f'{runs}/cartpole-dqn', 'cartpole-dqn', list(range(1000, 1008)),
              cartpole_curve(8, 492.0))
    write_run(f'{runs}/cartpole-dqn--plain', 'cartpole-dqn', list(range(1000, 1008)),
              cartpole_curve(8, 300.0), plain=True)
    write_run(f'{runs}/dqn-Catch-bsuite', 'dqn-Catch-bsuite', list(range(1000, 1004)),
              [[0.0] * 4, [1.0] * 4])
    report(paths)
    first = contents(paths)
    data = json.loads(first['results.json'])
    assert sorted(data['rows']) == ['cartpole-dqn', 'cartpole-dqn--plain', 'dqn-Catch-bsuite']
    row = data['rows']['cartpole-dqn']
    assert (row['seeds'], row['final'], row['complete']) == (
        list(range(1000, 1008)), [492.0 + s for s in range(8)], True)
    assert row['curve'] == {'epochs': [25, 50], 'steps': [2500, 5000],  # dqn.py: 50 epochs
                            'returns': cartpole_curve(8, 492.0)}
    assert (row['machine'], row['load'], row['wall_s']) == (MACHINE, [1.5, 2.5], 12.5)
    md = first['results.md'].decode()
    lines = md.splitlines()
    default = lines.index(next(line for line in lines if line.startswith('| `python dqn.py` |')))
    assert lines[default + 1].startswith('| `python dqn.py` (plain compile) |')
    # IQM of 492..499: int(0.25 * 8) = 2 cut each end, mean of 494..497 = 495.5; worst 492.
    assert '| 495.5 [' in lines[default] and 'worst >= 400: met |' in lines[default]
    assert 'worst >= 400: NOT MET |' in lines[default + 1]
    assert '| baseline 1: met |' in md
    readme = first['README.md'].decode()
    assert readme.startswith('# x\n\nbefore\n\n') and readme.endswith('\n\nafter\n')
    assert results.readme_block(data) in readme and 'old' not in readme
    shutil.rmtree(runs)  # a fresh machine: results.json alone
    report(paths)
    assert contents(paths) == first


def test_the_readme_block_names_each_minatar_agent_beside_the_baselines(paths):
    write_run(f'{paths["runs"]}/pqn-Breakout-MinAtar', 'pqn-Breakout-MinAtar', [1000, 1001],
              [[5.0, 6.0], [90.0, 94.0]])
    write_run(f'{paths["runs"]}/ppo-Breakout-MinAtar', 'ppo-Breakout-MinAtar', [1000, 1001],
              [[1.0, 2.0], [11.0, 12.0]])
    report(paths)
    readme = contents(paths)['README.md'].decode()
    line = next(line for line in readme.splitlines() if line.startswith('MinAtar at 10M'))
    assert line.startswith('MinAtar at 10M env steps, IQM over evaluation seeds 1000-1001: '
                           'PQN, `dqn.py`: Breakout 92.0 (worst 90.0); PPO (gymnax-blines), '
                           '`actor_critic.py`: Breakout 11.5 (worst 11.0); gymnax-blines\' own '
                           'PPO figures: Asterix 15.0, Breakout 28.0'), line


def test_report_refuses_tuning_seeds_and_writes_nothing(paths, capsys):
    write_run(f'{paths["runs"]}/cartpole-dqn', 'cartpole-dqn', list(range(4)),
              cartpole_curve(4, 500.0))
    before = contents(paths)
    with pytest.raises(SystemExit) as stop:
        report(paths)
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert error.count('\n') == 1 and 'seeds 0-3' in error and '>= 1000' in error
    assert contents(paths) == before


def test_report_refuses_a_dir_that_is_not_the_rows_command(paths, capsys):
    directory = write_run(f'{paths["runs"]}/x', 'cartpole-dqn', [1000, 1001],
                          cartpole_curve(2, 500.0), info=False)
    with pytest.raises(SystemExit) as stop:
        report(paths, '--add', f'dqn-Catch-bsuite={directory}')
    assert stop.value.code == 2 and 'not the command of row dqn-Catch-bsuite' in \
        capsys.readouterr().err


def test_report_keeps_rows_not_read_again_and_drops_the_old_layout(paths, tmp_path):
    with open(paths['results.json'], 'w') as f:
        json.dump([{'env': 'CartPole-v1', 'algo': 'dqn', 'seeds': list(range(8))}], f)
    write_run(f'{paths["runs"]}/cartpole-dqn', 'cartpole-dqn', [1000, 1001],
              cartpole_curve(2, 500.0))
    report(paths)  # the old rows go; CartPole's random return is computed and cached
    data = json.load(open(paths['results.json']))
    assert list(data['rows']) == ['cartpole-dqn'] and 'CartPole-v1' in data['random']
    shutil.rmtree(paths['runs'])
    write_run(f'{paths["runs"]}/cartpole-pg', 'cartpole-pg', [1000, 1001],
              cartpole_curve(2, 500.0))
    report(paths)
    assert sorted(json.load(open(paths['results.json']))['rows']) == ['cartpole-dqn',
                                                                      'cartpole-pg']


def test_report_adds_an_incomplete_dir_without_row_json(paths, tmp_path):
    directory = write_run(str(tmp_path / 'elsewhere'), 'cartpole-ppo', [1000, 1001],
                          cartpole_curve(2, 200.0), epochs_run=3, info=False)
    with open(os.path.join(directory, 'metrics.jsonl'), 'a') as f:
        f.write('{"epoch": 4, "ru')  # a writer's line, half written
    report(paths, '--add', f'cartpole-ppo={directory}')
    row = json.load(open(paths['results.json']))['rows']['cartpole-ppo']
    asked = results.row_config(results.ROWS['cartpole-ppo'])['epochs']
    assert (row['complete'], row['epochs'], row['epochs_asked'], row['final'],
            row['eval_epoch']) == (False, 3, asked, [200.0, 201.0], 3)
    assert row['recorded'].startswith('at report time') and row['load'] is None
    assert row['machine']['cores'] == os.cpu_count()
    md = open(paths['results.md']).read()
    assert '(run incomplete) |' in md
    assert f'`cartpole-ppo`: incomplete: 3 of {asked} epochs, 300' in md


# --- the committed documents are what docs/results.json gives --------------

def test_the_committed_documents_are_what_results_json_gives(tmp_path):
    """`report` with no runs folder (a fresh clone) rewrites docs/results.md,
    docs/results.png and README.md's block byte for byte from the committed
    docs/results.json alone: a hand edit of any of them fails here."""
    committed = {name: os.path.join(ROOT, path) for name, path in (
        ('results.json', 'docs/results.json'), ('results.md', 'docs/results.md'),
        ('results.png', 'docs/results.png'), ('README.md', 'README.md'))}
    scratch = {name: str(tmp_path / name) for name in committed}
    scratch['runs'] = str(tmp_path / 'no-runs')  # not there: results.json alone
    for name, path in committed.items():
        shutil.copyfile(path, scratch[name])
    report(scratch)
    assert contents(scratch) == contents(committed), (
        'docs/results.md, docs/results.png or README.md\'s results block differs from what '
        'docs/results.json gives: run `python tests/results.py report` (never edit them by hand)')


# --- the results tool keeps its data (issue 53, item 6) ---------------------

def refused(capsys, call, *needles):
    with pytest.raises(SystemExit) as stop:
        call()
    error = capsys.readouterr().err
    assert stop.value.code == 2 and error.count('\n') == 1 and 'Traceback' not in error, error
    for needle in needles:
        assert needle in error, error


@pytest.mark.parametrize('layout', [{'format': 3, 'rows': {'x': {}}}, {'format': '2', 'rows': {}},
                                    {'format': 2, 'rows': []}, {'format': 2, 'rows': {'x': 1}}])
def test_report_refuses_a_results_json_it_cannot_read_and_keeps_it(layout, paths, capsys):
    with open(paths['results.json'], 'w') as f:
        json.dump(layout, f)
    before = contents(paths)
    refused(capsys, lambda: report(paths), paths['results.json'], 'left as it is')
    assert contents(paths) == before


def test_report_reads_a_results_json_of_its_format_with_nothing_else(paths):
    with open(paths['results.json'], 'w') as f:
        json.dump({'format': results.FORMAT}, f)
    report(paths)
    assert json.load(open(paths['results.json']))['rows'] == {}


def test_report_refuses_a_row_json_without_plain_and_a_config_without_seeds(paths, capsys):
    directory = write_run(f'{paths["runs"]}/cartpole-dqn', 'cartpole-dqn', [1000, 1001],
                          cartpole_curve(2, 500.0))
    info = json.load(open(os.path.join(directory, 'row.json')))
    with open(os.path.join(directory, 'row.json'), 'w') as f:
        json.dump({k: v for k, v in info.items() if k != 'plain'}, f)
    refused(capsys, lambda: report(paths), 'row.json: no "plain"')
    with open(os.path.join(directory, 'row.json'), 'w') as f:
        json.dump(info, f)
    config = json.load(open(os.path.join(directory, 'config.json')))
    with open(os.path.join(directory, 'config.json'), 'w') as f:
        json.dump({**config, 'num_seeds': 0}, f)
    refused(capsys, lambda: report(paths), 'config.json: "seed" and "num_seeds"', 'got 1000 and 0')


def test_run_refuses_seeds_past_int32_or_too_many_and_an_unwritable_out(tmp_path, capsys):
    refused(capsys, lambda: results.main(['run', '--row', 'cartpole-dqn', '--seeds',
                                          '1000:3000000000']), 'at most 4096 seeds')
    (tmp_path / 'file').write_text('')
    refused(capsys, lambda: results.main(['run', '--row', 'cartpole-dqn', '--seeds', '1000:1002',
                                          '--out', str(tmp_path / 'file' / 'runs')]),
            '--out: cannot write')


def test_a_resumed_rows_wall_time_counts_every_session(paths):
    directory = write_run(f'{paths["runs"]}/cartpole-dqn', 'cartpole-dqn', [1000, 1001],
                          cartpole_curve(2, 500.0))
    info = json.load(open(os.path.join(directory, 'row.json')))
    earlier = {'start': '2026-01-01T00:00:00+00:00', 'end': '2026-01-01T00:10:00+00:00'}
    with open(os.path.join(directory, 'row.json'), 'w') as f:
        json.dump({**info, 'previous': [earlier]}, f)
    report(paths)
    row = json.load(open(paths['results.json']))['rows']['cartpole-dqn']
    assert (row['wall_s'], row['wall_known']) == (12.5 + 600, True)
    with open(os.path.join(directory, 'row.json'), 'w') as f:  # a session cut off: end unknown
        json.dump({**info, 'previous': [earlier, {'start': earlier['end'], 'end': None}]}, f)
    report(paths)
    row = json.load(open(paths['results.json']))['rows']['cartpole-dqn']
    assert (row['wall_s'], row['wall_known']) == (12.5 + 600, False)
    assert '| 612+ |' in open(paths['results.md']).read()  # 612.5 s, at least


def test_a_field_added_after_a_run_reads_as_its_default():
    """The runs landed before --activation, --init and --clip-value-loss lack
    them in config.json: as their defaults they are the row's command; another
    value is not."""
    row = results.ROWS['cartpole-a2c']
    config = results.row_config(row)
    old = {k: v for k, v in config.items() if k not in ('activation', 'init', 'clip_value_loss')}
    assert results.command_mismatches(row, old) == []
    assert results.command_mismatches(row, {**old, 'activation': 'tanh'}) == [
        'activation tanh (the row: relu)']
