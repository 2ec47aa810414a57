"""The command line of an algorithm script: one flag per Config field (with
its help line and constraint), the run flags, the per-env settings layer and,
on resume, the saved run's config. Layering: field defaults < the env's
settings < a saved run's config < flags typed on the command line."""

import argparse
import copy
import dataclasses
import decimal
import json
import os
import sys
import typing

import jax
import numpy as np

import common
from harness import devices
from harness import rundir


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line on stderr, status 2."""

    def error(self, message):
        self.exit(2, f'{self.prog}: error: {message}\n')


def _parse_int(text):
    """An int written as one ('12') or as a whole number ('1e3'), exactly:
    never through a float, so '1e999' or 'inf' is an error, not an overflow."""
    try:
        value = decimal.Decimal(text)
    except decimal.InvalidOperation:
        raise ValueError from None
    if not value.is_finite() or value.adjusted() > 30 or value != value.to_integral_value():
        raise ValueError
    return int(value)


def _parse_scalar(kind, text, flag):
    try:
        return _parse_int(text) if kind is int else kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f'{flag}: expected {kind.__name__}, got {text!r}') from None


def _flag_parser(kind, is_tuple, optional, sweep, flag):
    def parse(text):
        if optional and text.lower() in ('none', ''):
            return None
        parts = [part.strip() for part in text.split(',') if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f'{flag}: empty value')
        values = [_parse_scalar(kind, part, flag) for part in parts]
        if is_tuple:
            return tuple(values)
        if len(values) > 1 and not sweep:
            raise argparse.ArgumentTypeError(
                f'{flag} takes one value (it changes shapes or the program), got {text!r}')
        return values if sweep else values[0]
    return parse


DEFAULT_COMPILE_CACHE = os.environ.get(
    'JAX_COMPILATION_CACHE_DIR', os.path.join(os.path.expanduser('~'), '.cache', 'trax-rl-jax'))


def enable_compile_cache(path, explicit=True):
    """Persist compiled programs on disk (JAX's own cache) unless path is 'none'.
    A directory that cannot be used is refused in one line when given on the
    command line; the default (under a read-only HOME) is skipped with a note,
    never left to JAX's warnings on every compile."""
    if not path or path.lower() == 'none':
        return
    problem = unusable_directory(path)
    if problem and explicit:
        raise common.UsageError(f'--compile-cache {path}: {problem} (--compile-cache none '
                                'compiles without a cache)')
    if problem:
        print(f'note: no compile cache ({path}: {problem}); every program compiles from '
              'scratch (--compile-cache DIR elsewhere, or none)', file=sys.stderr, flush=True)
        return
    jax.config.update('jax_compilation_cache_dir', path)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.2)


