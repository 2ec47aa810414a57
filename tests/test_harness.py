"""Tests of the experiment harness (harness/): atomic checkpoints (their
round trip, corruption and interrupted writes), Config fields as flags
(parsing, sweeps, bounds, --help), the progress line, TensorBoard run
names and the saved config on resume. No agent is compiled here.
"""

import dataclasses
import math
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple, Optional, Tuple

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402
import fields  # noqa: E402
from harness import cli  # noqa: E402
from harness import flags  # noqa: E402
from harness import rundir  # noqa: E402
import actor_critic as ac  # noqa: E402
import dqn  # noqa: E402
import pg  # noqa: E402

# ---------------------------------------------------------------------------
# Checkpoints.
# ---------------------------------------------------------------------------


class State(NamedTuple):
    params: list
    opt: dict
    key: object
    keys: object
    done: object
    step: object


def make_state(offset=0.0):
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, 3.4e38, 1.5 + offset],
                       np.float32)
    return State(
        params=[{'w': jnp.arange(12, dtype=jnp.float32).reshape(3, 4) + offset,
                 'b': jnp.asarray(special)},
                {'w': jnp.full((4, 2), -1.25 + offset, jnp.float32),
                 'b': np.zeros((2,), np.float32)}],
        opt={'count': jnp.int32(7 + int(offset)), 'mu': [np.float32(offset),
                                                         jnp.ones((2, 2), jnp.float32)]},
        key=jax.random.PRNGKey(42 + int(offset)),
        keys=jax.random.split(jax.random.PRNGKey(3), 5),
        done=np.array([True, False, True, True, False, bool(offset)]),
        step=np.int32(123 + int(offset)),
    )


METADATA = {
    'config': {'env': 'CartPole-v1', 'lr': 1e-3, 'grid': {'lr': [1e-3, 3e-4]},
               'max_steps': None, 'double_dqn': True, 'eval_steps': [200, 500]},
    'epoch': 3,
    'history': [{'epoch': 1, 'run': 0, 'rl/avg_return': 12.5, 'metrics/value_loss': None},
                {'epoch': 2, 'run': 0, 'rl/avg_return': 0.1 + 0.2}],
    'text': 'caf\u00e9 \u2192 ok',
}


def assert_trees_bitwise_equal(got, want):
    """chex.assert_trees_all_equal (structure, shapes, dtypes and values, naming the
    leaf that differs), then the bytes: exact equality still counts -0.0 as 0.0
    and any NaN as any other, and a checkpoint must give back the very bits."""
    chex.assert_trees_all_equal(got, want, strict=True)  # strict: dtypes too
    chex.assert_trees_all_equal_comparator(
        lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
        lambda a, b: f'equal values, different bytes: {a!r} vs {b!r}', got, want)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / 'checkpoint.npz'
    rundir.save_checkpoint(str(path), make_state(), METADATA)
    return path


def test_checkpoint_round_trip(ckpt):
    state = make_state()
    restored, metadata = rundir.load_checkpoint(str(ckpt), state)
    assert isinstance(restored, State)
    assert_trees_bitwise_equal(restored, state)
    assert restored.key.dtype == np.uint32 and restored.keys.shape == (5, 2)
    assert restored.done.dtype == np.bool_
    assert metadata == METADATA
    assert rundir.read_checkpoint_metadata(str(ckpt)) == METADATA
    # Loadable into an all-jax template too, and after an overwrite holds the new state.
    new = make_state(1.0)
    rundir.save_checkpoint(str(ckpt), new, {'epoch': 4})
    restored, metadata = rundir.load_checkpoint(str(ckpt), jax.tree.map(jnp.asarray, new))
    assert_trees_bitwise_equal(restored, jax.tree.map(np.asarray, new))
    assert metadata == {'epoch': 4}
    assert os.listdir(ckpt.parent) == ['checkpoint.npz']


def _replace_leaf(state, which, value):
    params = [dict(layer) for layer in state.params]
    if which == 'w0':
        params[0]['w'] = value
        return state._replace(params=params)
    if which == 'done':
        return state._replace(done=value)
    if which == 'step':
        return state._replace(step=value)
    if which == 'key':
        return state._replace(key=value)
    raise AssertionError(which)


