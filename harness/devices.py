"""Where runs execute: the memory check before compiling, the runs axis
sharded over devices, and one sweep over several processes
(jax.distributed), where process 0 is the one writer."""

import collections
import concurrent.futures
import dataclasses
import hashlib
import io
import json
import math
import os
import sys
import threading
import types

import jax
import numpy as np

import common
import fields


# Outputs XLA fuses into their consumers instead of materialising.
_FUSED_PRIMITIVES = {'broadcast_in_dim', 'convert_element_type', 'iota', 'reshape',
                     'squeeze', 'expand_dims', 'transpose', 'select_n'}


def _nbytes(aval):
    return math.prod(aval.shape) * aval.dtype.itemsize if hasattr(aval, 'shape') else 0


def _largest_array(jaxpr):
    """Bytes of the largest array an equation of `jaxpr` (or of any jaxpr nested
    in it: scan and while bodies, conds, inner jits) outputs."""
    largest = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _FUSED_PRIMITIVES:
            largest = max([largest] + [_nbytes(var.aval) for var in eqn.outvars])
        for param in eqn.params.values():
            for inner in (param if isinstance(param, (tuple, list)) else (param,)):
                inner = getattr(inner, 'jaxpr', inner)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, 'eqns'):
                    largest = max(largest, _largest_array(inner))
    return largest


def memory_needed(agent, hp, keys):
    """(bytes, what) of the floor estimate for all runs: `hp` and `keys` carry
    the runs axis; nothing is compiled or run, only traced."""
    state = jax.eval_shape(agent.batched('init'), keys, hp)
    state_bytes = sum(_nbytes(leaf) for leaf in jax.tree.leaves(state))
    phase_bytes = {name: _largest_array(jax.make_jaxpr(agent.batched(name))(hp, state).jaxpr)
                   for name in ('learn', 'evaluate')}  # traces the chunk reuses
    phase, largest = max(phase_bytes.items(), key=lambda item: item[1])
    return 2 * state_bytes + largest, f'state {state_bytes / 2**30:.2f} GiB x 2 + {phase} ' \
        f'{largest / 2**30:.2f} GiB'


memory_available = fields.memory_available


# Fields whose values size a run's state or a phase's arrays (each script has
# some): the memory refusal names those set above their defaults.
SIZE_FIELDS = ('n_replay_epochs', 'n_envs', 'n_interactions_per_epoch',
               'n_trajectories_per_epoch', 'max_steps', 'batch_size', 'value_batch_size',
               'train_steps_per_epoch', 'value_train_steps_per_epoch', 'gru_size',
               'hidden_sizes', 'conv_channels', 'n_eval_episodes', 'eval_steps')