def unusable_directory(path):
    """Why `path` cannot be a directory this process writes, or None if it can."""
    if os.path.exists(path) and not os.path.isdir(path):
        return 'exists and is not a directory'
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        return error.strerror or str(error)
    if not os.access(path, os.W_OK | os.X_OK):
        return 'not writable'
    return None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default, unless its help already says what it is;
    the epilog (the env settings table) keeps its lines."""

    def _fill_text(self, text, width, indent):
        if text.startswith(_SETTINGS_HEADING):
            return ''.join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        if '(default' in (action.help or ''):
            return action.help
        return super()._get_help_string(action)


def build_parser(config_cls, prog, description, env_settings=None):
    """A parser with one flag per config field plus the run flags; --help ends
    with the table of per-env settings."""
    parser = ArgumentParser(prog=prog, description=description, formatter_class=_HelpFormatter,
                            epilog=None if env_settings is None else env_settings_help(env_settings))
    _add_config_flags(parser, config_cls)
    _add_run_flags(parser)
    _add_process_flags(parser)
    return parser


def _add_config_flags(parser, config_cls):
    """One flag per Config field, its help line ending in the constraint."""
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        flag = '--' + field.name.replace('_', '-')
        # A name that is a Python keyword plus '_' (Trax's `lambda_`) is typed
        # without the underscore: --lambda (the literal --lambda- works too).
        flags = [flag.rstrip('-'), flag] if field.name.endswith('_') else [flag]
        flags += list(field.metadata.get('aliases', ()))
        kind, is_tuple, optional = common._base_type(hints[field.name])
        help_text = field.metadata.get('help', '')
        constraint = common.constraint_text(field, kind)
        if constraint:
            help_text += f' {{{constraint}}}'
        sweep = field.metadata.get('sweep', False)
        if sweep:
            help_text += ' [comma list = sweep]'
        if kind is bool:
            parser.add_argument(*flags, dest=field.name, default=field.default,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(*flags, dest=field.name, default=field.default,
                                type=_flag_parser(kind, is_tuple, optional, sweep, flags[0]),
                                metavar=kind.__name__.upper(), help=help_text)


def _add_run_flags(parser):
    """Flags of the run rather than the algorithm: seeds, output, devices, files."""
    run = parser.add_argument_group('run')
    run.add_argument('--seed', type=_flag_parser(int, False, False, False, '--seed'),
                     default=0, help='first seed; runs use seed, seed+1, ...')
    run.add_argument('--num-seeds', type=_flag_parser(int, False, False, False, '--num-seeds'),
                     default=1, help='independent seeds, vmapped in one program')
    run.add_argument('--output-dir', default=None,
                     help='where config, metrics, checkpoint and summary go; an existing '
                          'run there is resumed (default: a new folder under runs/)')
    run.add_argument('--only-eval', action='store_true',
                     help='restore the checkpoint in --output-dir and only evaluate')
    run.add_argument('--plot', action='store_true',
                     help='write learning_curve.png to the output dir')
    run.add_argument('--device', default=None,
                     type=_flag_parser(int, False, True, False, '--device'),
                     help='run on this one device index (default: shard runs over all)')
    run.add_argument('--time-limit', default=None, metavar='SECONDS',
                     type=_flag_parser(float, False, True, False, '--time-limit'),
                     help='stop after the last epoch that ends within SECONDS of the start '
                          '(compile included; judged by the mean epoch so far), with the '
                          'checkpoint and summary of a finished run; the same command with '
                          '--output-dir goes on from there (default: none)')
    run.add_argument('--quiet', action='store_true',
                     help='no per-epoch lines on stdout (each shows epoch k/N, env steps, the '
                          'mean return of the episodes finished most recently, which may be '
                          "an earlier epoch's where none finished in this one: metrics.jsonl "
                          "keeps Trax's per-epoch rl/avg_return; then the evaluation returns, "
                          'losses, the epoch time and an estimate of the time left)')
    run.add_argument('--tensorboard', default=True, action=argparse.BooleanOptionalAction,
                     help='TensorBoard event files under <output-dir>/tb/<run>, one dir per '
                          'seed and grid point: every metric of metrics.jsonl at step = '
                          'epoch, and the config as text')
    run.add_argument('--batch-invariant', default=True, action=argparse.BooleanOptionalAction,
                     help='CPU: bitwise the same numbers for a run in any grid, sharded over '
                          'any number of devices (XLA without its algebraic simplifier and '
                          'YNNPACK fusions other than matmuls; no device computes a single '
                          'run of a sharded program); a lone run differs in the last bits '
                          '(docs/usage.md)')
    run.add_argument('--compile-cache', default=DEFAULT_COMPILE_CACHE,
                     help="XLA's persistent compilation cache dir ('none': off); a rerun "
                          'of the same program skips most of its compile time')


def _add_process_flags(parser):
    """jax.distributed's flags: one sweep over several processes or hosts."""
    processes = parser.add_argument_group(
        'processes', 'one sweep over several processes or hosts (jax.distributed): start '
        'every process with the same flags but --process-id; the runs are sharded over all '
        "their devices, process 0 writes every file and line; --output-dir must be on a "
        'filesystem they all see to resume')
    processes.add_argument('--distributed', default=None, choices=('auto',),
                           help="auto: jax.distributed.initialize() with the cluster's "
                                'settings (SLURM, Open MPI); the flags below override them '
                                '(default: one process, unless the flags below are given)')
    processes.add_argument('--coordinator-address', default=None, metavar='HOST:PORT',
                           help="process 0's address and a free port, the same for every "
                                'process (default: none)')
    processes.add_argument('--num-processes', default=None, metavar='N',
                           type=_flag_parser(int, False, True, False, '--num-processes'),
                           help='how many processes take part (default: none)')
    processes.add_argument('--process-id', default=None, metavar='I',
                           type=_flag_parser(int, False, True, False, '--process-id'),
                           help='this process, in [0, N) (default: none)')
    processes.add_argument('--coordinator-timeout', default=60.0, metavar='SECONDS',
                           type=_flag_parser(float, False, False, False, '--coordinator-timeout'),
                           help='stop with an error if the processes are not all connected '
                                'within this time')


