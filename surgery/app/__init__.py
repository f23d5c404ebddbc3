"""The `surgery` command (`cli`) and its embedded demo (`demo`)."""

from surgery.app import cli, demo  # noqa: F401  (in layer order)