MISMATCHES = {
    'shape_w': lambda s: _replace_leaf(s, 'w0', np.zeros((4, 3), np.float32)),
    'shape_done': lambda s: _replace_leaf(s, 'done', np.zeros((7,), bool)),
    'shape_scalar_vs_vector': lambda s: _replace_leaf(s, 'step', np.zeros((1,), np.int32)),
    'dtype_float16': lambda s: _replace_leaf(s, 'w0', np.zeros((3, 4), np.float16)),
    'dtype_int_vs_float': lambda s: _replace_leaf(s, 'step', np.float32(0)),
    'dtype_key_int32': lambda s: _replace_leaf(s, 'key', np.zeros((2,), np.int32)),
    'dtype_bool_vs_int': lambda s: _replace_leaf(s, 'done', np.zeros((6,), np.int32)),
    'extra_leaf': lambda s: s._replace(opt={**s.opt, 'nu': np.zeros(2, np.float32)}),
    'missing_leaf': lambda s: s._replace(opt={'count': s.opt['count']}),
    'renamed_key': lambda s: s._replace(opt={'count2': s.opt['count'], 'mu': s.opt['mu']}),
    'extra_layer': lambda s: s._replace(params=s.params + [s.params[-1]]),
    'tuple_not_namedtuple': lambda s: tuple(s),
}


@pytest.mark.parametrize('mutate', list(MISMATCHES.values()), ids=list(MISMATCHES))
def test_checkpoint_template_mismatch(ckpt, mutate):
    template = mutate(make_state())
    with pytest.raises(ValueError, match=re.escape(str(ckpt))):
        rundir.load_checkpoint(str(ckpt), template)


def test_checkpoint_missing_file(tmp_path):
    path = str(tmp_path / 'nope' / 'checkpoint.npz')
    with pytest.raises(ValueError, match=re.escape(path)):
        rundir.load_checkpoint(path, make_state())
    with pytest.raises(ValueError, match=re.escape(path)):
        rundir.read_checkpoint_metadata(path)


def _write(path, data):
    with open(path, 'wb') as f:
        f.write(data)


def _corruptions(raw):
    rng = np.random.default_rng(0)
    yield 'random_bytes', rng.integers(0, 256, 2000, dtype=np.uint8).tobytes()
    yield 'random_bytes_zip_magic', b'PK\x03\x04' + rng.integers(
        0, 256, 2000, dtype=np.uint8).tobytes()
    yield 'npy_magic_garbage', b'\x93NUMPY' + rng.integers(0, 256, 200, dtype=np.uint8).tobytes()
    yield 'empty', b''
    for fraction in (0.5, 0.1, 0.9):
        yield f'truncated_{fraction}', raw[:int(len(raw) * fraction)]
    yield 'truncated_last_byte', raw[:-1]
    data = bytearray(raw)  # a flipped byte inside the first leaf's data: CRC must catch it
    position = raw.find(np.array([3.0, 4.0], np.float32).tobytes())  # in params[0]['w']
    assert position > 0
    data[position + 3] ^= 0x01
    yield 'bit_flip_in_data', bytes(data)


@pytest.mark.parametrize('kind', ['random_bytes', 'random_bytes_zip_magic',
                                  'npy_magic_garbage', 'empty', 'truncated_0.5',
                                  'truncated_0.1', 'truncated_0.9', 'truncated_last_byte',
                                  'bit_flip_in_data'])
def test_checkpoint_corrupt_or_truncated(ckpt, kind):
    data = dict(_corruptions(ckpt.read_bytes()))[kind]
    bad = ckpt.parent / 'bad.npz'
    _write(bad, data)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        rundir.load_checkpoint(str(bad), make_state())
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        rundir.read_checkpoint_metadata(str(bad))


