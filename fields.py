"""The Config contract and the plain command line of dqn.py, pg.py and
actor_critic.py. Copy this file with an algorithm file and common.py; you need
not read it to change an algorithm: it turns Config fields into flags and
checks, and runs a script where harness/ (the full command line) is absent.

  - option() declares a field with its help, bounds, choices and whether it
    sweeps; check_grid() applies those and an algorithm's cross-field rules;
  - check_inert() refuses a field set where it cannot act;
  - plain_main() is an algorithm's main() without harness/: flags, checks,
    metrics.jsonl, config.json and summary.json.
"""

import argparse
import contextlib
import dataclasses
import decimal
import json
import math
import os
import signal
import sys
import time
import typing

import jax
import numpy as np

import common

# Config fields carry their help and constraint; check_grid applies them and an
# algorithm's cross-field rules for every caller (harness, plain_main, Python).


def option(default, help, sweep=False, bounds=None, choices=None, aliases=(), acts_with=None):
    """A config field with its --help line and constraint. `sweep`: a comma list is
    a grid. `bounds`: '[1, inf)', '(0, 1]' (floats finite unless closed on inf).
    `choices`: allowed strings or a registry dict. `aliases`: Trax's flag names.
    `acts_with`: (field, values[, why]): the field acts only while that field
    holds one of the values; set off its default otherwise, it is refused."""
    if bounds is not None:
        Bounds.parse(bounds)  # a malformed interval fails at import, not at run time
    return dataclasses.field(default=default, metadata={
        'help': help, 'sweep': sweep, 'bounds': bounds, 'choices': choices,
        'aliases': tuple(aliases), 'acts_with': acts_with})


def acts_with_text(acts_with):
    """'acts with --torso gru only', 'acts without --joint only'."""
    mode_field, values = acts_with[:2]
    if tuple(values) in ((True,), (False,)):
        return f'acts {"with" if values[0] else "without"} {flag(mode_field)} only'
    return f'acts with {flag(mode_field)} {" or ".join(map(str, values))} only'


def check_acts_with(config, runs):
    """Refuse a field set off its default (in the config or any run's swept
    value, as float32 holds it) while its `acts_with` mode is off: saved, it
    would bind a resume and change nothing. The UsageError is `inert`."""
    for field in dataclasses.fields(config):
        acts_with = field.metadata.get('acts_with')
        if not acts_with or getattr(config, acts_with[0]) in acts_with[1]:
            continue
        mode = getattr(config, acts_with[0])
        values = [run[field.name] for run in runs] if runs and field.name in runs[0] else [
            getattr(config, field.name)]
        if any(_differs(value, field.default) for value in values):
            raise common.UsageError(
                f'{flag(field.name)} {acts_with_text(acts_with)}'
                + ('' if isinstance(mode, bool) else f', not {mode}')
                + (f': {acts_with[2]}' if len(acts_with) > 2 else ''),
                field=field.name, inert=True)


def _differs(value, default):
    if isinstance(default, float) and not isinstance(value, bool):
        return as_float32(value) != as_float32(default)
    return value != default


INT32_MAX = common.INT32_MAX  # counters and sizes live in int32 arrays


def check_int32_products(products):
    """common.UsageError naming the first product past int32, which the program counts
    and indexes in: `products` is [(what it counts, [(flag, value), ...])]."""
    for what, factors in products:
        value = math.prod(int(factor) for _, factor in factors)
        if value > INT32_MAX:
            said = ' x '.join(f'{flag} {factor}' for flag, factor in factors)
            raise common.UsageError(f'{what} per run would be {said} = {value}, past {INT32_MAX}, the '
                             'largest int32, which the program counts in; lower one of them')


def env_steps_factors(config, n_envs, steps, max_steps):
    """The flags behind a run's env steps per epoch: --n-interactions-per-epoch,
    or --n-trajectories-per-epoch episodes of up to `max_steps` steps."""
    if config.n_trajectories_per_epoch:
        cap = (('--max-steps', max_steps) if getattr(config, 'max_steps', None)
               else (f"{config.env}'s episode cap", max_steps))
        return [('--n-trajectories-per-epoch', n_envs), cap]
    return [('--n-interactions-per-epoch', n_envs * steps)]


def step_products(config, env_steps):
    """The int32 products every algorithm counts: gradient steps, env steps
    and the learning-rate schedule's steps (for check_int32_products)."""
    return [
        ('gradient steps', [('--epochs', config.epochs),
                            ('--train-steps-per-epoch', config.train_steps_per_epoch)]),
        ('env steps', [('--epochs', config.epochs), *env_steps]),
        ("the learning-rate schedule's steps",
         [('--lr-decay-epochs', config.lr_decay_epochs or config.epochs),
          ('--train-steps-per-epoch', config.train_steps_per_epoch)])]