def given_flags(parser, argv):
    """The dests set on the command line itself, as opposed to by default.

    Lets a layer of settings sit between the defaults and the command line
    (a saved run's config on resume, an env's settings): a flag typed by the
    user always wins, a flag left out takes the layer's value.
    """
    bare = copy.deepcopy(parser)
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    return set(vars(bare.parse_args(argv)))


_SETTINGS_HEADING = 'per-env settings'


def settings_flags(settings):
    """{field: value} as the command-line flags that give those values."""
    flags = []
    for name, value in settings.items():
        flag = '--' + name.replace('_', '-').rstrip('-')
        if isinstance(value, bool):
            flags.append(flag if value else '--no-' + flag[2:])
        elif value is None:
            flags.append(f'{flag} none')
        elif isinstance(value, (tuple, list)):
            flags.append(f'{flag} {",".join(str(v) for v in value)}')
        else:
            flags.append(f'{flag} {value}')
    return ' '.join(flags)


def env_settings_help(table):
    """--help's epilog: one line per env, as the flags it amounts to."""
    lines = [f'{_SETTINGS_HEADING} (used when --env is one of these; a flag given on the '
             'command line wins):']
    for env, settings in table.items():
        lines.append(f'  {env}: {settings_flags(settings)}')
    return '\n'.join(lines if table else lines + ['  (none)'])


def apply_env_settings(config_cls, args, table, mode_field=None):
    """Set on `args` the settings of args.env that no command-line flag gave;
    -> {field: value} of those applied. Refuses a table naming no such field.

    `mode_field` (pg.py's policy_loss): an entry that sets it was tuned for
    that algorithm; when the command line asks for another, none of the entry
    applies (its other fields belong to that algorithm) -> None."""
    names = {field.name for field in dataclasses.fields(config_cls)}
    entry = (table or {}).get(args.env, {})
    if (mode_field in entry and mode_field in getattr(args, 'given', set())
            and getattr(args, mode_field) != entry[mode_field]):
        return None
    applied = {}
    for name, value in entry.items():
        if name not in names:
            raise ValueError(f'env settings for {args.env}: no config field {name!r}')
        if name not in getattr(args, 'given', set()):
            setattr(args, name, value)
            applied[name] = value
    return applied


RUN_FIELDS = ('seed', 'num_seeds')  # run flags a saved run's config records


def saved_run_config(output_dir):
    """The config a run in output_dir was saved with (its checkpoint's, or the
    previous checkpoint's when a save was cut between its renames); None when
    there is no readable one (a broken checkpoint is reported when resuming)."""
    if not output_dir:
        return None
    for name in ('checkpoint.npz', 'checkpoint.prev.npz'):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            try:
                return rundir.read_run_metadata(path)['config']
            except (ValueError, KeyError, TypeError):
                continue  # gone (a save's rename) or broken: try the previous one
    return None


