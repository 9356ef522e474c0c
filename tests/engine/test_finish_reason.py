"""FinishReason (llm_engine/finish_reason.py) at the boundaries: a member is its wire string, in comparisons,
JSON, msgpack and pickle, so the gateway and clients see the same values as before it was an enum."""

from __future__ import annotations

import json
import pickle

import msgpack

from llm_engine.finish_reason import FinishReason
from llm_engine.request import RequestStatus


def test_each_reason_is_its_wire_string() -> None:
    for reason in FinishReason:
        assert reason == reason.value and f"{reason}" == reason.value
        assert json.dumps({"finish_reason": reason}) == json.dumps({"finish_reason": reason.value})
        assert msgpack.unpackb(msgpack.packb(reason)) == reason.value
        assert pickle.loads(pickle.dumps(reason)) is reason


def test_the_engine_reports_its_finished_states_as_reasons() -> None:
    assert RequestStatus.FINISHED_STOPPED.finish_reason is FinishReason.STOP
    assert RequestStatus.FINISHED_LENGTH.finish_reason is FinishReason.LENGTH
    assert RequestStatus.FINISHED_ABORTED.finish_reason is FinishReason.ABORT
