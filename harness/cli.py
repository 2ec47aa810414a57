"""The experiment driver behind `python dqn.py` (and pg.py, actor_critic.py):
parse and check the flags, set up or resume the run directory, compile the
phases, loop over epochs (Trax's Agent.run) writing metrics, checkpoints and
TensorBoard, and finish with summary.json."""

import concurrent.futures
import contextlib
import dataclasses
import datetime
import errno
import functools
import gc
import importlib
import importlib.util
import json
import os
import signal
import sys
import threading
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np

import common
import fields
from harness import devices
from harness import flags
from harness import rundir


def _duration(seconds):
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m'
    return f'{seconds // 60}m{seconds % 60:02d}s' if seconds >= 60 else f'{seconds}s'


def recent_returns(history, n_runs):
    """Per run, rl/avg_return of the last epoch in history in which some episode ended."""
    recent = np.full(n_runs, np.nan)
    for record in sorted(history, key=lambda r: r['epoch']):
        if record.get('rl/avg_return') is not None:
            recent[record['run']] = record['rl/avg_return']
    return recent


def epoch_line(epoch, epochs, metrics, recent_return, seconds, seconds_left):
    """One human line: epoch k/N, returns (mean, min over runs), losses, time.

    `recent_return` is per run the mean return of the episodes that finished
    most recently (in this epoch, or the last one where any did).
    """
    parts = [f'epoch {epoch:{len(str(epochs))}d}/{epochs}',
             f'steps {int(np.max(metrics["rl/n_interactions"]))}',
             f'return {fields.returns_text(recent_return)}']
    for name in metrics:
        if name.startswith('rl/avg_return_temperature'):
            short = name[len('rl/avg_return_'):].replace('temperature', 'T').replace('_steps', '@')
            parts.append(f'eval {short} {fields.returns_text(metrics[name])}')
    for name in ('metrics/value_loss', 'metrics/policy_loss', 'metrics/exploration_rate'):
        if name in metrics:
            parts.append(f'{name.split("/")[1]} {float(np.nanmean(metrics[name])):.4g}')
    parts.append(f'{seconds:.2f}s')
    parts.append(f'left {_duration(seconds_left)}')
    return ' | '.join(parts)


# Fields that may change between a run and its resumption.
HARMLESS_FIELDS = {'epochs', 'checkpoint_every', 'eval_every'}
CHUNK_SECONDS = 3.0  # the wall time aimed at per compiled call (a chunk of epochs)
CHUNK_EPOCHS = fields.CHUNK_EPOCHS  # at most this many epochs per chunk
CHECKPOINT_SECONDS = 60.0  # between checkpoints, unless --checkpoint-every is given
SAVE_JOIN_SECONDS = 10.0  # a stopping run waits at most this for a save in flight


def _fail(prog, message, status=2, local=False):
    """One line on stderr, then exit. Over several processes an error every
    process meets alike is said by process 0 alone; a `local` one by its own."""
    _signals.stopping = True
    if local or devices.is_writer():
        try:
            print(f'{prog}: error: {one_line(message)}', file=sys.stderr, flush=True)
        except OSError:
            pass  # stderr itself is gone: the status still says it
    sys.exit(status)


def one_line(text):
    """`text` with control characters (a path's newline) escaped as repr does."""
    return ''.join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


class StdoutLost(Exception):
    """Writing to stdout failed (a closed pipe, a full device): the run stops
    as after Ctrl-C, saving first, and says so on stderr."""


def say(text):
    """A progress line on stdout; StdoutLost if it cannot be written."""
    try:
        print(one_line(text), flush=True)
    except OSError as error:
        raise StdoutLost(error.strerror or type(error).__name__) from None