def test_checkpoint_valid_npz_that_is_not_a_checkpoint(tmp_path):
    for name, arrays in [('no_header', {'foo': np.zeros(3)}),
                         ('bad_json', {'header': np.frombuffer(b'{not json', np.uint8)}),
                         ('missing_leaf', {'header': np.frombuffer(
                             b'{"paths": ["[0]", "[1]"], "metadata": {}}', np.uint8),
                             'leaf_00000': np.zeros(2)})]:
        path = str(tmp_path / f'{name}.npz')
        with open(path, 'wb') as f:
            np.savez(f, **arrays)
        with pytest.raises(ValueError, match=re.escape(path)):
            rundir.load_checkpoint(path, [np.zeros(2), np.zeros(2)])


def _central_directory_corruption(raw, offset, value):
    data = bytearray(raw)
    position = raw.find(b'PK\x01\x02')
    assert position > 0
    data[position + offset] = value
    return bytes(data)


# zipfile raises NotImplementedError / RuntimeError for these; they must become ValueError.
@pytest.mark.parametrize('field,offset,value', [
    ('encrypted_flag', 8, 0x01),          # RuntimeError: ... is encrypted, password required
    ('version_needed', 6, 0xFF),          # NotImplementedError: zip file version 25.5
    ('compression_method', 10, 99),       # NotImplementedError: compression method
])
def test_checkpoint_corrupt_zip_directory(ckpt, field, offset, value):
    bad = ckpt.parent / 'bad.npz'
    _write(bad, _central_directory_corruption(ckpt.read_bytes(), offset, value))
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        rundir.load_checkpoint(str(bad), make_state())


class SimulatedCrash(Exception):
    pass


@pytest.mark.parametrize('crash_at', ['os.replace', 'os.fsync', 'np.savez'])
def test_checkpoint_interrupted_write_keeps_previous(ckpt, monkeypatch, crash_at):
    old_bytes = ckpt.read_bytes()
    module_name, attr = crash_at.split('.')
    module = {'os': rundir.os, 'np': rundir.np}[module_name]

    def crash(*args, **kwargs):
        raise SimulatedCrash(crash_at)

    monkeypatch.setattr(module, attr, crash)
    with pytest.raises(SimulatedCrash):
        rundir.save_checkpoint(str(ckpt), make_state(1.0), {'epoch': 99})
    monkeypatch.undo()

    assert ckpt.read_bytes() == old_bytes
    restored, metadata = rundir.load_checkpoint(str(ckpt), make_state())
    assert_trees_bitwise_equal(restored, make_state())
    assert metadata == METADATA
    assert rundir.read_checkpoint_metadata(str(ckpt)) == METADATA
    # And a later save works and replaces the old contents.
    rundir.save_checkpoint(str(ckpt), make_state(1.0), {'epoch': 4})
    restored, metadata = rundir.load_checkpoint(str(ckpt), make_state(1.0))
    assert_trees_bitwise_equal(restored, make_state(1.0))
    assert metadata == {'epoch': 4}


def test_checkpoint_leftover_temp_file_is_harmless(ckpt):
    # A crashed writer's temp file (garbage) next to the checkpoint.
    for name in (f'{ckpt.name}.tmp-{os.getpid()}', f'{ckpt.name}.tmp-1', 'checkpoint.npz.tmp'):
        _write(ckpt.parent / name, b'garbage')
    restored, metadata = rundir.load_checkpoint(str(ckpt), make_state())
    assert_trees_bitwise_equal(restored, make_state())
    rundir.save_checkpoint(str(ckpt), make_state(1.0), {'epoch': 5})
    restored, metadata = rundir.load_checkpoint(str(ckpt), make_state(1.0))
    assert_trees_bitwise_equal(restored, make_state(1.0))
    assert metadata == {'epoch': 5}