@dataclasses.dataclass(frozen=True)
class Bounds:
    """An interval, written as in maths: '[1, inf)', '(0, 1]', '[0, 1)'."""
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text):
        text = text.strip()
        if len(text) < 5 or text[0] not in '[(' or text[-1] not in '])' or ',' not in text:
            raise ValueError(f'bounds {text!r}: expected an interval like "[0, 1)"')
        low, high = (float(part) for part in text[1:-1].split(','))
        return cls(low, high, text[0] == '[', text[-1] == ']')

    def __contains__(self, value):
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def __str__(self):
        def number(x):
            return ('-inf' if x < 0 else 'inf') if math.isinf(x) else f'{x:g}'
        if math.isinf(self.high) and not self.high_closed:
            return f'{">=" if self.low_closed else ">"} {number(self.low)}'
        return (f'in {"[" if self.low_closed else "("}{number(self.low)}, '
                f'{number(self.high)}{"]" if self.high_closed else ")"}')


def flag(name):
    """A field's flag: kebab-case, a keyword's trailing '_' dropped (--lambda)."""
    return '--' + name.rstrip('_').replace('_', '-')


def field_kinds(config_cls):
    """{field: (element type, is_tuple, optional)}, read off the annotations."""
    kinds = {}
    for name, annotation in typing.get_type_hints(config_cls).items():
        args = typing.get_args(annotation)
        optional = type(None) in args  # Optional[X] / X | None
        if optional:
            annotation = next(a for a in args if a is not type(None))
        is_tuple = typing.get_origin(annotation) is tuple
        kinds[name] = (typing.get_args(annotation)[0] if is_tuple else annotation, is_tuple,
                       optional)
    return kinds


def constraint_text(field, kind):
    """The constraint as --help shows it, e.g. 'in (0, 1]' or '>= 1' ('' if none)."""
    if field.metadata.get('choices'):
        return 'one of ' + ', '.join(field.metadata['choices'])
    if field.metadata.get('bounds'):
        return str(Bounds.parse(field.metadata['bounds']))
    return 'finite' if kind is float else ''


def _is(kind, value):
    """Is `value` of a field's element type (an int passes for a float)?"""
    if kind is bool or isinstance(value, (bool, np.bool_)):
        return kind is bool and isinstance(value, (bool, np.bool_))
    numbers = {int: (int, np.integer), float: (int, float, np.integer, np.floating)}
    return isinstance(value, numbers.get(kind, kind))


def _value_error(field, kinds, value):
    """Why one value (of the config, or of a sweep) breaks the field's type or
    constraint, or None if it is fine."""
    kind, is_tuple, optional = kinds
    if value is None:
        return None if optional else 'must be set'
    if is_tuple and not (isinstance(value, tuple) and all(_is(kind, v) for v in value)):
        return f'must be a tuple of {kind.__name__}'
    if not is_tuple and not _is(kind, value):
        return f'must be {kind.__name__}'
    for entry in (value if is_tuple else (value,)):
        why = _entry_error(field, kind, entry)
        if why:
            return ('entries ' if is_tuple else '') + why
    return None


def _entry_error(field, kind, value):
    choices, bounds = field.metadata.get('choices'), field.metadata.get('bounds')
    if choices and value not in choices:
        return f'must be {constraint_text(field, kind)}'
    if kind not in (int, float):
        return None
    interval = Bounds.parse(bounds) if bounds else None
    if kind is float and math.isnan(value):
        return 'must be a number'
    if kind is float and math.isinf(value) and not (interval and value in interval):
        return 'must be finite'
    if interval is not None and value not in interval:
        return f'must be {interval}'
    if kind is int and abs(value) > INT32_MAX:
        return f'must be at most {INT32_MAX} in size (int32)'
    return None


def check_fields(config, grid=None):
    """Every field's type and constraint on every value (tuple entries, `grid`'s
    values): common.UsageError naming the flag."""
    check_grid_fields(config, grid)
    kinds = field_kinds(type(config))
    for field in dataclasses.fields(config):
        for value in (grid or {}).get(field.name, [getattr(config, field.name)]):
            why = _value_error(field, kinds[field.name], value)
            if why:
                raise common.UsageError(f'{flag(field.name)} {why}, got {_show(value)}',
                                        field=field.name)


def check_grid_fields(config, grid):
    if not isinstance(grid or {}, dict):
        raise common.UsageError(f'grid must be a dict {{field: [values]}}, got {grid!r}')
    unknown = sorted(set(grid or {}) - set(common.sweep_fields(config)))
    if unknown:
        raise common.UsageError(f'grid fields {unknown} are not sweepable; sweepable: '
                         + ', '.join(common.sweep_fields(config)))
    for name, values in (grid or {}).items():
        if not isinstance(values, (list, tuple)) or not values:
            raise common.UsageError(f'grid[{name!r}] must be a non-empty list of values, '
                             f'got {values!r}')


def show_float(value):
    """A float as short as `g` writes it where that is the same number, else
    in full (repr): 1.0000001 must not read as 1 beside the bound it breaks."""
    short = f'{value:g}'
    return short if float(short) == value or not math.isfinite(value) else repr(value)


