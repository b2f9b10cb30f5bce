"""What is known about a run before it is planned.

- `gather`: `RunFacts` from a live `Trainer` and its model (read-only).
- `offline`: the same facts built from a config and a command line on a meta-device model (`hf-ddpfix plan`'s run,
  also the rehearsal's real-size plan).
- `advice`: launch and memory advice, and a model description, from a config alone (`hf-ddpfix doctor`).
"""
