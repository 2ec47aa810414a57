"""The command line of an algorithm script: one flag per Config field (with
its help line and constraint), the run flags, the per-env settings layer and,
on resume, the saved run's config. Layering: field defaults < the env's
settings < a saved run's config < flags typed on the command line."""

import argparse
import dataclasses
import json
import os
import sys
import warnings

import jax

import common
import fields
from harness import devices
from harness import rundir


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
    warnings.showwarning = _CacheWarnings(path, warnings.showwarning)


class _CacheWarnings:
    """warnings.showwarning that says JAX's failures to read or write a cache
    entry (a full disk, a folder gone) as one note, once, and passes every
    other warning on: the run goes on, compiling without the cache."""
    PREFIXES = ('Error writing persistent compilation cache entry',
                'Error reading persistent compilation cache entry')

    def __init__(self, path, shown):
        self.path, self.shown, self.said = path, shown, False

    def __call__(self, message, category, *args, **kwargs):
        text = str(message)
        if not text.startswith(self.PREFIXES):
            return self.shown(message, category, *args, **kwargs)
        if not self.said:
            self.said = True
            why = text.rpartition("': ")[2][:200]
            print(f'note: the compile cache {self.path} failed ({why}); programs it cannot '
                  'hold compile from scratch', file=sys.stderr, flush=True)


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


def build_parser(config_cls, prog, description):
    """The one parser (fields.build_parser: a flag per config field, the seeds
    and the folder) with harness/'s run and process flags; its --help adds how
    to read the output to the per-env settings."""
    parser = fields.build_parser(config_cls, prog, description)
    parser.preamble = READING_THE_OUTPUT
    parser._option_string_actions['--output-dir'].help = (
        'where config, metrics, checkpoint and summary go; an existing run there is '
        'resumed (default: a new folder under runs/)')
    _add_run_flags(parser)
    _add_process_flags(parser)
    return parser


def _add_run_flags(parser):
    """Flags of the run rather than the algorithm: seeds, output, devices, files."""
    run = next(group for group in parser._action_groups if group.title == 'run')
    run.add_argument('--checkpoint-every', default=None, metavar='EPOCHS',
                     type=fields.value_type(int, optional=True, name='--checkpoint-every'),
                     help='epochs between checkpoints, and always the last (default: one a '
                          'minute of wall time, written by a background thread)')
    run.add_argument('--only-eval', action='store_true',
                     help='restore the checkpoint in --output-dir and only evaluate')
    run.add_argument('--plot', action='store_true',
                     help='write learning_curve.png to the output dir')
    run.add_argument('--device', default=None,
                     type=fields.value_type(int, optional=True, name='--device'),
                     help='run on this one device index (default: shard runs over all)')
    run.add_argument('--cpu-devices', default=None, metavar='N',
                     type=fields.value_type(int, optional=True, name='--cpu-devices'),
                     help='CPU: split the host into N JAX devices, so the runs are sharded '
                          'over N cores (the runs must divide evenly); each device computes '
                          'the one-device program on its runs, bitwise as on one device: '
                          'CartPole-width observations with discrete actions only (wider '
                          'ones or Box actions differ in the last bits, so are refused; '
                          'docs/usage.md); a resume keeps the count '
                          '(default: JAX\'s, one CPU device)')
    run.add_argument('--time-limit', default=None, metavar='SECONDS',
                     type=fields.value_type(float, optional=True, name='--time-limit'),
                     help='stop after the last epoch that ends within SECONDS of the start '
                          '(compile included; judged by the mean epoch so far), with the '
                          'checkpoint and summary of a finished run, its return an evaluation '
                          'of the last epoch\'s parameters; the same command with '
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
                          'any number of devices, where observations are CartPole-width with '
                          'discrete actions (wider ones: docs/usage.md) (XLA without its '
                          'algebraic simplifier and '
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
                           type=fields.value_type(int, optional=True, name='--num-processes'),
                           help='how many processes take part (default: none)')
    processes.add_argument('--process-id', default=None, metavar='I',
                           type=fields.value_type(int, optional=True, name='--process-id'),
                           help='this process, in [0, N) (default: none)')
    processes.add_argument('--coordinator-timeout', default=60.0, metavar='SECONDS',
                           type=fields.value_type(float, name='--coordinator-timeout'),
                           help='stop with an error if the processes are not all connected '
                                'within this time')