def _show(value):
    if isinstance(value, tuple):
        return ','.join(show_float(v) if isinstance(v, float) else str(v) for v in value)
    return show_float(value) if isinstance(value, float) else repr(value) if isinstance(
        value, str) else str(value)


def _show32(value):
    """A float32 value, as short as names it exactly (0.99999994, not 1)."""
    short = f'{value:g}'
    return short if as_float32(float(short)) == value else str(np.float32(value))


def as_float32(value):
    with np.errstate(over='ignore', under='ignore'):
        return float(np.float32(value))


def float32_values(config, grid):
    """(config, grid) with every float as float32 holds it: what the program sees."""
    kinds = field_kinds(type(config))

    def cast(name, value):
        if value is None or kinds[name][0] is not float:
            return value
        return tuple(map(as_float32, value)) if kinds[name][1] else as_float32(value)
    return (dataclasses.replace(config, **{name: cast(name, getattr(config, name))
                                           for name in kinds}),
            {name: [cast(name, v) for v in values] for name, values in (grid or {}).items()})


def check_grid(config, grid, check_runs):
    """Each field's type and constraint, then the algorithm's cross-field rules
    (`check_runs(config, runs)`), on the values given and on those float32 holds
    (--gamma 0.99999999 is 1, --lr 1e300 inf): common.UsageError naming them."""
    def check(config, grid):
        check_fields(config, grid)
        runs = common.expand_runs(config, grid, 0, 1)
        check_runs(config, runs)
        check_acts_with(config, runs)
    check(config, grid)
    try:
        check(*float32_values(config, grid))
    except common.UsageError as error:
        kinds = field_kinds(type(config))
        entries = [(name, e) for name, (kind, is_tuple, _) in kinds.items() if kind is float
                   for v in (grid or {}).get(name, [getattr(config, name)]) if v is not None
                   for e in (v if is_tuple else (v,))]
        moved = ', '.join(f'{flag(name)} {e!r} is {_show32(as_float32(e))}'
                          for name, e in entries if float(f'{as_float32(e):.7g}') != e)
        raise common.UsageError(f'{error} (in float32, the precision the program computes in: '
                         f'{moved})') from None


def check_sweep_args(config, seed, num_seeds, epochs, batch_invariant):
    """run_sweep's own arguments: UsageError naming the one that is wrong."""
    for name, value, least in (('seed', seed, 0), ('num_seeds', num_seeds, 1),
                               ('epochs', epochs, 1)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) \
                or not least <= value <= INT32_MAX:
            raise common.UsageError(f'run_sweep: {name} must be an int in [{least}, {INT32_MAX}], '
                             f'got {value!r}')
    if seed + num_seeds - 1 > INT32_MAX:
        raise common.UsageError(f'run_sweep: seeds {seed}..{seed + num_seeds - 1} pass {INT32_MAX}, '
                         'the largest int32 seed')
    if not isinstance(batch_invariant, (bool, np.bool_)):
        raise common.UsageError(f'run_sweep: batch_invariant must be True or False, got '
                         f'{batch_invariant!r}')
    horizon = getattr(config, 'lr_decay_epochs', None) or config.epochs
    if epochs > horizon and 'linear_decay' in common.schedule_factors(config.lr_schedule):
        raise common.UsageError(f'run_sweep: epochs {epochs} is past the learning rate\'s linear '
                         f'decay, which reaches 0 at epoch {horizon} (the config\'s '
                         f'lr_decay_epochs or epochs); make the agent from a config with '
                         f'epochs={epochs}')


def check_inert(config, inert, given=None):
    """Refuse a field that cannot act (`inert`: {field: why}) set off its default
    (saved, it would bind a resume and change nothing). `given`: {field a command
    line set: None if typed, else its source}; None (Python): every field."""
    defaults = {field.name: field.default for field in dataclasses.fields(config)}
    for name, why in inert.items():
        if (given is None or name in given) and getattr(config, name) != defaults[name]:
            source = (given or {}).get(name) if isinstance(given, dict) else None
            raise common.UsageError(f'{flag(name)} {why}' + (
                f' (it came from {source}: give {flag(name)} {_show(defaults[name])} to '
                'override it)' if source else ''), field=name, inert=True)


def shared_inert(config, torso, env_params):
    """{field: why it cannot act} for fields every Config has: the schedule's,
    evaluation's and the conv torso's (`torso`: the resolved one)."""
    factors = common.schedule_factors(config.lr_schedule)
    inert = {name: (f'has no effect: --lr-schedule {config.lr_schedule!r} has no '
                    f'{" or ".join(needs)} factor')
             for name, needs in (('lr', ('constant',)), ('lr_decay_epochs', ('linear_decay',)),
                                 ('warmup_steps', ('linear_warmup', 'rsqrt_decay')))
             if not set(needs) & set(factors)}
    if torso != 'conv':
        inert['conv_channels'] = ('acts with the conv torso only (--torso conv, or auto on '
                                  f'[height, width, channels] observations); {config.env}\'s '
                                  'observations are flat')
    if config.n_eval_episodes == 0:
        inert.update(dict.fromkeys(('eval_steps', 'eval_temperatures', 'eval_every'),
                                   'has no effect with --n-eval-episodes 0 (no evaluation)'))
    cap = getattr(env_params, 'max_steps_in_episode', None)
    if cap is not None and config.eval_steps and max(config.eval_steps) > cap:
        inert['eval_steps'] = (f'{max(config.eval_steps)}: episodes of {config.env} end by '
                               f'step {int(cap)} (--max-steps), so a longer horizon evaluates '
                               f'the same; use at most {int(cap)}')
    return inert