def test_checkpoint_written_to_temp_then_renamed(ckpt, monkeypatch):
    """At the moment of the rename the temp file is a complete checkpoint in the
    same directory under another name, and the target still holds the old one."""
    old_bytes = ckpt.read_bytes()
    real_replace = os.replace
    calls = []

    def spy(src, dst):
        src, dst = os.fspath(src), os.fspath(dst)
        calls.append((src, dst))
        if os.path.abspath(dst) == os.path.abspath(str(ckpt)):
            assert os.path.abspath(src) != os.path.abspath(dst)
            assert os.path.dirname(os.path.abspath(src)) == str(ckpt.parent)
            assert ckpt.read_bytes() == old_bytes
            restored, metadata = rundir.load_checkpoint(src, make_state(1.0))
            assert_trees_bitwise_equal(restored, make_state(1.0))
            assert metadata == {'epoch': 9}
        return real_replace(src, dst)

    monkeypatch.setattr(rundir.os, 'replace', spy)
    rundir.save_checkpoint(str(ckpt), make_state(1.0), {'epoch': 9})
    monkeypatch.undo()
    assert [dst for _, dst in calls] == [str(ckpt)]
    assert os.listdir(ckpt.parent) == ['checkpoint.npz']
    assert rundir.read_checkpoint_metadata(str(ckpt)) == {'epoch': 9}


# ---------------------------------------------------------------------------
# Config flags.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    env: str = fields.option('CartPole-v1', 'gymnax env name')
    max_slice_length: int = fields.option(2, 'slice length')
    double_dqn: bool = fields.option(True, 'double DQN')
    eval_steps: Tuple[int, ...] = fields.option((200,), 'eval horizons')
    max_steps: Optional[int] = fields.option(None, 'episode cap')
    lr: float = fields.option(1e-3, 'learning rate', sweep=True)
    gamma: float = fields.option(0.99, 'discount', sweep=True)


def parse(argv):
    parser = flags.build_parser(TinyConfig, 'tiny', 'a tiny config')
    return fields.parse(parser, argv, {})[0]


def test_config_defaults():
    args = parse([])
    config, grid = flags.config_and_grid(TinyConfig, args)
    assert config == TinyConfig()
    assert grid == {}
    assert (args.seed, args.num_seeds, args.output_dir, args.only_eval) == (0, 1, None, False)


def test_config_kebab_case_flags_bool_tuple_optional():
    args = parse(['--max-slice-length', '3', '--no-double-dqn', '--eval-steps', '200,500',
                  '--max-steps', '50', '--env', 'Acrobot-v1', '--seed', '4',
                  '--num-seeds', '2', '--output-dir', 'out'])
    config, grid = flags.config_and_grid(TinyConfig, args)
    assert config == TinyConfig(env='Acrobot-v1', max_slice_length=3, double_dqn=False,
                                eval_steps=(200, 500), max_steps=50)
    assert isinstance(config.max_slice_length, int)
    assert grid == {}
    assert (args.seed, args.num_seeds, args.output_dir) == (4, 2, 'out')
    assert flags.config_and_grid(TinyConfig, parse(['--double-dqn']))[0].double_dqn is True
    assert flags.config_and_grid(TinyConfig, parse(['--eval-steps', '300']))[0].eval_steps \
        == (300,)
    assert flags.config_and_grid(TinyConfig, parse(['--max-steps', 'none']))[0].max_steps \
        is None


def test_config_help_lists_kebab_flags(capsys):
    with pytest.raises(SystemExit) as info:
        parse(['--help'])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ('--max-slice-length', '--double-dqn', '--no-double-dqn', '--eval-steps',
                 '--max-steps', '--lr', '--num-seeds', '--output-dir', '--only-eval'):
        assert flag in out
    assert '--max_slice_length' not in out


@pytest.mark.parametrize('script', ['dqn', 'pg', 'actor_critic'])
def test_help_states_each_default_once(script):
    """Every flag's help ends with its default, said once (a help text that
    already explains the default, e.g. '(default: --epochs)', gets no second)."""
    module = __import__(script)
    parser = flags.build_parser(module.Config, f'{script}.py', '')
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest == 'help':
            continue
        text = formatter._get_help_string(action) % {'default': action.default}
        assert text.count('(default') == 1, (action.dest, text)


