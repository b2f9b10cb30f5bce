"""Everything that knows transformers / accelerate / peft / torch internals, one concept per module.

Private upstream accesses go through :mod:`hf_ddpfix._compat`; this package's modules only call it.
"""