# The one command line: an argparse parser built from the Config's fields,
# which harness/ extends with its run flags; the plain driver runs it where
# harness/ is absent, its metrics.jsonl bitwise the full command line's ------

HARNESS_ADDS = ('no harness/ here, so a plain run that writes metrics.jsonl; copy harness/ '
                'for checkpoints, resume, TensorBoard, sweeps over devices, processes, plots')
RUN_FLAGS = {'seed': 0, 'num_seeds': 1, 'output_dir': None}
# harness/'s own run flags (tests/test_copy.py holds this to its parser): a
# copy names them as harness/'s rather than as unknown.
HARNESS_FLAGS = ('quiet', 'tensorboard', 'plot', 'only_eval', 'time_limit', 'checkpoint_every',
                 'compile_cache', 'device', 'cpu_devices', 'batch_invariant', 'distributed',
                 'coordinator_address', 'num_processes', 'process_id', 'coordinator_timeout')
CHUNK_EPOCHS = 256  # epochs per compiled call at most: the metric buffers' length


def flag_names(name, aliases=()):
    """Every spelling of a field's flag: flag()'s, the literal one of a
    keyword's name (--lambda-), and Trax's aliases."""
    literal = '--' + name.replace('_', '-')
    return [flag(name), *([literal] if literal != flag(name) else []), *aliases]


def parse_value(kind, text):
    """One value of a flag as `kind`; an int exactly ('1e3' is 1000; '2.5',
    'inf' and '1e999' are refused), never through a float."""
    try:
        if kind is not int:
            return kind(text)
        value = decimal.Decimal(text)
        if value.is_finite() and value.adjusted() <= 30 and value == value.to_integral_value():
            return int(value)
    except (ValueError, decimal.InvalidOperation):
        pass
    raise common.UsageError(f'expected {kind.__name__}, got {text!r}')


def parse_field(field, kinds, text, name):
    """A flag's text as its field's value: a comma list for a tuple, or for a
    sweep field a list of 2+ values (a grid); 'none' for an unset Optional."""
    kind, is_tuple, optional = kinds
    if optional and text.lower() in ('none', ''):
        return None
    values = [parse_value(kind, part.strip()) for part in text.split(',') if part.strip()]
    if not values:
        raise common.UsageError(f'{name}: empty value')
    if is_tuple:
        return tuple(values)
    if len(values) > 1 and not field.metadata.get('sweep'):
        raise common.UsageError(f'{name} takes one value (it changes shapes or the program), '
                                f'got {text!r}')
    return values if len(values) > 1 else values[0]


def value_type(kind, is_tuple=False, optional=False, field=None, name=''):
    """argparse's type for a flag: parse_field's value (a sweep field's always
    a list), its UsageError as argparse's one-line error."""
    field = field or dataclasses.field(metadata={})

    def parse(text):
        try:
            value = parse_field(field, (kind, is_tuple, optional), text, name)
        except common.UsageError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return [value] if field.metadata.get('sweep') and not isinstance(value, list) else value
    return parse


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line on stderr, status 2;
    `preamble`: --help's text above the per-env settings."""
    preamble = ''

    def error(self, message):
        self.exit(2, f'{self.prog}: error: {message}\n')


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default, unless its help already says what it is;
    the epilog (how to read the output, the env settings table) keeps its lines."""

    def _fill_text(self, text, width, indent):
        return ''.join(indent + line for line in text.splitlines(keepends=True))

    def _get_help_string(self, action):
        if '(default' in (action.help or ''):
            return action.help
        return super()._get_help_string(action)


def build_parser(config_cls, prog, description=''):
    """One flag per Config field (its help, constraint and what it acts with)
    and the run's seeds and folder; harness/ adds its own flags to it."""
    parser = ArgumentParser(prog=prog, description=description, formatter_class=_HelpFormatter,
                            add_help=False)
    parser.add_argument('-h', '--help', action='store_true',
                        help='show this help message (and the per-env settings) and exit')
    kinds = field_kinds(config_cls)
    for field in dataclasses.fields(config_cls):
        names = flag_names(field.name, field.metadata.get('aliases', ()))
        kind, is_tuple, optional = kinds[field.name]
        constraint = constraint_text(field, kind)
        help_text = field.metadata.get('help', '') + (f' {{{constraint}}}' if constraint else '')
        if field.metadata.get('acts_with'):
            help_text += f' ({acts_with_text(field.metadata["acts_with"])})'
        if field.metadata.get('sweep'):
            help_text += ' [comma list = sweep]'
        if kind is bool:
            parser.add_argument(*names, dest=field.name, default=field.default,
                                action=argparse.BooleanOptionalAction, help=help_text)
            continue
        parser.add_argument(*names, dest=field.name, default=field.default, help=help_text,
                            metavar=kind.__name__.upper(),
                            type=value_type(kind, is_tuple, optional, field, names[0]))
    run = parser.add_argument_group('run')
    run.add_argument('--seed', type=value_type(int, name='--seed'), default=0,
                     help='first seed; runs use seed, seed+1, ...')
    run.add_argument('--num-seeds', type=value_type(int, name='--num-seeds'), default=1,
                     help='independent seeds, vmapped in one program')
    run.add_argument('--output-dir', default=None,
                     help='where config.json, metrics.jsonl and summary.json go (default: a '
                          'new folder under runs/)')
    return parser