def test_config_sweep_grid_and_runs():
    args = parse(['--lr', '1e-3,3e-4', '--gamma', '0.9,0.99'])
    config, grid = flags.config_and_grid(TinyConfig, args)
    assert config.lr == 1e-3 and config.gamma == 0.9
    assert grid == {'lr': [1e-3, 3e-4], 'gamma': [0.9, 0.99]}
    runs = common.expand_runs(config, grid, seed=5, num_seeds=2)
    assert [(r['lr'], r['gamma'], r['seed']) for r in runs] == [
        (1e-3, 0.9, 5), (1e-3, 0.9, 6), (1e-3, 0.99, 5), (1e-3, 0.99, 6),
        (3e-4, 0.9, 5), (3e-4, 0.9, 6), (3e-4, 0.99, 5), (3e-4, 0.99, 6)]
    hp = common.hyperparameters(config, runs)
    np.testing.assert_allclose(np.asarray(hp['lr']), [1e-3] * 4 + [3e-4] * 4, rtol=1e-6)
    assert hp['lr'].dtype == jnp.float32


def test_config_single_sweep_value_and_no_grid_runs():
    args = parse(['--lr', '3e-4'])
    config, grid = flags.config_and_grid(TinyConfig, args)
    assert config.lr == 3e-4 and grid == {}
    runs = common.expand_runs(config, grid, seed=0, num_seeds=3)
    assert runs == [{'seed': s, 'lr': 3e-4, 'gamma': 0.99} for s in range(3)]


@pytest.mark.parametrize('argv', [
    ['--max-slice-length', '2,3'],
    ['--max-slice-length', 'abc'],
    ['--max-slice-length', '2.5'],
    ['--lr', 'fast'],
    ['--lr', '1e-3,x'],
    ['--eval-steps', '200,abc'],
    ['--seed', 'one'],
    ['--max-steps', 'lots'],
    ['--no-such-flag'],
    ['--max-slice-length'],
])
def test_config_bad_values_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err, 'nothing on stderr'
    assert len(err.splitlines()) == 1, err
    assert 'Traceback' not in err
    assert err.startswith('tiny: error:')
    flag = argv[0]
    assert flag in err


def test_config_unparseable_int_message_says_what(capsys):
    with pytest.raises(SystemExit) as info:
        parse(['--max-slice-length', 'abc'])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert '--max-slice-length' in err and 'int' in err and "'abc'" in err


def given_flags(parser, argv):
    return fields.parse(parser, argv, {})[1]


def test_given_flags_names_only_what_the_command_line_set():
    parser = flags.build_parser(TinyConfig, 'tiny', '')
    assert given_flags(parser, []) == set()
    given = given_flags(parser, ['--lr', '1e-3,3e-4', '--no-double-dqn', '--seed', '3'])
    assert given == {'lr', 'double_dqn', 'seed'}
    # A flag given at its default value is still given (an explicit choice).
    assert given_flags(parser, ['--gamma', '0.99']) == {'gamma'}
    assert parser.parse_args([]).lr == 1e-3  # the parser itself keeps its defaults
    args, given, table = fields.parse(parser, ['--lr', '1e-3'], lambda typed: {'lr': typed['lr']})
    assert args.gamma == 0.99 and given == {'lr'} and table == {'lr': [0.001]}


# ---------------------------------------------------------------------------
# Declared constraints (fields.option's bounds / choices, fields.check_fields)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('text,inside,outside,shown', [
    ('[1, inf)', [1, 2, 10 ** 9], [0, -1, math.inf], '>= 1'),
    ('(0, 1]', [1e-9, 0.5, 1.0], [0.0, 1.0000001, -1.0], 'in (0, 1]'),
    ('[0, 1)', [0.0, 0.999], [1.0, -1e-9], 'in [0, 1)'),
    ('[0, inf]', [0.0, math.inf], [-1.0], 'in [0, inf]'),
    ('(0, inf)', [1e-30], [0.0, math.inf], '> 0'),
])
def test_bounds_membership_and_text(text, inside, outside, shown):
    bounds = fields.Bounds.parse(text)
    assert all(value in bounds for value in inside)
    assert not any(value in bounds for value in outside)
    assert str(bounds) == shown


@pytest.mark.parametrize('text', ['1, 2', '[1 2]', '[a, 2]', '{0, 1}'])
def test_malformed_bounds_fail_when_declared(text):
    with pytest.raises(ValueError):
        fields.option(1, 'x', bounds=text)


