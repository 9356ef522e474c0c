"""The `pdserve` command line (see commands/main.py)."""
