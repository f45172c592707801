"""``python -m normconv.cli``: the same command line as the ``normconv`` script."""

from normconv.cli import entry

entry()
