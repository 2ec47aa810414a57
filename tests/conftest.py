"""Test-session setup shared by every test module.

XLA compile time dominates these tests on CPU (each agent program is compiled
once and then runs for well under a second), so compile with XLA's backend
optimisation level 0: about half the compile time, same semantics. A value
already set in XLA_FLAGS wins.
"""

import os

_flags = os.environ.get('XLA_FLAGS', '')
if '--xla_backend_optimization_level' not in _flags:
    os.environ['XLA_FLAGS'] = (_flags + ' --xla_backend_optimization_level=0').strip()