READING_THE_OUTPUT = '''reading the output:
  epoch k/N | steps S | return R (min M) | eval T0.00@500 E (min W) | ...
    steps: env steps per run so far; return: the mean over runs of each run's latest
    finished training episodes (min: the lowest run); eval T0.00@500: the evaluation
    return at temperature 0.00 (greedy; 1: epsilon-greedy or sampled) with episodes
    cut at 500 steps, the tag rl/avg_return_temperature0.00_steps500 of
    metrics.jsonl; TensorBoard plots each against env steps.
  done: ... final greedy return: the last greedy evaluation, mean (min) over runs,
    or per grid point its IQM (mean under 4 seeds) and worst seed, the best marked.'''


def apply_env_settings(config_cls, args, table, mode_field=None):
    """Set on `args` the settings of args.env that no command-line flag gave
    (fields.env_settings); -> {field: value} of those applied, or None when
    the entry is for another `mode_field` value than the one typed."""
    names = {field.name for field in dataclasses.fields(config_cls)}
    typed = {name: getattr(args, name) for name in args.given if name in names}
    applied = fields.env_settings(config_cls, table or {}, typed, mode_field)
    for name, value in (applied or {}).items():
        if name not in names:
            raise ValueError(f'env settings for {args.env}: no config field {name!r}')
        setattr(args, name, value)
    return applied


RUN_FIELDS = ('seed', 'num_seeds', 'checkpoint_every')  # run flags a saved run's config records


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
    config_fields = {field.name: field for field in dataclasses.fields(config_cls)}
    if set(saved) - {'algorithm', 'grid', *RUN_FIELDS} != set(config_fields):
        return False
    kinds = fields.field_kinds(config_cls)
    grid = saved.get('grid') or {}
    for name in [*config_fields, *RUN_FIELDS]:
        if name in args.given or name not in saved:
            continue
        if name == 'lr_decay_epochs' and not fields.decays_linearly(saved):
            continue  # inert: runs saved before it was left unpinned hold --epochs here
        value = grid.get(name, saved[name])
        if name in config_fields and value is not None and kinds[name][1]:
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
    return fields.config_and_grid(config_cls, {
        field.name: getattr(args, field.name) for field in dataclasses.fields(config_cls)})


def check_run_flags(args):
    """--num-seeds >= 1, every run's seed a valid int32 PRNG seed, the process flags."""
    if not 1 <= args.num_seeds <= fields.INT32_MAX:
        raise common.UsageError(f'--num-seeds must be >= 1, got {args.num_seeds}',
        field='num_seeds')
    if not 0 <= args.seed <= fields.INT32_MAX - args.num_seeds + 1:
        raise common.UsageError(f'--seed must be in [0, {fields.INT32_MAX} - num_seeds + 1], got {args.seed}',
        field='seed')
    every = getattr(args, 'checkpoint_every', None)
    if every is not None and not 1 <= every <= fields.INT32_MAX:
        raise common.UsageError(f'--checkpoint-every must be >= 1 (and fit int32), got {every}',
        field='checkpoint_every')
    time_limit = getattr(args, 'time_limit', None)
    if time_limit is not None and not 0 < time_limit < float('inf'):
        raise common.UsageError(f'--time-limit must be a number of seconds > 0, got {fields.show_float(time_limit)}')
    timeout = getattr(args, 'coordinator_timeout', 60.0)
    if not 1 <= timeout <= 86400:
        raise common.UsageError(f'--coordinator-timeout must be in [1, 86400] seconds, got {fields.show_float(timeout)}')
    devices.check_process_flags(args)
