"""The run directory: atomic checkpoints (the state pytree and a JSON
header in one .npz, written to a temp file and renamed, so a crash at any
moment leaves the old or the new one), metrics.jsonl, TensorBoard event
files, the run lock and the learning-curve plot."""

import contextlib
import fcntl
import glob
import io
import json
import os
import re
import sys
import tempfile
import time
import zipfile

import jax
import numpy as np

import common


def _leaf_paths(tree):
    return [jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


TEMP_MARK = '.tmp-'  # a temp file is <name>.tmp-<pid> until its rename

# The files a run writes through a temp file (atomic_write_bytes, the plot):
# the sweep of dead writers' temp files removes these names and no others, so
# a user's own `notes.tmp-old` or `data.csv.tmp-backup` in the directory stays.
ATOMIC_FILES = ('checkpoint.npz', 'config.json', 'metrics.jsonl', 'summary.json')
PLOT_FILE = 'learning_curve.png'
_OWN_TEMP = re.compile('(?:' + '|'.join(map(re.escape, ATOMIC_FILES)) + ')'
                       + re.escape(TEMP_MARK) + r'[0-9]+'
                       + '|' + re.escape(PLOT_FILE + TEMP_MARK) + r'[0-9]+\.png')


def is_own_temp_file(name):
    """Is `name` a temp file this program makes (`<its file>.tmp-<pid>`)?"""
    return _OWN_TEMP.fullmatch(name) is not None


def _remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _naming(error, path):
    """An OSError from writing `path` that names it (a write's own lacks it)."""
    if isinstance(error, OSError) and error.filename is None:
        error.filename = path
    return error


def remove_temp_files(output_dir):
    """Temp files of writers that died before their rename (kill -9): called
    under the run lock, so no live writer owns them. Only the names this
    program makes: the user's other files are theirs."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return
    for name in names:
        if is_own_temp_file(name):
            _remove_quietly(os.path.join(output_dir, name))


def atomic_write_bytes(path, data, previous=None):
    """Write `data` to `path` via a temp file and a rename; optionally move the
    old file to `previous` first (in the instant between the two renames only
    `previous` exists, and the loader falls back to it)."""
    tmp = f'{path}{TEMP_MARK}{os.getpid()}'
    try:
        with open(tmp, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if previous and os.path.exists(path):
            os.replace(path, previous)
        os.replace(tmp, path)
    except BaseException as error:  # a full disk, EIO, a signal: leave no temp file
        _remove_quietly(tmp)
        if isinstance(error, OSError):
            error.filename = path  # the file meant, not its temp name
        raise
    try:
        directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(directory)
        os.close(directory)
    except OSError:
        pass


def save_checkpoint(path, state, metadata, previous=None):
    """Atomically write `state` (any pytree of arrays) and JSON `metadata`;
    with `previous`, the checkpoint being replaced is kept under that name."""
    leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(state))]
    header = {'paths': _leaf_paths(state), 'metadata': metadata}
    arrays = {f'leaf_{i:05d}': leaf for i, leaf in enumerate(leaves)}
    arrays['header'] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue(), previous)


def read_checkpoint_metadata(path):
    """The JSON metadata of a checkpoint; ValueError naming the file if unreadable."""
    return _read_checkpoint(path)[0]['metadata']


def read_run_metadata(path):
    """The metadata of a run's checkpoint, which must hold its config and
    epoch; ValueError naming the file if unreadable or either is missing."""
    metadata = read_checkpoint_metadata(path)
    if not (isinstance(metadata.get('config'), dict) and type(metadata.get('epoch')) is int
            and metadata['epoch'] >= 0):
        raise ValueError(f'checkpoint {path} is corrupt: its header lacks the run\'s config '
                         'or epoch')
    return metadata


def _read_checkpoint(path):
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(bytes(data['header']).decode())
            leaves = [data[f'leaf_{i:05d}'] for i in range(len(header['paths']))]
    except FileNotFoundError:
        raise ValueError(f'checkpoint {path} does not exist') from None
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, UnicodeDecodeError,
            NotImplementedError, RuntimeError, TypeError) as error:  # zipfile raises all of these
        raise ValueError(f'checkpoint {path} is corrupt or truncated '
                         f'({type(error).__name__}: {error})') from None
    if not (isinstance(header, dict) and isinstance(header.get('metadata'), dict)):
        raise ValueError(f'checkpoint {path} is corrupt: its header has no metadata')
    return header, leaves


def load_checkpoint(path, template):
    """(state shaped like `template`, metadata); ValueError naming the file if the
    file is corrupt or its structure, shapes or dtypes differ from the template."""
    header, leaves = _read_checkpoint(path)
    expected_paths = _leaf_paths(template)
    template_leaves, treedef = jax.tree.flatten(template)
    if header['paths'] != expected_paths:
        missing = sorted(set(expected_paths) - set(header['paths']))[:3]
        extra = sorted(set(header['paths']) - set(expected_paths))[:3]
        raise ValueError(f'checkpoint {path} has a different state structure '
                         f'(missing {missing}, unexpected {extra})')
    for name, leaf, want in zip(expected_paths, leaves, template_leaves):
        if leaf.shape != tuple(want.shape) or leaf.dtype != want.dtype:
            raise ValueError(f'checkpoint {path}: {name} is {leaf.dtype}{list(leaf.shape)}, '
                             f'expected {want.dtype}{list(want.shape)}')
    return jax.tree.unflatten(treedef, leaves), header['metadata']


def read_history(path, last_epoch):
    """Records of epochs <= last_epoch from metrics.jsonl, one per (epoch, run)
    (the last, if repeated); a line that is not a record (a torn last line)
    is dropped. check_history says whether what is left is whole."""
    history = {}
    if os.path.exists(path):
        with open(path, errors='replace') as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not (isinstance(record, dict) and type(record.get('epoch')) is int
                        and type(record.get('run')) is int):
                    continue
                if 1 <= record['epoch'] <= last_epoch:
                    history[record['epoch'], record['run']] = record
    return [history[key] for key in sorted(history)]


def check_history(history, last_epoch, n_runs, path):
    """ValueError unless `history` holds every run's record of epochs
    1..last_epoch: the checkpoint cannot recompute past metrics, so a run
    whose metrics.jsonl lost some must not go on to overwrite it with less."""
    have = {(record['epoch'], record['run']) for record in history}
    missing = sorted({epoch for epoch in range(1, last_epoch + 1) for run in range(n_runs)
                      if (epoch, run) not in have})
    if not missing:
        return
    what = 'is missing' if not os.path.exists(path) else (
        f'lacks the records of {len(missing)} of epochs 1-{last_epoch} '
        f'(first {missing[0]}, last {missing[-1]})')
    raise ValueError(f'{path} {what}, which the checkpoint of epoch {last_epoch} follows '
                     '(deleted or damaged; the checkpoint cannot recompute past metrics): '
                     'restore it from a copy, or start a new --output-dir')


def write_jsonl(path, records, mode='a'):
    """Append (or write) one JSON line per record; on an OS error the file is
    cut back to where it was, so no torn line stays."""
    size = os.path.getsize(path) if mode == 'a' and os.path.exists(path) else 0
    try:
        with open(path, mode) as f:
            f.write(''.join(json.dumps(record) + '\n' for record in records))
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        try:
            os.truncate(path, size)
        except OSError:
            pass
        raise _naming(error, path)


def run_names(runs, grid):
    """One TensorBoard run name per run: its grid values and seed, e.g.
    'lr=0.01,gamma=0.99,seed=3' (',run=i' added where two would coincide)."""
    names = [','.join([f'{name}={format(run[name], "g")}' for name in grid]
                      + [f'seed={run["seed"]}']) for run in runs]
    return [f'{name},run={index}' if names.count(name) > 1 else name
            for index, name in enumerate(names)]


def config_markdown(config):
    """The config as a markdown table, TensorBoard's text dashboard renders it."""
    rows = [f'| {name} | {json.dumps(value)} |' for name, value in config.items()]
    return '\n'.join(['| field | value |', '|---|---|', *rows])


class Summaries:
    """TensorBoard event files (tensorboardX's format, no TensorFlow), one
    directory per run under <output_dir>/tb/: each metric of metrics.jsonl
    under its Trax tag, and the epoch under 'epoch', at step = the run's env
    steps so far (rl/n_interactions: the x-axis of PureJaxRL's, CleanRL's and
    rejax's curves; an epoch is a different number of steps per algorithm and
    env), and the run's config as a text summary (Trax wrote its operative gin
    config as text).

    Written in the caller's thread, flushed once a chunk: an OS error (a full
    disk, EIO) is raised right there, naming the event file, and the driver
    stops in one line. (tensorboardX's FileWriter writes from a thread of its
    own, which dies on such an error with a traceback; the run then blocked
    for ever on its full queue, or at exit joining it.)

    Opening rewrites each run's events from `history` (metrics.jsonl cut at the
    checkpoint) into a new file and only then deletes the old ones, so after a
    resume TensorBoard shows one value per step. A no-op when not enabled.
    """

    def __init__(self, output_dir, runs, run_config, history, enabled=True):
        self.files, self.runs = [], runs
        if not enabled:
            return
        from tensorboardX import summary
        from tensorboardX.event_file_writer import EventsWriter
        grid = run_config.get('grid') or {}
        try:
            for index, (run, name) in enumerate(zip(runs, run_names(runs, grid))):
                directory = os.path.join(output_dir, 'tb', name)
                old = glob.glob(os.path.join(glob.escape(directory), 'events.out.tfevents.*'))
                try:
                    os.makedirs(directory, exist_ok=True)
                    events = EventsWriter(os.path.join(directory, 'events'),  # a name no other
                                          f'.{os.getpid()}.{time.time_ns()}')  # writer had
                except OSError as error:
                    raise _naming(error, directory)
                self.files.append(events)
                self._add(index, summary.text('config', config_markdown({**run_config, **run})),
                          0)
                self.write([r for r in history if r['run'] == index], flush=False)
                self._flush(events)
                for path in old:
                    os.remove(path)
        except BaseException:
            self.close(quietly=True)
            raise

    def _add(self, index, summary, step):
        from tensorboardX.proto import event_pb2
        events = self.files[index]
        try:
            events.write_event(event_pb2.Event(summary=summary, step=int(step),
                                               wall_time=time.time()))
        except OSError as error:
            raise _naming(error, events._file_name)

    @staticmethod
    def _flush(events):
        try:
            events.flush()
        except OSError as error:
            raise _naming(error, events._file_name)

    def write(self, records, flush=True):
        """Scalars of metric records (metric_records' dicts); None (non-finite) is left out."""
        if not self.files:
            return
        from tensorboardX.proto.summary_pb2 import Summary
        for record in records:  # one event a record: a scalar event each cost ~150 us
            identity = {'run', *self.runs[record['run']]}
            values = [Summary.Value(tag=tag, simple_value=value) for tag, value in record.items()
                      if tag not in identity and value is not None]
            self._add(record['run'], Summary(value=values), env_steps(record))
        if flush:
            for events in self.files:
                self._flush(events)

    def close(self, quietly=False):
        """Close every file (each closes even if another fails); the first
        error is raised, naming its file, unless `quietly`."""
        files, self.files = self.files, []
        first = None
        for events in files:
            try:
                events.close()
            except OSError as error:
                first = first or _naming(error, events._file_name)
                with contextlib.suppress(Exception):  # its flush failed: close the file itself
                    events._py_recordio_writer.close()
        if first is not None and not quietly:
            raise first

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(quietly=exc[0] is not None)  # the first error wins
        return False


def env_steps(record):
    """A metric record's x-axis value: the run's env steps after its epoch
    (the epoch itself where they are not recorded)."""
    steps = record.get('rl/n_interactions')
    return record['epoch'] if steps is None else int(steps)


LOCK_FILE = 'run.lock'


@contextlib.contextmanager
def output_dir_lock(path):
    """Hold an OS lock on path/run.lock (which names our pid) while the block
    runs. The kernel drops it when the process ends however it ends, kill -9
    included, so a lock is never stale; a second process is refused at once."""
    lock_path = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise common.UsageError(f'cannot open the run lock {lock_path}: {error.strerror}'
                                + ('; remove it (a run makes it a file)'
                                   if os.path.isdir(lock_path) else '')) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise common.UsageError(f'another run (pid {_lock_holder(fd)}) is writing {path}') from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f'{os.getpid()}\n'.encode(), 0)
        except OSError as error:  # a full disk: named like every other write
            raise _naming(error, lock_path)
        remove_temp_files(path)
        yield
    finally:
        os.close(fd)  # releases the lock


