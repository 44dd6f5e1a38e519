"""The bodies of the server's own training routes, validated strictly at the HTTP edge as
the OpenAI bodies are (server/protocol.py): labels (`POST /v1/feedback`), in each of the
kinds a training method takes, and rollbacks (`POST /v1/adapters/rollback`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from engine.sampling_params import InvalidParameter
from server.protocol_fields import INTEGRAL, Strict
from trainer.feedback import FeedbackLabel

Rewards = Annotated[list[float], Field(min_length=1)]


class _FeedbackId(Strict):
    # a completion's id, as this server gave it (a few dozen characters; longer is none of them)
    id: Annotated[str, Field(min_length=1, max_length=256)]


class PreferenceTexts(_FeedbackId):
    """POST /v1/feedback on a server that trains on preferences (DPO), with response
    texts: at least one of `chosen` and `rejected`; the other is the served response (of
    choice `choice_index`)."""

    model_config = ConfigDict(**Strict.model_config,
                              json_schema_extra={"anyOf": [{"required": ["chosen"]}, {"required": ["rejected"]}]})

    # (null is taken as absent, but not offered: the document shows what a label needs)
    chosen: Annotated[str, Field(min_length=1)] | SkipJsonSchema[None] = None
    rejected: Annotated[str, Field(min_length=1)] | SkipJsonSchema[None] = None
    choice_index: Annotated[int, Field(ge=0), INTEGRAL] = 0


class PreferenceIndices(_FeedbackId):
    """POST /v1/feedback on a server that trains on preferences (DPO), between two of the
    completion's choices (n >= 2), by index."""

    chosen_index: Annotated[int, Field(ge=0), INTEGRAL]
    rejected_index: Annotated[int, Field(ge=0), INTEGRAL]


class RewardsFeedback(_FeedbackId):
    """POST /v1/feedback on a server that trains on groups (GRPO): one reward per choice."""

    rewards: Rewards


class FeedbackRequest(_FeedbackId):
    """POST /v1/feedback as parsed on every server: any label, a preference (texts or
    indices) or rewards; the trainer refuses what its method does not take, naming what it
    does. The OpenAPI document shows the server's own kinds (PreferenceTexts or
    PreferenceIndices, or RewardsFeedback)."""

    chosen: Annotated[str, Field(min_length=1)] | None = None
    rejected: Annotated[str, Field(min_length=1)] | None = None
    choice_index: Annotated[int, Field(ge=0), INTEGRAL] = 0
    chosen_index: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    rejected_index: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    rewards: Rewards | None = None

    def label(self) -> FeedbackLabel:
        if "choice_index" in self.model_fields_set and (self.chosen_index is not None or self.rejected_index is not None
                                                        or self.rewards is not None):
            raise InvalidParameter("choice_index", "choice_index names the served choice that stands for a text "
                                   "label's missing side ('chosen' or 'rejected'); it does not go with "
                                   "'chosen_index'/'rejected_index' or 'rewards'")
        return FeedbackLabel(self.id, self.chosen, self.rejected, self.choice_index, self.chosen_index,
                             self.rejected_index, self.rewards)


class RollbackRequest(Strict):
    """POST /v1/adapters/rollback: make a saved adapter version the live one."""

    version: Annotated[int, Field(ge=0), INTEGRAL]