def parse(parser, argv, settings, lacking=()):
    """Parse argv, once -> (args, the dests given on the command line itself,
    the settings table for them). `settings`: the table, or a function of the
    typed values giving it; --help prints the flags and that table, exit 0.
    `lacking`: flags of harness/ this copy has not, named as such.

    The given dests let a layer of settings sit between the defaults and the
    command line (an env's settings, a saved run's config): a flag typed
    always wins, a flag left out takes the layer's value."""
    defaults = {action.dest: action.default for action in parser._actions}
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    try:
        args, unknown = parser.parse_known_args(argv)
    finally:
        for action in parser._actions:
            action.default = defaults[action.dest]
    for arg in unknown:
        name = arg.partition('=')[0].lstrip('-').replace('-', '_')
        if arg.startswith('--') and (name in lacking or name.removeprefix('no_') in lacking):
            parser.error(f'{arg.partition("=")[0]} is a flag of harness/, the full command '
                         'line, which this copy lacks: copy the harness/ folder beside it')
    if unknown:
        parser.error(f'unrecognized arguments: {" ".join(unknown)}')
    given = set(vars(args)) - {'help'}
    table = settings(vars(args)) if callable(settings) else settings
    if getattr(args, 'help', False):
        parser.epilog = '\n\n'.join(filter(None, (parser.preamble, env_settings_help(table))))
        parser.print_help()
        parser.exit()
    for dest, default in defaults.items():
        if not hasattr(args, dest):
            setattr(args, dest, default)
    return args, given, table


def parse_flags(config_cls, argv):
    """argv -> ({field: value} of the flags given, {run flag: value}), as
    the one parser reads them (for Python callers and tests)."""
    args, given, _ = parse(build_parser(config_cls, config_cls.__module__), argv, {})
    names = {field.name for field in dataclasses.fields(config_cls)}
    return ({name: getattr(args, name) for name in given & names},
            {name: getattr(args, name) for name in RUN_FLAGS})


def settings_flags(settings):
    """{field: value} as the command-line flags that give those values."""
    shown = []
    for name, value in settings.items():
        if isinstance(value, bool):
            shown.append(flag(name) if value else '--no-' + flag(name)[2:])
        elif isinstance(value, (tuple, list)):
            shown.append(f'{flag(name)} {",".join(str(v) for v in value)}')
        else:
            shown.append(f'{flag(name)} {"none" if value is None else value}')
    return ' '.join(shown)


SETTINGS_HEADING = 'per-env settings'


def env_settings_help(table):
    """--help's per-env settings as the flags they amount to, one line per
    distinct entry (the envs sharing it named together)."""
    lines = [f'{SETTINGS_HEADING} (used when --env is one of these; a flag given on the '
             'command line wins):']
    envs = {}
    for env, settings in (table or {}).items():
        envs.setdefault(settings_flags(settings), []).append(env)
    lines += [f'  {", ".join(names)}: {flags}' for flags, names in envs.items()]
    return '\n'.join(lines if table else lines + ['  (none)'])


def env_settings(config_cls, table, typed, mode_field=None):
    """The settings of the env asked for that no typed flag overrides; None
    when the entry was tuned for another `mode_field` value (actor_critic's
    policy_loss) than the one typed: then none of it applies."""
    entry = table.get(typed.get('env', config_cls.env), {})
    if mode_field in entry and mode_field in typed and typed[mode_field] != entry[mode_field]:
        return None
    return {name: value for name, value in entry.items() if name not in typed}


def inert_setting(error, applied, typed):
    """The env setting (a key of `applied`, not typed) that `error` refuses as
    unable to act with the flags typed, or None. Such a setting is dropped, not
    refused: `--env MetaMaze-misc --torso mlp` runs without the GRU's settings."""
    field = getattr(error, 'field', None)
    return field if getattr(error, 'inert', False) and field in applied and \
        field not in typed else None