def _silence_stdout():
    """Point fd 1 at /dev/null, so the interpreter's last flush of a broken
    stdout adds no 'Exception ignored' lines."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _prepare_output_dir(path, prog):
    if os.path.exists(path) and not os.path.isdir(path):
        _fail(prog, f'--output-dir {path} exists and is not a directory')
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        _fail(prog, f'cannot create --output-dir {path}: {error.strerror}')
    if not os.access(path, os.W_OK | os.X_OK):
        _fail(prog, f'--output-dir {path} is not writable')


@contextlib.contextmanager
def _writer_lock(path):
    """output_dir_lock, held by process 0 alone (the one writer); a refusal
    stops every process."""
    with contextlib.ExitStack() as stack:
        with devices.agreement():
            if devices.is_writer():
                stack.enter_context(rundir.output_dir_lock(path))
        yield


class Interrupted(BaseException):
    """SIGINT or SIGTERM, raised where the run must stop at once."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """SIGINT (Ctrl-C) and SIGTERM from main() on. Outside the epoch loop a
    signal stops the run at once (Interrupted: one line, status 128 + n);
    inside it (`deferring`) the first asks the loop to finish its chunk, save
    and stop, a second abandons the chunk. A signal whose exception Python
    swallowed (it landed in a finaliser, e.g. JAX's gc callback) stays
    `pending` and is raised at the next check()."""

    def __init__(self):
        self.pending, self.deferring, self.stopping, self.previous = None, False, False, {}

    def __enter__(self):
        self.__init__()  # (main may run again in one process)
        try:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread (a library caller): leave them
            pass
        early = sys.modules.get('harness.early_signals')  # one held during the imports
        if early is not None and early.pending is not None:
            self.pending, early.pending = early.pending, None
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            # Stopping for a signal: one more while the process exits changes nothing.
            signal.signal(signum, handler if self.pending is None else signal.SIG_IGN)
        self.stopping = False
        return False

    def _handle(self, signum, frame):
        if self.stopping:  # the line is said; one more signal changes nothing
            return
        if self.deferring and self.pending is None:
            self.pending = signum
            try:
                print(f'{signal.Signals(signum).name}: finishing this chunk of epochs, then '
                      'saving (Ctrl-C again to abandon it)', file=sys.stderr, flush=True)
            except OSError:
                pass
            return
        self.pending = signum
        if not _in_finaliser(frame):  # there Python would print it and carry on
            raise Interrupted(signum)

    def check(self):
        if self.pending is not None:
            raise Interrupted(self.pending)

    @contextlib.contextmanager
    def deferred(self):
        self.check()
        self.deferring = True
        try:
            yield self
        finally:
            self.deferring = False


_signals = _Signals()


def _in_finaliser(frame):
    """Is `frame` inside a gc callback (JAX has one) or a __del__?"""
    callbacks = {getattr(callback, '__code__', None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == '__del__':
            return True
        frame = frame.f_back
    return False


def config_differences(saved, current):
    differing = sorted(name for name in set(saved) | set(current)
                       if name not in HARMLESS_FIELDS and saved.get(name) != current.get(name))
    if not any(fields.decays_linearly(config) for config in (saved, current)):
        # --lr-decay-epochs acts on linear_decay alone; runs saved before it was
        # left unpinned without that factor hold --epochs there, harmlessly
        differing = [name for name in differing if name != 'lr_decay_epochs']
    return differing


def main(config_cls, make_agent, check_runs, prog, description, argv=None,
         env_settings=None, settings_mode_field=None):
    """The command line of an algorithm script: parse flags, then fill in the
    flags not given: from the env's settings (`env_settings`: a table, or a
    function of the typed values giving one), and on resume from the saved
    config (defaults < env settings < saved config < flags given); check
    every run's values (fields.check_grid with the algorithm's `check_runs`),
    then run (or resume, or only evaluate) the experiment."""
    with _signals, rundir.matplotlib_config_dir():
        try:
            _signals.check()
            return _main(config_cls, make_agent, check_runs, prog, description,
                         argv, env_settings, settings_mode_field)
        except Interrupted as stop:
            _fail(prog, f'interrupted ({signal.Signals(stop.signum).name}) before the first '
                        'epoch; nothing was run', status=128 + stop.signum)
        except StdoutLost as error:
            _silence_stdout()
            _fail(prog, f'cannot write to stdout ({error}); nothing was run', status=1)


def _main(config_cls, make_agent, check_runs, prog, description, argv,
          env_settings, settings_mode_field):
    parser = flags.build_parser(config_cls, prog, description)
    args, args.given, env_settings = fields.parse(parser, argv, env_settings)
    try:
        common.check_precision()  # JAX_ENABLE_X64: before any value is checked or traced
        devices.use_cpu_devices(getattr(args, 'cpu_devices', None))  # before JAX starts
        flags.enable_compile_cache(args.compile_cache,  # before make_agent's first program
                                   explicit='compile_cache' in args.given)
    except common.UsageError as error:
        parser.error(str(error))
    applied = flags.apply_env_settings(config_cls, args, env_settings, settings_mode_field)
    agent = None
    try:
        saved = flags.saved_run_config(args.output_dir)
        unsaved = None if saved is not None else flags.unsaved_run_config(args.output_dir)
        saved_flags = saved  # the layer of a saved run's flags, if any
        args.sees_saved_run = saved is not None  # processes must agree (check_same_flags)
        if saved is not None:  # resume: what the command line leaves out is the saved run's
            flags.take_saved_config(config_cls, args, saved)
            _check_typed_against_saved(config_cls, args, saved)
        elif unsaved is not None and flags.take_saved_config(config_cls, args, unsaved):
            saved_flags = unsaved
            # a run killed before its first checkpoint: rerun with its flags
            if not args.quiet and not args.only_eval:
                say(f'{prog}: {args.output_dir} holds a run that stopped before its first '
                    'checkpoint: running it again from epoch 1 with its flags (config.json)')
        elif applied is None and not args.quiet:
            mode = fields.settings_flags({settings_mode_field: env_settings[args.env][settings_mode_field]})
            say(f'{prog}: the settings for {args.env} are for {mode}: not applied to '
                f'{fields.settings_flags({settings_mode_field: getattr(args, settings_mode_field)})}')
        args.setting_sources = {  # where each value not typed came from, for messages
            **{name: f'the settings for {args.env}' for name in applied or {}},
            **{name: f'the run saved in {args.output_dir}' for name in (saved_flags or {})
               if name not in args.given}}
        fresh = saved_flags is None

        config, grid, dropped, agent = _checked_config(config_cls, make_agent, check_runs, args,
                                                       (applied or {}) if fresh else {})
        if fresh and (applied or dropped) and not args.quiet:
            say(f'{prog}: settings for {args.env}: {fields.settings_flags(applied) or "none"}'
                ' (a flag on the command line overrides each)'
                + (f'; not applied: {fields.settings_flags(dropped)} (inert with the flags '
                   'given)' if dropped else ''))
    except common.UsageError as error:
        parser.error(_with_source(error, args))
    except ValueError as error:  # the env or a registry entry, as the run's set-up says it
        _fail(prog, str(error), status=1)
    return run_experiment(make_agent, config, grid, args, prog, agent)


def _checked_config(config_cls, make_agent, check_runs, args, applied):
    """(config, grid, dropped, agent) after every check a flag meets before
    the run. A setting of the env's (in `applied`) that the flags typed make
    inert (refused as one that cannot act: `--max-slice-length acts with
    --torso gru only` under `--env MetaMaze-misc --torso mlp`) is not applied:
    it is dropped (back to its default) and the checks run again. The agent is
    made here, once, except before jax.distributed starts (no JAX backend
    yet): then the run's set-up makes it (None here)."""
    dropped = {}
    defaults = {field.name: field.default for field in dataclasses.fields(config_cls)}
    while True:
        # The fields this command set, which make_agent refuses when they cannot
        # act (fields.check_inert): typed, from the env's settings or the saved
        # run (_with_source names where a value not typed came from).
        args.set_fields = dict.fromkeys(sorted({*args.setting_sources, *args.given} - {*dropped}))
        try:
            config, grid = flags.config_and_grid(config_cls, args)
            flags.check_run_flags(args)
            fields.check_grid(config, grid, check_runs)
            if devices.distributed_requested(args):
                return config, grid, dropped, None
            return config, grid, dropped, make_agent(config, given=args.set_fields)
        except common.UsageError as error:
            field = fields.inert_setting(error, applied, args.given)
            if field is None:
                raise
            dropped[field] = applied.pop(field)
            setattr(args, field, defaults[field])