@dataclasses.dataclass(frozen=True)
class BoundedConfig:
    count: int = fields.option(4, 'a count', bounds='[1, inf)')
    sizes: Tuple[int, ...] = fields.option((8, 8), 'sizes', bounds='[1, inf)')
    rate: float = fields.option(0.5, 'a probability', sweep=True, bounds='[0, 1]')
    scale: float = fields.option(0.0, 'any finite number')
    cap: Optional[int] = fields.option(None, 'optional', bounds='[1, inf)')
    mode: str = fields.option('a', 'a mode', choices=('a', 'b'))
    big: int = fields.option(0, 'an unbounded int')


@pytest.mark.parametrize('changes,grid,message', [
    (dict(count=0), None, '--count must be >= 1, got 0'),
    (dict(sizes=(8, 0)), None, '--sizes entries must be >= 1, got 8,0'),
    (dict(rate=1.5), None, '--rate must be in [0, 1], got 1.5'),
    ({}, {'rate': [0.5, -0.1]}, '--rate must be in [0, 1], got -0.1'),
    (dict(scale=math.nan), None, '--scale must be a number'),
    (dict(scale=-math.inf), None, '--scale must be finite'),
    (dict(cap=0), None, '--cap must be >= 1'),
    (dict(mode='c'), None, '--mode must be one of a, b'),
    (dict(big=2 ** 31), None, '--big must be at most 2147483647'),
])
def test_check_fields_names_the_flag_and_the_rule(changes, grid, message):
    config = dataclasses.replace(BoundedConfig(), **changes)
    with pytest.raises(common.UsageError, match=re.escape(message)):
        fields.check_fields(config, grid)


def test_check_fields_accepts_values_inside_and_unset_optionals():
    fields.check_fields(BoundedConfig())
    fields.check_fields(dataclasses.replace(BoundedConfig(), cap=3, scale=-2.5),
                        {'rate': [0.0, 1.0]})


@pytest.mark.parametrize('script', ['dqn', 'pg', 'actor_critic'])
def test_help_shows_each_constraint(script, capsys):
    module = __import__(script)
    with pytest.raises(SystemExit):
        module.main(['--help'])
    out = ' '.join(capsys.readouterr().out.split())
    epochs = {'dqn': 50, 'pg': 40, 'actor_critic': 100}[script]
    for text in (f'{{>= 1}} (default: {epochs})',
                 '{in (0, 1]} [comma list = sweep]', '{> 0} [comma list = sweep]'):
        assert text in out, text


@pytest.mark.parametrize('script', ['dqn', 'pg', 'actor_critic'])
def test_every_int_field_declares_its_bounds(script):
    """Counts and sizes all state their range (floats are at least finite)."""
    module = __import__(script)
    kinds = fields.field_kinds(module.Config)
    for field in dataclasses.fields(module.Config):
        kind = kinds[field.name][0]
        if kind is int:
            assert field.metadata.get('bounds'), field.name


# ---------------------------------------------------------------------------
# The progress line and TensorBoard run names.
# ---------------------------------------------------------------------------


def test_epoch_line_shows_epoch_of_total_recent_return_and_time_left():
    metrics = {'rl/n_interactions': np.array([1024, 1024]),
               'rl/avg_return': np.array([np.nan, np.nan]),  # no episode ended this epoch
               'rl/avg_return_temperature0.00_steps500': np.array([500.0, 480.0]),
               'metrics/value_loss': np.array([0.5, 0.25])}
    line = cli.epoch_line(7, 150, metrics, np.array([210.0, 190.0]), 0.5, 3725)
    assert line == ('epoch   7/150 | steps 1024 | return 200.0 (min 190.0) | eval T0.00@500 '
                    '490.0 (min 480.0) | value_loss 0.375 | 0.50s | left 1h02m')
    assert cli.epoch_line(3, 5, metrics, np.array([np.nan, np.nan]), 0.5, 65).endswith(
        '| 0.50s | left 1m05s')
    assert 'return n/a' in cli.epoch_line(3, 5, metrics, np.array([np.nan, np.nan]), 1, 0)


