"""The ``shardsolve`` command line: ``main`` (the ``shardsolve`` entry point) and one module per command.

``main.py`` parses and dispatches; ``common.py`` holds what the commands share
(model files and their ``ModelSource``, device set-up, atomic output files);
``plan``, ``verify``, ``compare``, ``explain`` and ``iopddl`` are the commands,
each with its ``add_parser`` and ``run``, and their rich tables.
"""

from shardsolve.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