def _check_typed_against_saved(config_cls, args, saved):
    """A resume refuses typed values other than the saved run's, naming them,
    before any check of what a changed value would make inert (a GRU run
    resumed with --torso mlp is refused for its torso, not its --gru-size)."""
    def plain(value):
        value = json.loads(json.dumps(value))
        return value[0] if isinstance(value, list) and len(value) == 1 else value
    grid = saved.get('grid') or {}
    differing = []
    for name in [field.name for field in dataclasses.fields(config_cls)] + list(flags.RUN_FIELDS):
        if name not in args.given or name in HARMLESS_FIELDS or name not in saved:
            continue
        typed, kept = plain(getattr(args, name)), plain(grid.get(name, saved[name]))
        if typed != kept and not (name == 'lr_decay_epochs' and not fields.decays_linearly(saved)):
            differing.append((name, kept, typed))
    if any(name == 'joint' for name, _, _ in differing):
        raise common.UsageError(
            f"{args.output_dir} holds a run {'with' if saved['joint'] else 'without'} --joint: "
            "a saved run's --joint cannot change; use another --output-dir")
    if differing:
        raise common.UsageError(
            f'{args.output_dir} holds a run with a different config; differing: '
            + ', '.join(f'{name} (saved {kept!r}, now {typed!r})' for name, kept, typed in differing)
            + '; use another --output-dir')


def _with_source(error, args):
    """The refusal, saying where the value of the field it refuses came from
    when it was not typed (the env's settings, the saved run): never blamed
    as if typed."""
    name, sources = getattr(error, 'field', None), getattr(args, 'setting_sources', {})
    if name in sources and name not in getattr(args, 'given', ()):
        value = fields.settings_flags({name: getattr(args, name, None)})
        return f'{error} ({value} is from {sources[name]}, not the command line)'
    return str(error)


def run_experiment(make_agent, config, grid, args, prog, agent=None):
    """Parse-independent driver: set up, resume, loop epochs, save results
    (`agent`: make_agent's for this config, if made already)."""
    try:
        return _run_experiment(make_agent, config, grid, args, prog, agent)
    except common.UsageError as error:
        _fail(prog, _with_source(error, args), local=getattr(error, 'local', False))
    except ValueError as error:  # corrupt / mismatched checkpoint, remaining_evals
        _fail(prog, str(error), status=1, local=getattr(error, 'local', False))
    except (jax.errors.JaxRuntimeError, MemoryError) as error:
        if devices._processes.started and devices._lost_contact(error):
            devices.lost_a_process(prog, error)
        if not devices._out_of_memory(error):
            raise
        # check_memory's estimate is a floor; this is XLA finding it short.
        first_line = (str(error).strip().splitlines() or ['MemoryError'])[0][:300]
        _fail(prog, f'out of memory: {first_line}; any checkpoint in --output-dir is kept '
                    '(lower --num-seeds, the grid or the buffer sizes)', status=1)


def _run_experiment(make_agent, config, grid, args, prog, agent):
    run = _set_up(make_agent, config, grid, args, prog, agent)
    try:
        with _writer_lock(run.output_dir):  # one writer per run dir, from here on
            return _locked_experiment(run, args, prog)
    except Interrupted as stop:
        if run.finished:
            _fail(prog, f'interrupted ({signal.Signals(stop.signum).name}) after the run '
                        f'finished: its results are complete in {run.output_dir} '
                        '(summary.json); nothing to rerun', status=128 + stop.signum)
        _fail(prog, f'interrupted ({signal.Signals(stop.signum).name}); {_kept(run)}',
              status=128 + stop.signum)
    except StdoutLost as error:
        _silence_stdout()
        _fail(prog, f'cannot write to stdout ({error}); {_kept(run)}', status=1)
    except OSError as error:  # a full disk, EIO, a permission: what, where, what is kept
        what = repr(error.filename) if error.filename else 'OS error'
        _fail(prog, f'{what}: {error.strerror or error} ({errno.errorcode.get(error.errno, "?")}'
                    f'); {_kept(run)}', status=1)


def _kept(run):
    """What a stopped run leaves: the epoch of its last whole checkpoint."""
    for path in (run.checkpoint_path, run.previous_path):
        try:
            epoch = rundir.read_run_metadata(path)['epoch']
        except (ValueError, KeyError, TypeError):
            continue
        if epoch >= run.config.epochs:
            return (f'all {epoch} epochs are saved in {run.output_dir}; rerun with '
                    f'--output-dir {run.output_dir} to write the summary')
        return (f'the checkpoint of epoch {epoch} in {run.output_dir} is kept; rerun with '
                f'--output-dir {run.output_dir} to resume from it')
    return f'no checkpoint was saved in {run.output_dir}; nothing to resume'


def _locked_experiment(run, args, prog):
    _find_saved_run(run, args.only_eval)
    state, phases = _compile_phases(run, args)
    _signals.check()  # one that landed where Python swallows it (a gc callback)
    if run.resuming:
        state = _restore(run, state)
        if not args.only_eval:
            _show(f'resumed {run.output_dir} at epoch {run.start_epoch} of {run.config.epochs}',
                  args)
    if not args.only_eval and devices.is_writer():
        _write_config(run)
    if args.only_eval:
        return _only_eval(run, phases, state, args)
    last = _epoch_loop(run, phases, state, args, prog)
    _finish(run, args)
    return last


def _write_config(run):
    """config.json, the run's config as the checkpoint holds it (with this
    command's --epochs): rewritten when deleted or edited by hand."""
    path = os.path.join(run.output_dir, 'config.json')
    data = json.dumps(run.run_config, indent=2).encode()
    try:
        with open(path, 'rb') as f:
            if f.read() == data:
                return
    except OSError:
        pass
    rundir.atomic_write_bytes(path, data)


@dataclasses.dataclass
class _Run:
    """What the driver's pieces share about one experiment (all its runs)."""
    agent: common.Agent
    config: typing.Any
    runs: list  # one dict per run: seed and grid values
    hp: typing.Any  # the runs' hyperparameters, [n_runs, ...] on `sharding`
    keys: typing.Any  # one PRNG key per run
    sharding: typing.Any
    output_dir: str
    run_config: dict  # what config.json and the checkpoint record
    resuming: bool
    wall_start: float
    batch_invariant: bool = True  # --batch-invariant
    pad: int = 0  # copies of runs that keep every device at 2+ runs (lone_run_padding)
    compile_s: float = 0.0
    start_epoch: int = 0
    history: list = dataclasses.field(default_factory=list)  # metric records so far
    finished: bool = False  # summary.json written

    @property
    def checkpoint_path(self):
        return os.path.join(self.output_dir, 'checkpoint.npz')

    @property
    def previous_path(self):
        return os.path.join(self.output_dir, 'checkpoint.prev.npz')

    @property
    def metrics_path(self):
        return os.path.join(self.output_dir, 'metrics.jsonl')