def memory_hint(config, fallback):
    """The flags to lower when runs do not fit: the size fields set above their
    defaults (on the command line, by the env's settings or by the saved run),
    the most grown first, then the number of runs; `fallback` (the script's
    list) when none is."""
    def size(value):
        return max(value) if isinstance(value, tuple) and value else value
    grown = []
    for field in dataclasses.fields(config):
        if field.name not in SIZE_FIELDS:
            continue
        value, default = size(getattr(config, field.name)), size(field.default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= (default or 0):
            continue
        grown.append((value / default if default else math.inf, field.name))
    if not grown:
        return fallback
    said = ', '.join(f'--{name.replace("_", "-")} '
                     + ','.join(map(str, getattr(config, name)))
                     if isinstance(getattr(config, name), tuple) else
                     f'--{name.replace("_", "-")} {getattr(config, name)}'
                     for _, name in sorted(grown, reverse=True)[:3])
    return (f'{said} (above {"its default" if len(grown) == 1 else "their defaults"}), '
            'or --num-seeds (or the grid)')


def check_memory(agent, hp, keys, devices, hint):
    """UsageError if the runs cannot fit on `devices` (sharded evenly over them;
    devices of the CPU share the host's RAM). Over several processes, this
    process's share on its own devices."""
    needed, what = memory_needed(agent, hp, keys)
    local = [device for device in devices if device.process_index == jax.process_index()]
    if devices[0].platform == 'cpu':
        needed = needed * len(local) // len(devices)
        available = memory_available(local[0])
    else:
        needed //= len(devices)
        available = min(memory_available(device) for device in local)
    if needed > available:
        raise common.UsageError(
            f'{len(keys)} run(s) need at least {needed / 2**30:.1f} GiB ({what}) but '
            f'{available / 2**30:.1f} GiB is available; lower {hint}')


PROCESS_FLAGS = ('distributed', 'coordinator_address', 'num_processes', 'process_id')


_processes = types.SimpleNamespace(started=False, prog='')


_MESSAGE_BYTES = 512  # an error relayed between processes, utf-8, cut to this


def distributed_requested(args):
    return any(getattr(args, name, None) is not None for name in PROCESS_FLAGS)


def check_process_flags(args):
    """The process flags alone (before anything connects): UsageError if bad."""
    if not distributed_requested(args):
        return
    auto = args.distributed == 'auto'
    address, count, index = args.coordinator_address, args.num_processes, args.process_id
    if address is not None:
        host, _, port = address.rpartition(':')
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise common.UsageError(f'--coordinator-address must be HOST:PORT (port 1-65535), '
                             f'got {address!r}')
    if not auto:
        given = [f'--{name.replace("_", "-")}' for name in PROCESS_FLAGS[1:]
                 if getattr(args, name) is not None]
        if address is None:
            raise common.UsageError(f'{given[0]} needs --coordinator-address HOST:PORT (or '
                             '--distributed auto on a cluster JAX detects)')
        if count is None or index is None:
            raise common.UsageError('--coordinator-address needs --num-processes N and '
                             '--process-id I (or --distributed auto on a cluster JAX detects)')
    if count is not None and count < 1:
        raise common.UsageError(f'--num-processes must be >= 1, got {count}')
    if index is not None and count is not None and not 0 <= index < count:
        raise common.UsageError(f'--process-id must be in [0, {count}) for --num-processes {count}, '
                         f'got {index}')
    if index is not None and index < 0:
        raise common.UsageError(f'--process-id must be >= 0, got {index}')
    if args.device is not None:
        raise common.UsageError('--device pins one device of one process; it cannot be combined '
                         'with the process flags (runs are sharded over every process)')


def use_cpu_devices(n):
    """--cpu-devices N: JAX's CPU backend as N devices (jax_num_cpu_devices),
    set before the backend starts; UsageError if it started with another count."""
    if n is None:
        return
    if not 1 <= n <= 4096:
        raise common.UsageError(f'--cpu-devices must be in [1, 4096], got {n}')
    from jax._src import xla_bridge  # whether the backends have started: no public API
    if not xla_bridge.backends_are_initialized():
        jax.config.update('jax_num_cpu_devices', n)
        return
    started = len(jax.devices('cpu'))
    if started != n:
        raise common.UsageError(f'--cpu-devices {n}: JAX\'s CPU backend already runs with '
                                f'{started} device(s) in this process')


def start_processes(args, prog):
    """jax.distributed.initialize from the flags; must run before any JAX
    computation. Waits at most --coordinator-timeout seconds for all processes
    to connect, then stops with one line (JAX itself would abort the process
    with a C++ stack trace)."""
    if not distributed_requested(args) or _processes.started:
        return
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU collectives
    kwargs = {name: getattr(args, name) for name in PROCESS_FLAGS[1:]
              if getattr(args, name) is not None}
    timeout = args.coordinator_timeout
    address = args.coordinator_address or "the cluster's coordinator"
    if args.process_id == 0:
        why = (f'not all {args.num_processes} processes connected to the coordinator at '
               f'{address} within {timeout:g} s (--coordinator-timeout); is every process '
               'started, with the same --coordinator-address and --num-processes?')
    else:
        why = (f'no coordinator answered at {address} within {timeout:g} s '
               '(--coordinator-timeout); is process 0 running there, with the same '
               '--num-processes, and is the address reachable from here?')

    def give_up():
        print(f'{prog}: error: {why}', file=sys.stderr, flush=True)
        os._exit(2)  # skip JAX's exit handlers: they would wait for the others

    watchdog = threading.Timer(timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=int(timeout) + 60,
                                   heartbeat_timeout_seconds=max(30, int(timeout)))
    except (ValueError, TypeError, RuntimeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if args.distributed == 'auto' and 'should be defined' in first:
            first = ('no cluster detected (SLURM, Open MPI); give --coordinator-address, '
                     '--num-processes and --process-id')
        raise common.UsageError(f'jax.distributed.initialize: {first}') from None
    finally:
        watchdog.cancel()
    _processes.started, _processes.prog = True, prog
    # Gloo prints a line on stdout (fd 1) for each group it connects: send fd 1
    # to /dev/null and keep Python's stdout on the real one.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = io.TextIOWrapper(os.fdopen(real_stdout, 'wb'), line_buffering=True)


def is_writer():
    """Whether this process writes files and stdout: process 0, or the only one."""
    return not _processes.started or jax.process_index() == 0


def _allgather(values):
    """[n_processes, *shape] numpy: every process's host-local `values`."""
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(np.asarray(values)))


def from_process_0(value):
    """Process 0's int (uint32) `value`, on every process."""
    if not _processes.started:
        return value
    return int(_allgather(np.asarray([value], np.uint32))[0, 0])


def any_process(flag):
    """True on every process if `flag` is true on any."""
    if not _processes.started:
        return bool(flag)
    return bool(np.any(_allgather(np.asarray([bool(flag)], np.uint8))))


def gather(tree):
    """A pytree of [n_runs, ...] arrays, whole as numpy on every process (one
    writer needs all runs: metrics, checkpoints); bitwise, only data moves."""
    if not _processes.started:
        return jax.tree.map(np.asarray, jax.device_get(tree))
    from jax.experimental import multihost_utils
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def put_global(tree, sharding):
    """Host arrays [n_runs, ...] (the same on every process) onto `sharding`;
    each process builds only its addressable shards."""
    if not _processes.started:
        return jax.device_put(tree, sharding)
    def put(leaf):
        leaf = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])
    return jax.tree.map(put, tree)


