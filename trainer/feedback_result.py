"""What became of a label sent as feedback: accepted, or refused and why, with OpenAI's
`param` and `code` (the server maps the outcome to 200/400/404/409/503)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FeedbackOutcome(str, enum.Enum):
    ACCEPTED = "accepted"
    # the label is malformed, or this server does not use feedback
    INVALID = "invalid"
    # no entry for the completion: unknown, not recorded, evicted or expired
    UNKNOWN = "unknown"
    # the entry already has its label, or its response is still being generated
    CONFLICT = "conflict"
    # the feedback ledger cannot be written now: nothing was accepted, try again later
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class FeedbackResult:
    outcome: FeedbackOutcome
    message: str = ""
    # the request field at fault, and OpenAI's error code
    param: str | None = None
    code: str | None = None
    # accepted, but the group's rewards were all equal: it gives no gradient and is not trained
    skipped: bool = False

    @property
    def accepted(self) -> bool:
        return self.outcome is FeedbackOutcome.ACCEPTED


ACCEPTED = FeedbackResult(FeedbackOutcome.ACCEPTED)


class Refused(Exception):
    """A label refused: raised where the reason is found, answered as its `result`."""

    def __init__(self, result: FeedbackResult):
        self.result = result


def refuse(outcome: FeedbackOutcome, message: str, param: str | None, code: str) -> Refused:
    return Refused(FeedbackResult(outcome, message, param, code))