def _set_up(make_agent, config, grid, args, prog, agent=None):
    """Check the flags and the output dir before compiling; write nothing."""
    wall_start = time.time()
    common.check_precision()
    flags.check_run_flags(args)
    if getattr(args, 'tensorboard', True) and importlib.util.find_spec('tensorboardX') is None:
        raise common.UsageError('TensorBoard summaries need the tensorboardX package '
                         '(pip install -r requirements.lock); or pass --no-tensorboard')
    devices.start_processes(args, prog)  # with the process flags: connect, before any JAX work
    devices.check_same_flags(args)
    runs = common.expand_runs(config, grid, args.seed, args.num_seeds)
    # make_agent checks the config, the env and the fields that cannot act.
    # (a refusal says where its value came from: run_experiment adds that)
    agent = agent or make_agent(config, given=getattr(args, 'set_fields',
                                                      getattr(args, 'given', set())))
    sharding = devices._run_sharding(len(runs), args.device, getattr(args, 'cpu_devices', None))
    _check_cpu_sharding(agent, sharding, getattr(args, 'cpu_devices', None))
    pad = devices.lone_run_padding(len(runs), sharding, getattr(args, 'batch_invariant', True))
    hp = _pad_rows(common.hyperparameters(config, runs), pad)

    output_dir = args.output_dir
    if output_dir is None:
        if args.only_eval:
            raise common.UsageError('--only-eval needs --output-dir of a saved run')
        now = datetime.datetime.fromtimestamp(devices.from_process_0(int(time.time())))
        output_dir = os.path.join(
            'runs', f'{agent.name}_{config.env}_s{args.seed}_{now.strftime("%Y%m%d-%H%M%S")}')
    checkpoint_path = os.path.join(output_dir, 'checkpoint.npz')
    with devices.agreement():  # this host's memory and (process 0) files
        devices.check_memory(agent, hp, jax.ShapeDtypeStruct((len(runs) + pad, 2), jnp.uint32),
                     sorted(sharding.device_set, key=lambda device: device.id),
                     devices.memory_hint(config, agent.memory_flags))
        if devices.is_writer():
            if args.only_eval and not any(os.path.isfile(os.path.join(output_dir, name))
                                          for name in ('checkpoint.npz', 'checkpoint.prev.npz')):
                # (checkpoint.npz alone is briefly absent while a running writer saves)
                writer = rundir.lock_holder(output_dir)
                if writer is not None:
                    raise common.UsageError(
                        f'another run (pid {writer}) is writing {output_dir} and has saved no '
                        'checkpoint yet: --only-eval evaluates a checkpoint; rerun it after '
                        "that run's first one (a minute, or its --checkpoint-every epoch)")
                if os.path.isfile(os.path.join(output_dir, 'config.json')):
                    raise common.UsageError(
                        f'--only-eval: the run in {output_dir} stopped before its first '
                        f'checkpoint, so there is nothing to evaluate; rerun it with '
                        f'--output-dir {output_dir} (it starts again with its flags)')
                raise common.UsageError(f'--only-eval: no checkpoint at {checkpoint_path}')
            _prepare_output_dir(output_dir, prog)

    run_config = {'algorithm': agent.name, **dataclasses.asdict(config), 'grid': grid,
                  'seed': args.seed, 'num_seeds': args.num_seeds,
                  'checkpoint_every': getattr(args, 'checkpoint_every', None)}
    run_config = json.loads(json.dumps(run_config))  # tuples -> lists, as saved
    keys = common.run_keys(runs)
    return _Run(agent=agent, config=config, runs=runs, hp=devices.put_global(hp, sharding),
                keys=devices.put_global(_pad_rows(keys, pad), sharding), sharding=sharding,
                output_dir=output_dir, run_config=run_config, resuming=False,
                wall_start=wall_start, batch_invariant=getattr(args, 'batch_invariant', True),
                pad=pad)


def _pad_rows(tree, pad):
    """[n_runs, ...] leaves with `pad` copies of the first runs appended (the
    device padding of devices.lone_run_padding)."""
    if not pad:
        return tree
    return jax.tree.map(lambda leaf: np.concatenate([np.asarray(leaf), np.asarray(leaf)[:pad]]),
                        tree)


def _real_rows(run, tree):
    """The runs' own rows of gathered [n_rows, ...] leaves: the padding dropped."""
    if not run.pad:
        return tree
    return jax.tree.map(lambda leaf: leaf[:len(run.runs)], tree)


def _find_saved_run(run, only_eval):
    """Is there a run to resume (process 0 decides)? Refuse a broken checkpoint
    or another config before compiling."""
    if devices.is_writer() and not os.path.exists(run.checkpoint_path) \
            and os.path.exists(run.previous_path):
        # A crash between the two renames of a save: the previous one is whole.
        os.replace(run.previous_path, run.checkpoint_path)
    run.resuming = bool(devices.from_process_0(os.path.exists(run.checkpoint_path)))
    with devices.agreement():
        if not run.resuming and devices.is_writer():
            _refuse_overwriting(run)
    with devices.agreement():  # every process reads the checkpoint to resume
        if run.resuming and not os.path.exists(run.checkpoint_path):
            raise common.UsageError(f'process 0 resumes from {run.checkpoint_path}, which this '
                             'process cannot see; --output-dir must be on a filesystem every '
                             'process shares')
        if run.resuming:
            epoch = _check_saved_config(run)['epoch']
            if epoch > run.config.epochs and not only_eval:
                raise common.UsageError(
                    f'--epochs {run.config.epochs} is below the {epoch} epochs the run in '
                    f'{run.output_dir} has done: give --epochs {epoch} or more to go on (or '
                    'leave it out), or --only-eval to evaluate it; nothing was changed')
            if devices.is_writer() and not only_eval:  # what the run rewrites must be whole
                rundir.check_history(rundir.read_history(run.metrics_path, epoch), epoch,
                                     len(run.runs), run.metrics_path)