def _digest(value):
    """Two uint32 words of the SHA-256 of a JSON value."""
    data = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()
    return np.frombuffer(data[:8], np.uint32)


def check_same_flags(args):
    """Refuse processes started with different flags: compare a hash of every
    flag (but --process-id and --compile-cache) across processes, then name
    the flags that differ."""
    if not _processes.started:
        return
    counts = collections.Counter(device.process_index for device in jax.devices())
    if len(set(counts.values())) > 1:  # (every gather below assumes the same counts)
        raise common.UsageError(
            'the processes have different numbers of devices (' + ', '.join(
                f'process {index}: {count}' for index, count in sorted(counts.items()))
            + '); start every process with the same --cpu-devices on the same kind of host')
    sees = _allgather(np.asarray([getattr(args, 'sees_saved_run', False)], np.uint8))[:, 0]
    if sees.any() and not sees.all():
        blind = ', '.join(str(p) for p in range(len(sees)) if sees[p] != sees[0])
        raise common.UsageError(f'process(es) {blind} {"do not" if sees[0] else "alone"} find the saved '
                         f'run in --output-dir {args.output_dir} that process 0 '
                         f'{"resumes" if sees[0] else "does not"}; it must be on a filesystem '
                         'every process shares')
    flags = {name: value for name, value in sorted(vars(args).items())
             if name not in ('process_id', 'compile_cache', 'given', 'set_fields',
                             'sees_saved_run')}
    overall = _allgather(np.concatenate([[len(flags)], _digest(flags)]).astype(np.uint32))
    if (overall == overall[0]).all():
        return
    if not (overall[:, 0] == overall[0, 0]).all():
        raise common.UsageError('the processes run different versions of the script (their sets of '
                         'flags differ); start every process with the same code and flags')
    each = _allgather(np.stack([_digest(value) for value in flags.values()]))
    differing = [f'--{name.replace("_", "-")}' for index, name in enumerate(flags)
                 if not (each[:, index] == each[0, index]).all()]
    others = [str(p) for p in range(len(each)) if not (each[p] == each[0]).all()]
    raise common.UsageError(f'the processes were started with different flags: {", ".join(differing)} '
                     f'differ between process 0 and process(es) {", ".join(others)}; start '
                     'every process with the same flags (but --process-id)')


