"""pdserve's command line, the composition root: `pdserve serve | bench | tune | prepare-model` (main.py).
Nothing below the command line imports this package."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pdserve")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