def test_recent_returns_are_the_last_epoch_in_which_an_episode_ended():
    history = [{'epoch': 2, 'run': 0, 'rl/avg_return': None},
               {'epoch': 1, 'run': 0, 'rl/avg_return': 20.0},
               {'epoch': 1, 'run': 1, 'rl/avg_return': None},
               {'epoch': 2, 'run': 1, 'rl/avg_return': 30.0}]
    np.testing.assert_array_equal(cli.recent_returns(history, 3), [20.0, 30.0, np.nan])


def test_run_names_name_grid_values_and_seed():
    runs = [{'seed': 3, 'lr': 0.01, 'gamma': 0.99}, {'seed': 4, 'lr': 0.003, 'gamma': 0.99}]
    assert rundir.run_names(runs, {'lr': [0.01, 0.003]}) == ['lr=0.01,seed=3', 'lr=0.003,seed=4']
    assert rundir.run_names(runs[:1], {}) == ['seed=3']
    twins = [{'seed': 3, 'lr': 0.01}, {'seed': 3, 'lr': 0.01}]
    assert rundir.run_names(twins, {'lr': [0.01, 0.01]}) == ['lr=0.01,seed=3,run=0',
                                                              'lr=0.01,seed=3,run=1']


def test_take_saved_config_fills_in_what_the_command_line_left_out():
    parser = flags.build_parser(TinyConfig, 'tiny', '')
    saved = {'algorithm': 'tiny', 'env': 'Acrobot-v1', 'max_slice_length': 4,
             'double_dqn': False, 'eval_steps': [100, 300], 'max_steps': None, 'lr': 0.01,
             'gamma': 0.9, 'grid': {'lr': [0.01, 0.003]}, 'seed': 7, 'num_seeds': 2}
    argv = ['--gamma', '0.95', '--output-dir', 'x']
    args = parser.parse_args(argv)
    args.given, args.only_eval = given_flags(parser, argv), False
    flags.take_saved_config(TinyConfig, args, saved)
    config, grid = flags.config_and_grid(TinyConfig, args)
    assert config == TinyConfig(env='Acrobot-v1', max_slice_length=4, double_dqn=False,
                                eval_steps=(100, 300), max_steps=None, lr=0.01, gamma=0.95)
    assert grid == {'lr': [0.01, 0.003]} and (args.seed, args.num_seeds) == (7, 2)
    # A save of another algorithm (other fields) is left alone: resuming names them.
    args = parser.parse_args([])
    args.given, args.only_eval = set(), False
    flags.take_saved_config(TinyConfig, args, {**saved, 'hidden_sizes': [8]})
    assert args.env == 'CartPole-v1' and args.seed == 0


# --- one front door (issue 50, items 3-5): one parser, refusals as data,
# make_agent once per path -------------------------------------------------

def test_the_harness_parser_extends_the_one_in_fields():
    """Every flag of fields' parser is in harness/'s with the same spelling,
    type and default; harness/ only adds its run and process flags."""
    for module in (dqn, pg, ac):
        plain = fields.build_parser(module.Config, 'x')
        full = flags.build_parser(module.Config, 'x', '')
        for option, action in plain._option_string_actions.items():
            other = full._option_string_actions[option]
            assert (other.dest, other.default, type(other)) == (
                action.dest, action.default, type(action)), option
        added = {a.dest for a in full._actions} - {a.dest for a in plain._actions}
        assert added == set(fields.HARNESS_FLAGS)


def test_a_refusal_carries_its_field_and_whether_it_is_inert():
    """The field refused travels with the error; no message is parsed."""
    with pytest.raises(common.UsageError) as refused:
        ac.make_agent(ac.Config(max_slice_length=50))
    assert (refused.value.field, refused.value.inert) == ('max_slice_length', True)
    with pytest.raises(common.UsageError) as refused:
        fields.check_grid(ac.Config(n_envs=7), {}, ac.check_runs)
    assert (refused.value.field, refused.value.inert) == ('n_interactions_per_epoch', False)
    error = common.UsageError('--gamma must be in (0, 1], got 2', field='gamma')
    assert fields.inert_setting(error, {'gamma': 2.0}, {}) is None  # not inert: refused
    error = common.UsageError('any words at all', field='gru_size', inert=True)
    assert fields.inert_setting(error, {'gru_size': 8}, {}) == 'gru_size'
    assert fields.inert_setting(error, {'gru_size': 8}, {'gru_size': 8}) is None  # typed