def config_and_grid(config_cls, values):
    """(config with each sweep field at its first value, {field: [values]}),
    the grid in field order (its outer loop first); a one-value list is that
    value. An unset --lr-decay-epochs is pinned to --epochs where the
    schedule decays linearly, so a resume with more --epochs keeps the
    schedule (without linear_decay it cannot act: pinned, a resume would
    refuse it as a field set to no effect)."""
    values = {name: value[0] if isinstance(value, list) and len(value) == 1 else value
              for name, value in values.items()}
    grid = {f.name: values[f.name] for f in dataclasses.fields(config_cls)
            if isinstance(values.get(f.name), list)}
    config = config_cls(**{name: value[0] if name in grid else value
                           for name, value in values.items()})
    if getattr(config, 'lr_decay_epochs', 0) is None and decays_linearly(
            {'lr_schedule': config.lr_schedule, 'grid': grid}):
        config = dataclasses.replace(config, lr_decay_epochs=config.epochs)
    return config, grid


def decays_linearly(config):
    """Has a config's lr schedule (a dict's 'lr_schedule', or any of its
    grid's values) the linear_decay factor, the one --lr-decay-epochs acts on?"""
    schedules = config.get('lr_schedule')
    schedules = [*(schedules if isinstance(schedules, (list, tuple)) else [schedules]),
                 *((config.get('grid') or {}).get('lr_schedule') or [])]
    return any('linear_decay' in [factor.strip() for factor in str(schedule).split('*')]
               for schedule in schedules)


def plain_main(config_cls, make_agent, settings, argv=None, mode_field=None):
    """An algorithm script's main() without harness/: parse, check as the
    full command line does (one line, exit 2), run, write metrics.jsonl."""
    prog = os.path.basename(sys.argv[0]) if argv is None else f'{config_cls.__module__}.py'
    parser = build_parser(config_cls, prog)
    parser.preamble = HARNESS_ADDS
    args, given, table = parse(parser, sys.argv[1:] if argv is None else list(argv), settings,
                               lacking=HARNESS_FLAGS)
    names = [field.name for field in dataclasses.fields(config_cls)]
    typed = {name: getattr(args, name) for name in names if name in given}
    run = {name: getattr(args, name) for name in RUN_FLAGS}
    try:
        common.check_precision()
        applied, dropped = env_settings(config_cls, table, typed, mode_field) or {}, {}
        if not (1 <= run['num_seeds'] and 0 <= run['seed']
                and run['seed'] + run['num_seeds'] - 1 <= INT32_MAX):
            raise common.UsageError(f'--seed and --num-seeds: seeds {run["seed"]}.. must be int32')
        check_output_dir(run['output_dir'])
        while True:  # an env setting the typed flags make inert is dropped (inert_setting)
            config, grid = config_and_grid(config_cls, {**applied, **typed})
            try:
                agent = make_agent(config, given={
                    **dict.fromkeys(applied, f"{config.env}'s settings"), **dict.fromkeys(typed)})
                check_grid(config, grid, agent.check_runs)
                check_state_memory(agent, config, grid, run['seed'], run['num_seeds'])
                break
            except common.UsageError as error:
                name = inert_setting(error, applied, typed)
                if name is None:
                    raise
                dropped[name] = applied.pop(name)
    except common.UsageError as error:
        parser.error(str(error))
    print(f'{prog}: {HARNESS_ADDS}', file=sys.stderr, flush=True)
    if applied or dropped:
        print(f'{prog}: settings for {config.env}: {applied}'
              + (f'; not applied (inert with the flags given): {dropped}' if dropped else ''))
    with stop_signals():
        try:
            return plain_run(agent, config, grid, **run)
        except (KeyboardInterrupt, Stopped) as stop:
            signum = getattr(stop, 'signum', signal.SIGINT)
            _fail(prog, f'interrupted ({signal.Signals(signum).name}); metrics.jsonl holds the '
                        'epochs done (harness/ would resume them)', 128 + signum)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to it
            _fail(prog, 'cannot write to stdout (a closed pipe); metrics.jsonl holds the epochs '
                        'done', 1)
        except OSError as error:
            _fail(prog, f'{error.filename or "OS error"}: {error.strerror or error}', 1)