def _previous_hint(run):
    """What to do about a damaged checkpoint.npz: use the previous one, if it is whole."""
    if not os.path.exists(run.previous_path):
        return '; there is no previous checkpoint: start a new --output-dir'
    try:
        epoch = rundir.read_run_metadata(run.previous_path)['epoch']
    except ValueError:
        return (f'; the previous checkpoint {run.previous_path} is damaged too: start a new '
                '--output-dir')
    return (f'; the previous checkpoint {run.previous_path} (epoch {epoch}) is intact: move '
            f'it to {run.checkpoint_path} to resume from it')


def _refuse_overwriting(run):
    """A new run in a directory with no checkpoint: refuse it where the files
    there are not this run's first epochs, redone bitwise (a finished run whose
    checkpoint was deleted, another config's files)."""
    if os.path.exists(os.path.join(run.output_dir, 'summary.json')):
        raise common.UsageError(
            f'{run.output_dir} holds a finished run (summary.json) but no checkpoint.npz to '
            'resume from; restore it, or start a new --output-dir')
    try:
        with open(os.path.join(run.output_dir, 'config.json')) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        return  # none (or unreadable): nothing recorded to protect
    differing = config_differences(recorded, run.run_config) if isinstance(recorded, dict) \
        else ['config.json']
    if differing and not os.path.exists(os.path.join(run.output_dir, 'checkpoint.prev.npz')) \
            and isinstance(recorded, dict) and recorded.get('algorithm') == run.agent.name:
        raise common.UsageError(
            f'{run.output_dir} holds a run that stopped before its first checkpoint, with '
            f'other flags (config.json differs: {", ".join(differing[:5])}); rerun it with '
            f'--output-dir {run.output_dir} and no flag that changes them (it starts again '
            'from epoch 1 with its own), or start a new --output-dir')
    if differing:
        raise common.UsageError(
            f'{run.output_dir} holds the files of another run (config.json differs: '
            f'{", ".join(differing[:5])}) and no checkpoint; start a new --output-dir')


def _check_saved_config(run):
    """The saved run's config must be this one, up to HARMLESS_FIELDS."""
    try:
        saved = rundir.read_run_metadata(run.checkpoint_path)
    except ValueError as error:
        raise ValueError(f'{error}{_previous_hint(run)}') from None
    differing = config_differences(saved['config'], run.run_config)
    if differing == ['lr_decay_epochs']:  # --epochs grew; the schedule is pinned
        raise common.UsageError(flags.pinned_schedule_message(run.output_dir,
                                                 saved['config']['lr_decay_epochs']))
    _check_same_devices(run, saved.get('devices'))
    if 'joint' in differing:  # one optimiser or two: another state and another algorithm
        raise common.UsageError(
            f"{run.output_dir} holds a run {'with' if saved['config']['joint'] else 'without'} "
            "--joint: a saved run's --joint cannot change; use another --output-dir")
    if differing:
        raise common.UsageError(
            f'{run.output_dir} holds a run with a different config; differing: '
            + ', '.join(f'{name} (saved {saved["config"].get(name)!r}, now '
                        f'{run.run_config.get(name)!r})' for name in differing)
            + '; use another --output-dir')
    return saved


# Observations up to this many values: a run's numbers are bitwise the same
# whatever the number of runs a device computes (tested on CartPole's 4); with
# wider ones they depend on it (docs/usage.md), so on the number of devices.
BITWISE_OBS_SIZE = 4


def _runs_per_device_matter(agent):
    """None where a run's numbers do not depend on how many runs its device
    computes (CartPole-width observations, discrete actions: tested), else
    why they do: observations wider than BITWISE_OBS_SIZE, or Box actions
    (PPO on Pendulum-v1), in the last bits at XLA CPU's optimisation levels
    1 and 2 (docs/usage.md)."""
    policy = getattr(getattr(agent, 'spec', None), 'policy', None)
    box = getattr(policy, 'kind', 'discrete') == 'box'
    obs_size = int(np.prod(agent.obs_shape))
    if obs_size <= BITWISE_OBS_SIZE and not box:
        return None
    return f'with {obs_size} observation values{" and Box actions" if box else ""} the numbers ' \
        'depend on the runs per device in the last bits (docs/usage.md, sharding)'


def _check_cpu_sharding(agent, sharding, cpu_devices):
    """Refuse runs sharded over several CPU devices (--cpu-devices, or several
    processes) where their numbers would not be bitwise one device's."""
    why = _runs_per_device_matter(agent)
    if why is None or len(sharding.device_set) < 2 or \
            next(iter(sharding.device_set)).platform != 'cpu':
        return
    over = f'--cpu-devices {cpu_devices}' if cpu_devices else \
        f'{len(sharding.device_set)} CPU devices'
    raise common.UsageError(
        f'{over}: {why}, so runs sharded over {len(sharding.device_set)} devices would not '
        'be bitwise those on one; run on one device' +
        (' (without --cpu-devices)' if cpu_devices else ' (--device 0)'))


def _check_same_devices(run, saved_devices):
    """Refuse a resume on another number of devices where a run's numbers
    depend in their last bits on how many runs each device's program computes
    (_runs_per_device_matter), where it would match neither uninterrupted run."""
    now = len(run.sharding.device_set)
    if saved_devices is None or saved_devices == now:
        return
    why = _runs_per_device_matter(run.agent)
    if why is None:
        return  # CartPole's width, discrete actions: bitwise on any count (tested)
    raise common.UsageError(
        f'{run.output_dir} was run on {saved_devices} device(s), this run would use {now}: '
        f'{why}; resume on {saved_devices} device(s)' + (
            ' (--device 0 for one)' if saved_devices == 1 else
            f' (--cpu-devices {saved_devices} on CPU)'))