def unsaved_run_config(output_dir):
    """The config.json of a run in output_dir that stopped before its first
    checkpoint (killed in its first minute): rerunning it with --output-dir
    alone starts it again with its flags. None where there is a checkpoint, a
    summary, or no readable config.json."""
    if not output_dir or any(os.path.exists(os.path.join(output_dir, name)) for name in (
            'checkpoint.npz', 'checkpoint.prev.npz', 'summary.json')):
        return None
    try:
        with open(os.path.join(output_dir, 'config.json')) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def take_saved_config(config_cls, args, saved):
    """Resume: every config field and run flag not given on the command line
    (args.given) takes the saved run's value, its grid included.

    A saved config of another algorithm or version (other fields) is left
    alone: resuming refuses it, naming the fields that differ.
    """
    fields = {field.name: field for field in dataclasses.fields(config_cls)}
    if set(saved) - {'algorithm', 'grid', *RUN_FIELDS} != set(fields):
        return False
    hints = typing.get_type_hints(config_cls)
    grid = saved.get('grid') or {}
    for name in [*fields, *RUN_FIELDS]:
        if name in args.given or name not in saved:
            continue
        value = grid.get(name, saved[name])
        if name in fields and value is not None and common._base_type(hints[name])[1]:
            value = tuple(value)  # JSON keeps tuples as lists
        setattr(args, name, list(value) if name in grid else value)
    horizon = saved.get('lr_decay_epochs')
    if ('lr_decay_epochs' not in args.given and not args.only_eval and horizon is not None
            and 'linear_decay' in str(args.lr_schedule) and args.epochs > horizon):
        raise common.UsageError(pinned_schedule_message(args.output_dir, horizon))
    return True


def pinned_schedule_message(output_dir, horizon):
    return (f'{output_dir} holds a run whose learning rate decays to 0 over {horizon} '
            f'epochs; to extend it add --lr-decay-epochs {horizon} (its schedule, lr 0 from '
            'then on) or start a new run with a larger --lr-decay-epochs or --lr-schedule '
            'constant')


def config_and_grid(config_cls, args):
    """(config with each sweep field at its first value, {field: [values]})."""
    values, grid = {}, {}
    for field in dataclasses.fields(config_cls):
        value = getattr(args, field.name)
        if field.metadata.get('sweep') and isinstance(value, list):
            if len(value) > 1:
                grid[field.name] = value
            value = value[0]
        values[field.name] = value
    if 'lr_decay_epochs' in values and values['lr_decay_epochs'] is None:
        # Pin the schedule's horizon, so a resume with more --epochs keeps it.
        values['lr_decay_epochs'] = values['epochs']
    return config_cls(**values), grid


def check_run_flags(args):
    """--num-seeds >= 1, every run's seed a valid int32 PRNG seed, the process flags."""
    if not 1 <= args.num_seeds <= common.INT32_MAX:
        raise common.UsageError(f'--num-seeds must be >= 1, got {args.num_seeds}')
    if not 0 <= args.seed <= common.INT32_MAX - args.num_seeds + 1:
        raise common.UsageError(f'--seed must be in [0, {common.INT32_MAX} - num_seeds + 1], got {args.seed}')
    time_limit = getattr(args, 'time_limit', None)
    if time_limit is not None and not 0 < time_limit < float('inf'):
        raise common.UsageError(f'--time-limit must be a number of seconds > 0, got {time_limit:g}')
    timeout = getattr(args, 'coordinator_timeout', 60.0)
    if not 1 <= timeout <= 86400:
        raise common.UsageError(f'--coordinator-timeout must be in [1, 86400] seconds, got {timeout:g}')
    devices.check_process_flags(args)


def _as_float32(value):
    with np.errstate(over='ignore', under='ignore'):
        return float(np.float32(value))


def float32_values(config, grid, names):
    """(config, grid) with the float fields in `names` as float32 holds them
    (each tuple entry and sweep value): the values the compiled program sees."""
    kinds = common._field_kinds(type(config))
    def cast(name, value):
        if value is None or kinds[name][0] is not float:
            return value
        return tuple(map(_as_float32, value)) if kinds[name][1] else _as_float32(value)
    changes = {name: cast(name, getattr(config, name)) for name in names}
    grid = {name: [cast(name, value) for value in values] if name in names else values
            for name, values in (grid or {}).items()}
    return dataclasses.replace(config, **changes), grid


