"""A script whose tokenizer comes from a Hub id that is not cached (tests/test_rehearse.py runs it offline: the
rehearsal stops with the step's name, exit status 2, never a pass)."""

from transformers import AutoTokenizer

AutoTokenizer.from_pretrained("hf-ddpfix-tests/no-such-model-anywhere")
