"""What a call to a worker can end in, as the request path sees it (the worker client translates Ray's
errors into these: nothing above the fleet inspects a RayTaskError)."""

from __future__ import annotations


class WorkerLost(ConnectionError):
    """The worker is gone: its actor died, its step loop died, or its output stream ended."""


class WrongRoleError(RuntimeError):
    """The worker no longer serves the role the call was meant for (it changed role meanwhile): pick
    another worker; the worker itself is fine."""


class SubmissionRefused(ValueError):
    """The worker refused the request (it can never be served there, or it was aborted before it came)."""


class ChannelClosed(ConnectionError):
    """The fleet took this gateway (a frontend) for gone and had the worker end its output stream, aborting
    what it carried there: the worker is fine and serves on; the request starts again on it (a frontend that
    was only paused)."""


class StillBusy(RuntimeError):
    """The worker refused to change role: work landed on it after it was seen empty (nothing changed)."""


class LastDecoder(ValueError):
    """A drain or role change refused: it would take away the last active worker that can decode (the text
    is the fleet's own, so an answer may show it)."""