class Stopped(Exception):
    """SIGTERM (or SIGHUP) arrived: the run stops with one line."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stop_signals():
    """SIGTERM and SIGHUP raise Stopped in the main thread while a copy runs;
    SIGINT raises KeyboardInterrupt even where the process started with it
    ignored (as the full command line handles it)."""
    def stop(signum, frame):
        raise Stopped(signum)
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _fail(prog, message, status):
    print(f'{prog}: {message}', file=sys.stderr, flush=True)
    sys.exit(status)


def check_output_dir(output_dir):
    """--output-dir must be a new or empty-of-runs folder this user can write."""
    if not output_dir:
        return
    if os.path.exists(os.path.join(output_dir, 'metrics.jsonl')):
        raise common.UsageError(f'--output-dir {output_dir} holds a run\'s metrics.jsonl: '
                                'choose another (harness/ resumes runs)')
    existing = output_dir
    while not os.path.exists(existing):  # the nearest folder there already
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.path.isdir(existing):
        raise common.UsageError(f'--output-dir {output_dir}: {existing} is a file, not a folder')
    if not os.access(existing, os.W_OK | os.X_OK):
        raise common.UsageError(f'--output-dir {output_dir}: {existing} is not writable')


def memory_available(device=None):
    """Bytes free on `device`: what it reports (accelerators), else host RAM."""
    stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
    if stats and 'bytes_limit' in stats:
        return stats['bytes_limit'] - stats.get('bytes_in_use', 0)
    try:
        with open('/proc/meminfo') as meminfo:
            info = dict(line.split(':', 1) for line in meminfo)
        return int(info['MemAvailable'].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def check_state_memory(agent, config, grid, seed, num_seeds):
    """UsageError before compiling when the runs' state (traced, not made),
    twice over (the state and its update), cannot fit in the memory free: a
    floor; harness/ also counts the phases' largest array."""
    runs = common.expand_runs(config, grid or {}, seed, num_seeds)
    state = jax.eval_shape(agent.batched('init'), common.run_keys(runs),
                           common.hyperparameters(config, runs))
    needed = 2 * sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
    available = memory_available(jax.devices()[0])
    if needed > available:
        raise common.UsageError(
            f'{len(runs)} run(s) need at least {needed / 2**30:.1f} GiB (their state x 2) but '
            f'{available / 2**30:.1f} GiB is available; lower --num-seeds, the grid or the '
            'buffer sizes (--n-replay-epochs, --n-envs, ...)')


def plain_run(agent, config, grid, seed, num_seeds, output_dir):
    """Seeds x grid in the command line's compiled programs, a chunk of epochs up
    to each evaluation: config.json first, metrics.jsonl rewritten after each
    chunk, summary.json last, each written atomically with the CLI's keys."""
    wall_start = time.time()
    length, period = min(CHUNK_EPOCHS, config.epochs), common.evaluation_period(config)
    runs, hp, state, chunk = common.compiled_runs(agent, config, grid, seed, num_seeds, length)
    compile_s = time.time() - wall_start
    output_dir = output_dir or os.path.join(
        'runs', f'{agent.name}_{config.env}_s{seed}_{time.strftime("%Y%m%d-%H%M%S")}')
    os.makedirs(output_dir, exist_ok=True)
    _write(os.path.join(output_dir, 'config.json'), json.dumps(
        {'algorithm': agent.name, **dataclasses.asdict(config), 'grid': grid, 'seed': seed,
         'num_seeds': num_seeds}, indent=2))
    history, epoch, evaluated = [], 0, {}
    recent = np.full(len(runs), np.nan)  # each run's latest finished episodes' return
    tags = {common.return_tag(*tag) for tag in agent.eval_tags}
    while epoch < config.epochs:
        n, start = min(length, config.epochs - epoch, period - epoch % period), time.time()
        state, metrics, _ = chunk(hp, state, *common.plan(config, epoch, n))
        metrics, seconds = jax.tree.map(np.asarray, metrics), (time.time() - start) / n
        for i in range(n):
            epoch += 1
            due = common.evaluation_due(epoch, config.epochs, period)
            values = {name: value[:, i] for name, value in metrics.items()
                      if due or name not in tags}
            values['rl/n_interactions_per_second'] = values.pop('rl/new_interactions') / seconds
            values['timing/epoch'] = np.full(len(runs), seconds)
            history += metric_records(epoch, values, runs)
            evaluated.update({k: v for k, v in values.items() if k in tags})
            recent = np.where(np.isfinite(values['rl/avg_return']), values['rl/avg_return'], recent)
        _write(os.path.join(output_dir, 'metrics.jsonl'),
               ''.join(json.dumps(record) + '\n' for record in history))
        shown = [f'return {_mean(recent):.1f}'] + [
            f'eval {name[len("rl/avg_return_"):]} {_mean(value):.1f}'
            for name, value in evaluated.items()]
        print(f'epoch {epoch}/{config.epochs} | ' + ' | '.join(shown)
              + f' | {seconds:.2f}s/epoch', flush=True)
    result = summary(agent, config, runs, grid, history, time.time() - wall_start, compile_s)
    _write(os.path.join(output_dir, 'summary.json'), json.dumps(result, indent=2))
    print('\n'.join(result_lines(result, output_dir)), flush=True)
    return values


def _write(path, text):
    """`text` into `path` through a temp file and a rename: never half written."""
    with open(f'{path}.tmp-{os.getpid()}', 'w') as f:
        f.write(text)
    os.replace(f'{path}.tmp-{os.getpid()}', path)


def _mean(values):
    values = np.asarray(values, np.float64)
    return values[np.isfinite(values)].mean() if np.isfinite(values).any() else np.nan


def metric_records(epoch, metrics, runs):
    """One JSON record per run for an epoch's {name: array [n_runs]}; null for
    a value that is not finite."""
    return [{'epoch': epoch, 'run': index, **run,
             **{name: float(v[index]) if math.isfinite(float(v[index])) else None
                for name, v in metrics.items()}} for index, run in enumerate(runs)]


# What a run reports, from harness/ and the plain command line alike:
# summary.json (with one entry per grid point) and the final line -----------