def _compile_phases(run, args):
    """Compile init and the chunk of epochs (or, for --only-eval, evaluate);
    run init. Returns (initial state, {name: compiled})."""
    compile_start = time.time()
    init = run.agent.batched('init')
    if args.only_eval:
        state = _compiled(run, init, run.keys, run.hp)(run.keys, run.hp)
        phases = {'evaluate': _compiled(run, run.agent.batched('evaluate'), run.hp, state)}
    else:
        length = min(CHUNK_EPOCHS, run.config.epochs)
        def chunk(hp, state, plan):  # plan: [n_runs, 4], every row start, n, epochs, eval_every
            return common.run_epochs(run.agent, length, hp, state, *plan[0])
        def initial_state():
            return _compiled(run, init, run.keys, run.hp)(run.keys, run.hp)
        state, compiled = _overlapped(initial_state, functools.partial(
            _compiled, run, chunk, run.hp, _state_shapes(run, init), _plan(run, 0, 1)))
        phases = {'chunk': compiled, 'length': length}
    run.compile_s = time.time() - compile_start
    return state, phases


def _overlapped(first, second):
    """(first(), second()), second in a thread of its own: XLA compiles with
    the GIL released, so the chunk's compile runs beside init's compile and
    run on a second core. The programs are those compiled one after the other."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        later = pool.submit(second)
        return first(), later.result()


def _state_shapes(run, init):
    """init's output as ShapeDtypeStructs on the run's sharding: the chunk
    compiles from them before init has run."""
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                          sharding=run.sharding),
                        jax.eval_shape(init, run.keys, run.hp))


def _compiled(run, function, *example):
    """`function` of batched arguments, compiled with every leaf of every input
    and output [n_runs, ...] on the run's sharding."""
    options = common.compiler_options(run.batch_invariant)
    if isinstance(run.sharding, jax.sharding.NamedSharding):
        # Each device runs its own copy of the one-device program on its rows:
        # bitwise that of one device (an SPMD-partitioned program is not).
        return devices.PerDevice(function, example, run.sharding, options)
    return jax.jit(function, in_shardings=run.sharding, out_shardings=run.sharding).lower(
        *example).compile(compiler_options=options)


def _plan(run, start, n):
    """The chunk's traced plan, one identical row per run (sharded as the runs)."""
    row = [start, n, run.config.epochs, common.evaluation_period(run.config)]
    return devices.put_global(np.tile(np.asarray(row, np.int32), (len(run.runs) + run.pad, 1)),
                              run.sharding)


def _restore(run, state):
    """Load the checkpoint into `state`'s structure; set start_epoch and history."""
    config = run.config
    with devices.agreement():
        template = jax.tree.map(  # the runs' own rows, as the checkpoint holds them
            lambda leaf: jax.ShapeDtypeStruct((len(run.runs), *leaf.shape[1:]), leaf.dtype), state)
        restored, saved = rundir.load_checkpoint(run.checkpoint_path, template)
    state = devices.put_global(_pad_rows(restored, run.pad), run.sharding)
    run.start_epoch = saved['epoch']
    if devices.is_writer():
        run.history = rundir.read_history(run.metrics_path, run.start_epoch)
    # Trax's check that the trainer is at an epoch boundary.
    for step in np.unique(np.asarray(restored.train_step)):
        try:
            left = common.remaining_evals(int(step), run.start_epoch + 1, config.train_steps_per_epoch,
                                   config.evals_per_epoch)
        except ValueError as error:
            left = error
        if left != config.evals_per_epoch:
            raise ValueError(f'checkpoint {run.checkpoint_path}: trainer step {int(step)} is not '
                             f'at the end of epoch {run.start_epoch} ({left} evals left)')
    return state


def _only_eval(run, phases, state, args):
    """--only-eval: one evaluation of the saved parameters, into eval.jsonl."""
    _, metrics = phases['evaluate'](run.hp, state)
    metrics = _real_rows(run, devices.gather(metrics))
    if not devices.is_writer():
        return metrics
    records = fields.metric_records(run.start_epoch, metrics, run.runs)
    rundir.write_jsonl(os.path.join(run.output_dir, 'eval.jsonl'), records)
    if args.plot:  # the learning curves of metrics.jsonl, up to the checkpoint
        rundir.plot_learning_curves(run.history, run.agent, run.config.env,
                                    os.path.join(run.output_dir, rundir.PLOT_FILE))
    summary = fields.summary(run.agent, run.config, run.runs, run.run_config.get('grid'),
                             records, time.time() - run.wall_start, run.compile_s)
    for line in fields.result_lines(summary, os.path.join(run.output_dir, 'eval.jsonl'),
                                    one_line=args.quiet, what='evaluated epoch '
                                    f'{run.start_epoch}\'s parameters'):
        say(line)
    if args.plot and not args.quiet:
        say(f'learning curves of epochs 1-{run.start_epoch} in '
            f'{os.path.join(run.output_dir, rundir.PLOT_FILE)}')
    return metrics


def _run_chunk(run, phases, state, start, n):
    """Epochs start+1 .. start+n in one compiled call -> (state, [(epoch,
    metrics as numpy [n_runs])], finite [n, n_runs]), with timings: a chunk's
    epochs share its mean epoch time."""
    chunk_start = time.time()
    state, metrics, finite = phases['chunk'](run.hp, state, _plan(run, start, n))
    metrics, finite = _real_rows(run, devices.gather((metrics, finite)))  # waits for the chunk
    if _signals.pending is not None:  # done: one more Ctrl-C has no chunk left to abandon
        _signals.stopping = True  # (raised in the save, it would end in a traceback)
    seconds = (time.time() - chunk_start) / n
    evaluated = {common.return_tag(*tag) for tag in run.agent.eval_tags}
    epochs = []
    for i in range(n):
        epoch = start + i + 1
        due = common.evaluation_due(epoch, run.config.epochs, common.evaluation_period(run.config))
        values = {name: value[:, i] for name, value in metrics.items()
                  if due or name not in evaluated}
        values['rl/n_interactions_per_second'] = values.pop('rl/new_interactions') / seconds
        values['timing/epoch'] = np.full(len(run.runs), seconds)
        values['timing/since_start'] = np.full(
            len(run.runs), chunk_start + seconds * (i + 1) - run.wall_start)
        epochs.append((epoch, values))
    return state, epochs, finite[:, :n].T


