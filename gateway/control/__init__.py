"""The control plane: the one owner of the fleet's state, in the gateway's process or in a named Ray actor
that several HTTP frontends share."""