def final_return_tag(agent, config):
    """The greedy evaluation summary.json reports: temperature 0 at the
    episode cap if evaluated, else the longest greedy horizon, else the first
    tag; None without evaluation."""
    if not agent.eval_tags or getattr(config, 'n_eval_episodes', 1) == 0:
        return None
    greedy = [tag for tag in agent.eval_tags if tag[0] == 0]
    return common.return_tag(*(max(greedy, key=lambda tag: tag[1]) if greedy
                               else agent.eval_tags[0]))


def last_evaluation(history, tag):
    """The last epoch of `history` (metric records) evaluated under `tag`, or None."""
    return max((r['epoch'] for r in history if tag and r.get(tag) is not None), default=None)


def seed_figures(values):
    """{'iqm', 'mean', 'worst', 'seeds'} of a point's final returns (finite ones):
    the IQM is scipy's trim_mean(x, 0.25), the mean of the middle half."""
    values = np.sort(np.asarray([v for v in values if v is not None], np.float64))
    values = values[np.isfinite(values)]
    if not values.size:
        return {'iqm': None, 'mean': None, 'worst': None, 'seeds': 0}
    cut = int(0.25 * values.size)
    return {'iqm': float(values[cut:values.size - cut].mean()), 'mean': float(values.mean()),
            'worst': float(values[0]), 'seeds': int(values.size)}


def grid_points(grid, runs, finals):
    """summary.json's "points": per grid point its swept values under their
    field names and its seeds' figures (seed_figures), in the runs' order."""
    points = {}
    for run, final in zip(runs, finals):
        points.setdefault(tuple(run[name] for name in grid), []).append(final)
    return [{**dict(zip(grid, point)), **seed_figures(values)}
            for point, values in points.items()]


def summary(agent, config, runs, grid, history, wall_s, compile_s, batch_invariant=True):
    """summary.json: the final greedy returns (the latest evaluation: the last
    epoch's unless a time limit stopped the run between two) and per point."""
    final_epoch = max((record['epoch'] for record in history), default=0)
    final = sorted((r for r in history if r['epoch'] == final_epoch), key=lambda r: r['run'])
    tag = final_return_tag(agent, config)
    eval_epoch = last_evaluation(history, tag)
    evaluated = sorted((r for r in history if r['epoch'] == eval_epoch), key=lambda r: r['run'])
    finals = [r.get(tag) for r in (evaluated if eval_epoch else final)]
    return {'algorithm': agent.name, 'env': config.env, 'seeds': [run['seed'] for run in runs],
            'runs': runs, 'epochs': final_epoch,
            'env_steps_per_seed': [r.get('rl/n_interactions') for r in final],
            'final_eval_return': finals, 'final_eval_key': tag, 'final_eval_epoch': eval_epoch,
            'points': grid_points(grid or {}, runs, finals), 'wall_s': wall_s,
            'compile_s': compile_s, 'batch_invariant': batch_invariant}


def returns_text(values):
    """'500.0' for one run, else '480.2 (min 401.0)'; 'n/a' without a figure."""
    values = np.asarray([np.nan if v is None else v for v in values], np.float64)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 'n/a'
    return f'{finite[0]:.1f}' if values.size == 1 else \
        f'{finite.mean():.1f} (min {finite.min():.1f})'


def point_texts(points):
    """Each grid point's flags and figures, the best (by IQM, or the mean
    under 4 seeds; never by its best seed) marked."""
    name = 'IQM' if min(p['seeds'] for p in points) >= 4 else 'mean'
    centre = [p[name.lower()] for p in points]
    best = max((i for i in range(len(points)) if centre[i] is not None),
               key=lambda i: centre[i], default=None)
    shown = []
    for i, point in enumerate(points):
        swept = ' '.join(f'{flag(k)} {_show(v)}' for k, v in point.items()
                         if k not in ('iqm', 'mean', 'worst', 'seeds'))
        figure = 'n/a' if centre[i] is None else f'{name} {centre[i]:.1f}, worst {point["worst"]:.1f}'
        shown.append(f'{swept}: {figure}' + (' (best)' if i == best else ''))
    return shown


def result_lines(summary, output_dir, one_line=False, what='done'):
    """The run's final lines: the greedy return, for a grid one line per
    point after the first (`one_line`: all in one, as --quiet prints it)."""
    at = summary['final_eval_epoch']
    said = '' if at in (None, summary['epochs']) else f" (epoch {at}'s evaluation)"
    points = point_texts(summary['points']) if len(summary['points']) > 1 else None
    figure = (returns_text(summary['final_eval_return']) if points is None else
              'by grid point' + (f': {"; ".join(points)}' if one_line else ' below'))
    return [f'{what}: {len(summary["runs"])} run(s), final greedy return {figure}{said}, wall '
            f'{summary["wall_s"]:.1f}s (compile {summary["compile_s"]:.1f}s), '
            f'results in {output_dir}'] + ([f'  {point}' for point in points or []
                                              if not one_line])
