"""The Ray control plane: the worker actors, where they run, their lifecycle, and the link to each."""
