"""Why a request's generation ended, as every stage's messages carry it (torch-free: the gateway reads it).

A StrEnum: its values are the OpenAI-style strings the wire and the gateway have always carried, so a member
compares equal to its string and pickles, msgpacks and JSON-encodes as it.
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an EOS or stop token, or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # the client left, or the gateway ended it
    ERROR = "error"  # the worker failed (the message's `error` says why)
    MIGRATE = "migrate"  # handed back by a decode worker: the gateway continues it on another worker