def _chunk_size(run, length, progress, epoch, args):
    """Epochs in the next chunk: about CHUNK_SECONDS of work (one epoch first,
    to time it), up to the next --checkpoint-every epoch, the last epoch and
    what fits in --time-limit (the loop stops before a chunk none of fits)."""
    config = run.config
    n = min(length, config.epochs - epoch)
    if progress.per_epoch is None:
        return 1
    n = min(n, max(1, int(CHUNK_SECONDS / progress.per_epoch)))
    every = getattr(args, 'checkpoint_every', None)
    if every:
        n = min(n, every - epoch % every)
    time_limit = getattr(args, 'time_limit', None)
    if time_limit is not None:
        left = time_limit - (time.time() - run.wall_start)
        n = min(n, max(1, int(left / progress.per_epoch)))
    return devices.from_process_0(n)  # every process runs the same chunks


def _epoch_loop(run, phases, state, args, prog):
    """Epochs start_epoch+1 .. config.epochs in chunks: metrics, checkpoints,
    the NaN guard, Ctrl-C and --time-limit at chunk boundaries. Returns the
    last epoch's metrics."""
    config = run.config
    # The checkpoint decides: drop lines of epochs after it (they are redone).
    if devices.is_writer():
        rundir.atomic_write_bytes(run.metrics_path, b''.join(
            (json.dumps(record) + '\n').encode() for record in run.history))
    last, epoch = {}, run.start_epoch
    progress = _Progress(run)
    with _signals.deferred(), _Saver(run) as saver, \
            rundir.Summaries(run.output_dir, run.runs, run.run_config, run.history,
                      enabled=getattr(args, 'tensorboard', True) and devices.is_writer()) as summaries:
        while epoch < config.epochs:
            n = _chunk_size(run, phases['length'], progress, epoch, args)
            state, epochs, finite = _run_chunk(run, phases, state, epoch, n)
            _nan_guard(run, epochs, finite, saver, summaries, prog)
            _record(run, epochs, summaries)
            saver.check()  # a save that failed meanwhile stops the run now, not at the next
            epoch, last = epochs[-1]
            progress.update(epoch, epochs)
            lost = _show(progress.line(epoch, last), args)
            # Every process stops together: a signal or a lost stdout on any.
            stop = devices.any_process(_signals.pending is not None or lost is not None)
            out_of_time = progress.out_of_time(epoch, getattr(args, 'time_limit', None))
            every = getattr(args, 'checkpoint_every', None)
            if (epoch % every == 0 if every else saver.due()) or epoch == config.epochs \
                    or stop or out_of_time:
                saver.save(state, epoch)
            if stop:
                saver.wait()
                _stop_after(run, epoch, lost, prog)
            if out_of_time and epoch < config.epochs:
                _evaluate_at_stop(run, phases, state, epoch)
                if devices.is_writer():
                    _show(f'time limit: stopped after epoch {epoch} of {config.epochs} '
                          f'({_evaluation_note(run)}); rerun with --output-dir '
                          f'{run.output_dir} to go on', args)
                break
    return last


def _evaluate_at_stop(run, phases, state, epoch):
    """A time-limit stop between two evaluations: evaluate the parameters it
    stops with (the evaluation compiled then, past the limit), for summary.json alone (the state it returns is dropped and
    metrics.jsonl keeps the evaluations an unstopped run makes, so a resume
    stays bitwise as if never stopped)."""
    tag = fields.final_return_tag(run.agent, run.config)
    if tag is None or fields.last_evaluation(run.history, tag) == epoch:
        return
    evaluate = phases.get('evaluate') or _compiled(run, run.agent.batched('evaluate'), run.hp,
                                                   state)  # (compiled now: a stop is rare)
    _, metrics = evaluate(run.hp, state)
    metrics = _real_rows(run, devices.gather(metrics))
    values = {record['run']: record for record in fields.metric_records(epoch, metrics, run.runs)}
    for index, record in enumerate(run.history):  # (in place: the writers hold the list)
        if record['epoch'] == epoch:
            run.history[index] = {**record, **{name: value for name, value in values[
                record['run']].items() if name.startswith('rl/avg_return_')}}


def _record(run, epochs, summaries, until=None):
    """A chunk's metric records into the history, metrics.jsonl and TensorBoard;
    with `until` ([n_runs] epochs), each run's records of epochs before its own."""
    records = [record for number, metrics in epochs
               for record in fields.metric_records(number, metrics, run.runs)
               if until is None or number < until[record['run']]]
    run.history.extend(records)
    # Metrics first, then the checkpoint: a crash between the two leaves
    # lines of epochs the resumed run recomputes identically.
    if devices.is_writer():
        rundir.write_jsonl(run.metrics_path, records)
        summaries.write(records)


def _show(line, args):
    """A progress line (unless --quiet; process 0's) -> None, or the StdoutLost
    that stops the run once its state is saved."""
    if args.quiet or not devices.is_writer():
        return None
    try:
        say(line)
    except StdoutLost as error:
        return error
    return None


def _stop_after(run, epoch, lost, prog):
    """A signal or a lost stdout after `epoch`, its checkpoint saved: stop
    (status 128 + n, or 1), unless that was the last epoch: then the signal is
    spent and the run finishes its summary."""
    if lost is not None:
        raise lost
    if epoch < run.config.epochs:
        signum = _signals.pending or signal.SIGINT  # (another process's: SIGINT)
        _fail(prog, f'interrupted ({signal.Signals(signum).name}) after epoch {epoch} of '
                    f'{run.config.epochs}; {_kept(run)}', status=128 + signum)
    _signals.pending = None


