"""The versions every contract was read against (part of :mod:`hf_ddpfix._compat`)."""

# The newest versions every contract below was read against (the pinned CI stack, constraints.txt).
CHECKED_AGAINST = {"torch": "2.13.0", "transformers": "5.23.0", "accelerate": "1.15.0", "peft": "0.21.2"}
# The oldest versions CI also runs the unit tests and 2-process cells on (constraints-oldest.txt).
# transformers 5.0-5.2 set training up inside `_inner_training_loop` (see `when_ready_to_prepare` and
# `before_gradient_clipping`); 4.x is out of reach (docs/versions.md).
OLDEST_SUPPORTED = {"transformers": "5.0.0", "accelerate": "1.11.0", "peft": "0.18.0"}