def lock_holder(path):
    """The pid of another process holding path/run.lock (a run writing the
    directory now), or None: the lock is tried shared and released at once."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _lock_holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)  # (releases a lock it took)
    return None


def _lock_holder(fd):
    """The pid the lock holder wrote (it writes it right after locking)."""
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode(errors='replace').strip()
        if text:
            return text
        time.sleep(0.05)
    return 'unknown'


def plot_learning_curves(history, agent, env_name, path):
    """Greedy and training return vs env steps: mean line, min-max band over runs."""
    with matplotlib_config_dir():
        _plot(history, agent, env_name, path)


@contextlib.contextmanager
def matplotlib_config_dir():
    """Matplotlib's config and font cache in a temporary directory where its
    own (~/.config/matplotlib) cannot be written (a read-only HOME), instead
    of its warnings (gymnax imports it with its envs); removed afterwards."""
    home = os.environ.get('XDG_CONFIG_HOME') or os.path.join(os.path.expanduser('~'), '.config')
    if 'MPLCONFIGDIR' in os.environ or 'matplotlib' in sys.modules or \
            _writable(os.path.join(home, 'matplotlib')):
        yield
        return
    with tempfile.TemporaryDirectory(prefix='matplotlib-') as directory:
        os.environ['MPLCONFIGDIR'] = directory
        try:
            yield
        finally:
            del os.environ['MPLCONFIGDIR']


def _writable(directory):
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def _plot(history, agent, env_name, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    epochs = sorted({record['epoch'] for record in history})
    n_runs = max(record['run'] for record in history) + 1
    def table(name):
        values = np.full((len(epochs), n_runs), np.nan)
        for record in history:
            value = record.get(name)
            values[epochs.index(record['epoch']), record['run']] = np.nan if value is None else value
        return values
    steps = np.nanmean(table('rl/n_interactions'), axis=1)
    figure, axis = plt.subplots(figsize=(7, 4))
    names = [('rl/avg_return', 'training return')]
    names += [(common.return_tag(t, h), f'greedy return (T={t:g}, {h} steps)' if t == 0 else
               f'eval return (T={t:g}, {h} steps)')
              for t, h in agent.eval_tags]
    for name, label in names:
        values = table(name)
        recorded = ~np.all(np.isnan(values), axis=1)  # evaluations: every --eval-every epochs
        if not np.any(recorded):
            continue
        values, at = values[recorded], steps[recorded]
        with np.errstate(all='ignore'), __import__('warnings').catch_warnings():
            __import__('warnings').simplefilter('ignore')
            axis.plot(at, np.nanmean(values, axis=1), label=label)
            axis.fill_between(at, np.nanmin(values, axis=1), np.nanmax(values, axis=1),
                              alpha=0.2)
    axis.set_xlabel('env steps per run')
    axis.set_ylabel('return')
    axis.set_title(f'{env_name}: {n_runs} run(s), mean and min-max band')
    if axis.lines:
        axis.legend(loc='lower right')
    else:  # no episode ended and no evaluation yet: say so rather than warn
        axis.text(0.5, 0.5, 'no episode has ended yet', ha='center', transform=axis.transAxes)
    figure.tight_layout()
    tmp = f'{path}{TEMP_MARK}{os.getpid()}.png'
    try:
        figure.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    except BaseException as error:
        _remove_quietly(tmp)
        raise _naming(error, path)
    finally:
        plt.close(figure)
