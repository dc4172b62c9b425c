"""The package version, written into plan files (``"shardsolve": "0.1.0"``)."""

__version__ = "0.1.0"
