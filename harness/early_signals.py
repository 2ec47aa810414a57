"""Imported first by a script run as a program (before JAX): until the driver
installs its own handlers, a SIGINT or SIGTERM is only recorded here, then the
driver stops with one line. (Python's default raises KeyboardInterrupt in the
middle of an import, a traceback, or inside JAX's gc callback, where it is
swallowed and the run carries on.)"""

import signal

pending = None  # the first signal received, until the driver takes it


def _hold(signum, frame):
    global pending
    if pending is None:
        pending = signum


for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, _hold)
