"""The experiment harness: everything that runs an algorithm from the command
line, apart from the algorithm itself. `cli` (the driver: parse, set up or
resume, the epoch loop, summary), `flags` (Config fields as flags, per-env
settings, the saved config on resume), `rundir` (checkpoints, metrics.jsonl,
TensorBoard, the run lock, plots) and `devices` (the memory check, sharding,
several processes). Only each script's `main()` imports it: `import dqn`
and `import common` do not.
"""