def _nan_guard(run, epochs, finite, saver, summaries, prog):
    """Stop at the first epoch of the chunk with a non-finite loss or parameter
    in any run, after writing every run's finite epochs (the lead-up to the
    divergence, and the healthy runs' epochs); the message names the runs
    that diverged (seed and grid values) and says what became of the others."""
    n_runs = len(run.runs)
    first_bad = np.full(n_runs, np.iinfo(np.int64).max)  # per run: its first bad epoch
    bad_names = {}
    for (epoch, metrics), params_finite in zip(epochs, finite):
        for index in range(n_runs):
            if first_bad[index] < epoch:
                continue
            names = [name for name, values in metrics.items()
                     if name.startswith('metrics/') and not np.isfinite(values[index])]
            if names or not params_finite[index]:
                first_bad[index] = epoch
                bad_names[index] = names or ['network parameters']
    if not bad_names:
        return
    _record(run, epochs, summaries, until=first_bad)  # the finite epochs, before stopping
    saver.wait()
    epoch = int(first_bad.min())
    diverged = [index for index in range(n_runs) if first_bad[index] == epoch]
    what = ', '.join(dict.fromkeys(name for index in diverged for name in bad_names[index]))
    kept = (f'the checkpoint of epoch {saver.saved_epoch} in {run.output_dir} is kept'
            if saver.saved_epoch else f'no checkpoint was saved in {run.output_dir}')
    if n_runs == 1:
        _fail(prog, f'non-finite {what} in epoch {epoch}; stopped, {kept}; the epochs before '
                    f'it are in {run.metrics_path}', status=1)
    names = rundir.run_names(run.runs, run.run_config.get('grid') or {})
    said = ' '.join(names[index] for index in diverged[:4]) + (
        f' and {len(diverged) - 4} more' if len(diverged) > 4 else '')
    healthy = int(np.sum(first_bad == np.iinfo(np.int64).max))
    last = epochs[-1][0]
    others = (f'the other {healthy} run(s), finite through epoch {last}, stop with '
              f'{"it" if len(diverged) == 1 else "them"} (one program runs them all)'
              if healthy else 'no run stayed finite')
    _fail(prog, f'non-finite {what} in epoch {epoch} of {len(diverged)} of {n_runs} runs '
                f'({said}); {others}; every run\'s finite epochs are in {run.metrics_path}; '
                f'{kept} (a resume meets the same divergence: to go on without '
                f'{"that run" if len(diverged) == 1 else "those runs"}, start a new '
                f'--output-dir without {"its" if len(diverged) == 1 else "their"} seed or grid '
                'value)', status=1)


class _Saver:
    """Checkpoints off the hot path: the state is copied to the host, then a
    background thread writes the file (atomically, as rundir.save_checkpoint
    does) while the next chunk runs. One save in flight at a time; an error
    in the thread is raised in the driver at the next save or at the end."""

    def __init__(self, run):
        self.run, self.thread, self.error = run, None, None
        self.saved_epoch, self.saved_at = run.start_epoch, time.time()

    def due(self):
        """Has CHECKPOINT_SECONDS passed since the last save? (process 0's clock)"""
        return bool(devices.from_process_0(
            int(time.time() - self.saved_at >= CHECKPOINT_SECONDS)))

    def save(self, state, epoch):
        whole_state = _real_rows(self.run, devices.gather(state))  # every process takes part
        self.wait()
        self.saved_at = time.time()
        if devices.is_writer():
            self.thread = threading.Thread(target=self._write, args=(whole_state, epoch),
                                           daemon=True)  # exit never waits on a hung disk
            self.thread.start()

    def _write(self, whole_state, epoch):
        try:
            rundir.save_checkpoint(self.run.checkpoint_path, whole_state,
                                   {'config': self.run.run_config, 'epoch': epoch,
                                    'devices': len(self.run.sharding.device_set)},
                                   previous=self.run.previous_path)
            self.saved_epoch = epoch
        except BaseException as error:  # noqa: B902 (re-raised in the driver)
            self.error = error

    def check(self):
        """Raise the error of a save that has ended in one (without waiting)."""
        if self.thread is not None and not self.thread.is_alive():
            self.wait()

    def wait(self):
        """Block until the save in flight is on disk; raise its error, if any."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.wait()
        elif self.thread is not None:  # let the file be whole; the first error wins
            self.thread.join(SAVE_JOIN_SECONDS)  # (a rename in flight lands, or the temp
            # file is left to the next run's sweep: the checkpoint stays whole either way)
        return False


class _Progress:
    """The progress line's state: each run's most recent return and evaluation
    figures, the mean epoch time (which sizes the chunks) and the time left."""

    def __init__(self, run):
        self.recent = recent_returns(run.history, len(run.runs))
        self.recent_eval = {}
        self.first, self.epochs, self.start = run.start_epoch, run.config.epochs, time.time()
        self.wall_start = run.wall_start
        self.per_epoch = None  # mean seconds per epoch so far (None: none run yet)

    def update(self, epoch, epochs):
        """After a chunk: its returns and evaluations, the mean epoch time."""
        self.per_epoch = (time.time() - self.start) / (epoch - self.first)
        for _, metrics in epochs:
            returns = metrics['rl/avg_return']
            self.recent = np.where(np.isfinite(returns), returns, self.recent)
            self.recent_eval.update({name: values for name, values in metrics.items()
                                     if name.startswith('rl/avg_return_temperature')})

    def out_of_time(self, epoch, time_limit):
        """Would another epoch end past `time_limit` seconds from the start?
        (Process 0's clock decides for all processes.)"""
        if time_limit is None:
            return False
        now = time.time()
        return bool(devices.from_process_0(
            int(now - self.wall_start + self.per_epoch > time_limit)))

    def line(self, epoch, metrics):
        metrics = {**metrics, **self.recent_eval}  # the latest evaluation, if not this epoch's
        return epoch_line(epoch, self.epochs, metrics, self.recent, metrics['timing/epoch'][0],
                          self.per_epoch * (self.epochs - epoch))



def _finish(run, args):
    """summary.json, the optional plot and the final line (process 0's; the
    one line --quiet prints)."""
    if not devices.is_writer():
        return
    summary = fields.summary(run.agent, run.config, run.runs, run.run_config.get('grid'),
                             run.history, time.time() - run.wall_start, run.compile_s,
                             getattr(args, 'batch_invariant', True))
    rundir.atomic_write_bytes(os.path.join(run.output_dir, 'summary.json'),
                       json.dumps(summary, indent=2).encode())
    run.finished = True  # a signal from here on stops nothing that a rerun would redo
    if args.plot:
        rundir.plot_learning_curves(run.history, run.agent, run.config.env,
                                    os.path.join(run.output_dir, rundir.PLOT_FILE))
    for line in fields.result_lines(summary, run.output_dir, one_line=args.quiet):
        say(line)
    _signals.stopping = True  # said done: a signal now changes nothing (status 0)


def _evaluation_note(run):
    """Which evaluation summary.json reports, for a run stopped before its last epoch."""
    epoch = fields.last_evaluation(run.history, fields.final_return_tag(run.agent, run.config))
    if epoch is None:
        return 'no evaluation yet: summary.json has no final_eval_return'
    return f"summary.json's final_eval_return is epoch {epoch}'s evaluation"
