"""`python -m hf_ddpfix doctor|plan ...`: the same as the `hf-ddpfix` command (see `hf_ddpfix.cli`)."""

import sys

from .cli import main

sys.exit(main())
