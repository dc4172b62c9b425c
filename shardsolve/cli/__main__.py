"""``python -m shardsolve.cli``: the ``shardsolve`` command."""

import sys

from shardsolve.cli.main import main

sys.exit(main())
