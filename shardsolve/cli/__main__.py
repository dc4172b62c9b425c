"""``python -m shardsolve.cli``: the ``shardsolve`` command."""

import sys

from shardsolve.cli import main

sys.exit(main())