class agreement:
    """A block that may fail on some processes only (their own files, free
    memory): at its end every process learns whether any failed, and all stop
    together. A process reports its own error; process 0 also reports the
    first other process's, so its stderr always says why. One process: a no-op."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if not _processes.started:
            return False
        status, message = 0, ''
        if isinstance(error, SystemExit):  # _fail: already reported
            status = error.code if isinstance(error.code, int) else 1
        elif isinstance(error, common.UsageError):
            status, message = 2, str(error)
        elif isinstance(error, ValueError):
            status, message = 1, str(error)
        elif error is not None:
            return False  # a bug: its traceback, and the others stop when this one dies
        text = np.zeros(_MESSAGE_BYTES, np.uint8)
        encoded = message.encode()[:_MESSAGE_BYTES]
        text[:len(encoded)] = np.frombuffer(encoded, np.uint8)
        table = _allgather(np.concatenate([[min(status, 255)], text]).astype(np.uint8))
        failed = [(process, int(row[0]), bytes(row[1:]).rstrip(b'\0').decode(errors='replace'))
                  for process, row in enumerate(table) if row[0]]
        if not failed:
            return False
        me = jax.process_index()
        if error is not None:
            # Process 0 had the same error: it says it, the others stay quiet.
            same = failed[0][0] == 0 and failed[0][2] == message and message
            error.local = me == 0 or not same
            return False
        process, status, message = failed[0]
        if me == 0:
            print(f'{_processes.prog}: error: process {process}: {message or "stopped"}',
                  file=sys.stderr, flush=True)
        raise SystemExit(status)


def _lost_contact(error):
    text = str(error).lower()
    return not _out_of_memory(error) and any(word in text for word in (
        'gloo', 'connection', 'coordination', 'unavailable', 'peer', 'heartbeat', 'barrier'))


def lost_a_process(prog, error):
    """A collective failed mid-run (another process died): one line, and exit
    without JAX's exit handlers, which would wait for the dead process. (When
    process 0 dies, JAX's coordination client may also log, or abort this
    process first: it watches the coordinator from a thread of its own.)"""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    print(f'{prog}: error: process {jax.process_index()}: lost contact with another process '
          f'({first}); rerun every process with the same flags to resume from the last '
          'checkpoint', file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _run_sharding(n_runs, device, cpu_devices=None):
    """Sharding of the leading runs axis: one chosen device, or all of them
    where the runs divide evenly over them. Runs that do not are refused
    under --cpu-devices (`cpu_devices`, asked for to shard) and run on one
    device with a note otherwise (several GPUs)."""
    devices = jax.devices()
    if device is not None:
        if not 0 <= device < len(devices):
            raise common.UsageError(f'--device {device} out of range; {len(devices)} device(s) seen')
        return jax.sharding.SingleDeviceSharding(devices[device])
    if jax.process_count() > 1 and n_runs % len(devices) != 0:
        raise common.UsageError(f'{n_runs} run(s) do not divide evenly over the {len(devices)} devices '
                         f'of {jax.process_count()} processes; use a multiple of {len(devices)} '
                         'runs (--num-seeds times the grid points)')
    if len(devices) > 1 and n_runs % len(devices) != 0:
        if cpu_devices is not None:
            raise common.UsageError(
                f'--cpu-devices {cpu_devices}: {n_runs} run(s) do not divide evenly over '
                f'{len(devices)} devices; use a multiple of {len(devices)} runs (--num-seeds '
                'times the grid points) or fewer devices')
        print(f'note: {n_runs} run(s) do not divide evenly over {len(devices)} devices: they '
              f'run on one (a multiple of {len(devices)} runs shards them)', file=sys.stderr,
              flush=True)
    if len(devices) == 1 or n_runs % len(devices) != 0:
        return jax.sharding.SingleDeviceSharding(devices[0])
    mesh = jax.sharding.Mesh(np.array(devices), ('runs',))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('runs'))


class PerDevice:
    """`function` of [n_runs, ...] pytrees, compiled for each of this
    process's devices of `sharding` on its rows of the runs axis, and called
    on all of them at once (dispatch is asynchronous, so the devices run
    side by side). The devices never talk to one another, so each computes
    exactly the program one device would for its runs."""

    def __init__(self, function, example, sharding, options):
        self.sharding = sharding
        self.n_devices = len(sharding.device_set)
        self.devices = sorted(sharding.addressable_devices, key=lambda device: device.id)
        jitted = jax.jit(function)
        def compiled(device):  # one program a device, compiled side by side (XLA frees the GIL)
            return jitted.lower(*jax.tree.map(lambda leaf: self._shard_shape(leaf, device),
                                              example)).compile(compiler_options=options)
        with concurrent.futures.ThreadPoolExecutor(len(self.devices)) as pool:
            self.compiled = list(pool.map(compiled, self.devices))

    def _shard_shape(self, leaf, device):
        shape = (leaf.shape[0] // self.n_devices,) + tuple(leaf.shape[1:])
        return jax.ShapeDtypeStruct(shape, leaf.dtype,
                                    sharding=jax.sharding.SingleDeviceSharding(device))

    def __call__(self, *args):
        shards = [{shard.device: shard.data for shard in leaf.addressable_shards}
                  for leaf in jax.tree.leaves(args)]
        treedef = jax.tree.structure(args)
        outputs = [compiled(*jax.tree.unflatten(treedef, [leaf[device] for leaf in shards]))
                   for compiled, device in zip(self.compiled, self.devices)]
        def whole(*pieces):
            shape = (pieces[0].shape[0] * self.n_devices,) + tuple(pieces[0].shape[1:])
            return jax.make_array_from_single_device_arrays(shape, self.sharding, list(pieces))
        return jax.tree.map(whole, *outputs)


def lone_run_padding(n_runs, sharding, batch_invariant):
    """Copies of runs to add so that no device of a sharded CPU program holds
    a single run: XLA CPU compiles a vmapped program of one run in another
    order than one of two or more (the last bits differ), so without them N
    runs on N devices would differ from N runs on one. (A lone run, never
    sharded, is left alone: see the README.)"""
    if not batch_invariant or not isinstance(sharding, jax.sharding.NamedSharding):
        return 0
    devices = sharding.device_set
    if next(iter(devices)).platform != 'cpu' or n_runs != len(devices):
        return 0
    return n_runs


def _out_of_memory(error):
    text = str(error)
    return isinstance(error, MemoryError) or 'RESOURCE_EXHAUSTED' in text \
        or 'out of memory' in text.lower()