def test_acts_with_is_declared_once_and_read_by_the_check_and_help():
    declared = {f.name: f.metadata['acts_with'][:2] for f in dataclasses.fields(ac.Config)
                if f.metadata['acts_with']}
    assert declared['epsilon'] == ('policy_loss', ('ppo',))
    assert declared['shared_torso'] == ('joint', (True,))
    assert set(ac.VALUE_ONLY) == {name for name, acts in declared.items()
                                  if acts == ('joint', (False,))}
    help_text = ' '.join(flags.build_parser(ac.Config, 'x', '').format_help().split())
    assert '(acts with --policy-loss ppo only)' in help_text
    assert '(acts without --joint only)' in help_text
    with pytest.raises(common.UsageError, match=r'^--epsilon acts with --policy-loss ppo only, '
                                                r'not a2c$'):
        fields.check_grid(ac.Config(policy_loss='a2c'), {'epsilon': [0.2, 0.3]}, ac.check_runs)
    fields.check_grid(ac.Config(policy_loss='a2c'), {}, ac.check_runs)  # at its default: fine


@pytest.mark.parametrize('resume', [False, True])
def test_make_agent_runs_once_per_command(resume, tmp_path, monkeypatch):
    """A fresh run with an env's settings, and a resume: one make_agent each,
    never one whose errors are swallowed."""
    calls, make_agent = [], ac.make_agent

    def counted(config, given=None):
        calls.append(config)
        return make_agent(config, given)
    out = str(tmp_path / 'run')
    argv = ['--env', 'MetaMaze-misc', '--torso', 'mlp', '--epochs', '1', '--n-envs', '4',
            '--n-interactions-per-epoch', '64', '--batch-size', '16', '--value-batch-size', '16',
            '--train-steps-per-epoch', '2', '--value-train-steps-per-epoch', '2',
            '--n-eval-episodes', '1', '--eval-steps', '10', '--hidden-sizes', '8',
            '--lr-schedule', 'constant', '--quiet',
            '--no-tensorboard', '--compile-cache', 'none', '--output-dir', out]
    if resume:
        ac.main(argv)
        argv = ['--output-dir', out, '--epochs', '2', '--quiet', '--no-tensorboard',
                '--compile-cache', 'none']
    cli.main(ac.Config, counted, ac.check_runs, 'actor_critic.py', '', argv,
             env_settings=ac.settings_table, settings_mode_field='policy_loss')
    assert len(calls) == 1


def test_no_code_parses_an_error_message():
    for name in ('common.py', 'fields.py', os.path.join('harness', 'cli.py')):
        source = open(os.path.join(REPO, name)).read()
        assert 'import re\n' not in source, name


def test_overlapped_runs_both_and_compiles_the_same_program():
    """The chunk compiles in a thread beside init: both results come back in
    order, an error in either reaches the caller, and a program compiled in the
    thread from init's shapes runs bitwise as one compiled from its output."""
    order = []
    assert cli._overlapped(lambda: order.append(1) or 'a', lambda: order.append(2) or 'b') \
        == ('a', 'b')
    assert sorted(order) == [1, 2]
    with pytest.raises(ValueError, match='second'):
        cli._overlapped(lambda: 1, lambda: (_ for _ in ()).throw(ValueError('second')))
    with pytest.raises(ValueError, match='first'):
        cli._overlapped(lambda: (_ for _ in ()).throw(ValueError('first')), lambda: 2)
    init = jax.jit(lambda key: {'w': jax.random.normal(key, (3, 4)), 'n': jnp.zeros((), jnp.int32)})
    step = jax.jit(lambda state: {'w': jnp.tanh(state['w'] @ state['w'].T @ state['w']),
                                  'n': state['n'] + 1})
    key = jax.random.PRNGKey(0)
    state, threaded = cli._overlapped(lambda: init(key),
                                      lambda: step.lower(jax.eval_shape(init, key)).compile())
    chex.assert_trees_all_equal(threaded(state), step.lower(state).compile()(state), strict=True)