def check_as_float32(config, grid, check):
    """`check(config, grid)` (the fields' bounds and the cross-field rules) on
    the values as float32: a value that passes in float64 but rounds onto a
    bound or out of range in float32 (--gamma 0.99999999 is 1, --lr 1e300 is
    inf, 1e-50 is 0) is refused, naming what it becomes."""
    kinds = common._field_kinds(type(config))
    floats = [name for name, (kind, _, _) in kinds.items() if kind is float]
    try:
        check(*float32_values(config, grid, floats))
    except common.UsageError as error:
        def typed(name):  # every value given for the field, as typed and as float32
            values = (grid or {}).get(name, [getattr(config, name)])
            entries = [entry for value in values if value is not None
                       for entry in (value if kinds[name][1] else (value,))]
            return [(entry, _as_float32(entry)) for entry in entries  # visibly moved
                    if float(f'{_as_float32(entry):.7g}') != entry]
        def fails_alone(name):
            try:
                check(*float32_values(config, grid, [name]))
            except common.UsageError:
                return True
            return False
        culprits = [name for name in floats if typed(name) and fails_alone(name)] or \
            [name for name in floats if typed(name)]
        said = ', '.join(f'--{name.rstrip("_").replace("_", "-")} {entry!r} is {value:g}'
                         for name in culprits for entry, value in typed(name))
        raise common.UsageError(f'{error} (in float32, the precision the program computes '
                                f'in: {said})') from None


def _flag(name):
    return '--' + name.rstrip('_').replace('_', '-')


def check_schedule(config, given):
    """The learning-rate schedule names a factor, and each schedule flag typed
    on the command line has a factor it acts on."""
    if not hasattr(config, 'lr_schedule'):
        return
    names = [name.strip() for name in config.lr_schedule.split('*') if name.strip()]
    if not names:
        raise common.UsageError(f'--lr-schedule {config.lr_schedule!r} names no factor '
                                "(e.g. 'constant' or 'constant * linear_decay')")
    acts_on = {'lr': 'constant', 'value_lr': 'constant', 'lr_decay_epochs': 'linear_decay',
               'warmup_steps': ('linear_warmup', 'rsqrt_decay')}
    for name, factors in acts_on.items():
        factors = (factors,) if isinstance(factors, str) else factors
        if name in given and hasattr(config, name) and not set(factors) & set(names):
            raise common.UsageError(
                f'{_flag(name)} has no effect: --lr-schedule {config.lr_schedule!r} has no '
                f'{" or ".join(factors)} factor')


# Fields that act only on Box (continuous) actions, and only with gSDE.
BOX_ONLY = ('state_dependent_exploration', 'init_log_std', 'sde_sample_freq')
EVALUATION_ONLY = ('eval_steps', 'eval_temperatures', 'eval_every')


def check_flags_act(config, agent, given):
    """Refuse a flag typed on the command line that cannot act on this env or
    mode (it would be saved, and bind a resume, while changing nothing)."""
    defaults = {field.name: field.default for field in dataclasses.fields(config)}
    given = {name for name in given if name in defaults
             and getattr(config, name) != defaults[name]}  # the default does nothing anyway
    policy = getattr(agent.spec, 'policy', None)
    if policy is not None and policy.kind != 'box':
        for name in BOX_ONLY:
            if name in given:
                raise common.UsageError(f'{_flag(name)} acts on Box (continuous) actions '
                                        f'only; {config.env} has discrete actions')
    if 'sde_sample_freq' in given and not getattr(config, 'state_dependent_exploration', True):
        raise common.UsageError('--sde-sample-freq acts with --state-dependent-exploration only')
    if getattr(config, 'n_eval_episodes', 1) == 0:
        for name in EVALUATION_ONLY:
            if name in given:
                raise common.UsageError(f'{_flag(name)} has no effect with --n-eval-episodes 0 '
                                        '(no evaluation)')
    if 'eval_steps' not in given or not config.eval_steps:
        return
    _, env_params = common.make_env(config.env, config.max_steps)
    if hasattr(env_params, 'max_steps_in_episode') and max(config.eval_steps) > agent.max_steps:
        raise common.UsageError(
            f'--eval-steps {max(config.eval_steps)}: episodes of {config.env} end by step '
            f'{agent.max_steps} (--max-steps), so a longer horizon evaluates the same; use at '
            f'most {agent.max_steps}')
