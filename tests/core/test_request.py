"""Request state machine: only the allowed transitions, and finished states are final."""

from __future__ import annotations

import pytest

from voltllm.core.request import InvalidTransition, Request, RequestStatus
from voltllm.protocol import EngineSamplingParams


def test_lifecycle_and_forbidden_transitions():
    r = Request("r", [1, 2, 3], EngineSamplingParams(stop_token_ids=[9]), eos_token_ids=(2,))
    assert r.status is RequestStatus.WAITING and r.stop_token_ids == {2, 9}
    with pytest.raises(InvalidTransition):
        r.transition(RequestStatus.PREEMPTED)  # never ran
    r.transition(RequestStatus.RUNNING)
    r.transition(RequestStatus.PREEMPTED)
    r.transition(RequestStatus.RUNNING)
    r.append_output_token(5)
    assert (r.num_tokens, r.num_output_tokens, r.all_token_ids) == (4, 1, [1, 2, 3, 5])
    r.transition(RequestStatus.FINISHED_STOPPED)
    assert r.is_finished and r.status.finish_reason.value == "stop"
    for status in RequestStatus:
        with pytest.raises(InvalidTransition):
            r.transition(status)


def test_ignore_eos_keeps_only_user_stop_ids():
    r = Request("r", [1], EngineSamplingParams(ignore_eos=True, stop_token_ids=[4]), eos_token_ids=(2,))
    assert r.stop_token_ids == {4}
