"""The router's map of conversation ids to the models that own their resumable streams."""

from __future__ import annotations

import pytest

from mlxcel_compat.server.errors import InvalidRequest, NotFound, Unavailable
from mlxcel_compat.server.router_registry import ModelRegistry, RouterModel
from mlxcel_compat.server.router_sources import ModelSource
from mlxcel_compat.server.router_streams import ConversationOwners, conversation_header, stream_owner


def test_owners_keep_the_latest_model_and_a_bounded_number_of_ids() -> None:
    owners = ConversationOwners(limit=2)
    owners.remember("a", "llama")
    owners.remember("a", "qwen3")  # a newer request for the same conversation: its model owns it now
    owners.remember("b", "llama")
    owners.remember("c", "llama")  # over the limit: the oldest id goes
    assert (owners.lookup("a"), owners.lookup("b"), owners.lookup("c")) == (None, "llama", "llama")
    owners.forget("b")
    assert owners.lookup("b") is None
    first = owners.remember("d", "llama")
    assert owners.alive("d", first)
    second = owners.remember("d", "llama")  # a newer request of the conversation: the first is cancelled
    assert not owners.alive("d", first) and owners.alive("d", second)
    owners.forget("d")  # a stop (DELETE /v1/stream)
    assert not owners.alive("d", second)


def test_conversation_header_and_stream_owner() -> None:
    assert conversation_header({"headers": [(b"X-Conversation-Id", b" conv-1 ")]}) == "conv-1"
    assert conversation_header({"headers": []}) == ""
    model = RouterModel(ModelSource("llama", "/models/llama.gguf", "preset"), [], None)
    registry = ModelRegistry([model], [], 0, 0, 1.0)
    owners = ConversationOwners()
    owners.remember("conv-1", "llama")
    with pytest.raises(InvalidRequest):
        stream_owner(registry, owners, "", deleting=False)
    with pytest.raises(NotFound):  # its owner is not loaded: the stream went with it
        stream_owner(registry, owners, "conv-1", deleting=False)
    assert stream_owner(registry, owners, "conv-1", deleting=True) is None  # a DELETE answers 204 all the same
    model.status = "loading"
    with pytest.raises(Unavailable, match="retry later"):
        stream_owner(registry, owners, "conv-1", deleting=False)
    model.status, model.app = "loaded", object()
    assert stream_owner(registry, owners, "conv-1", deleting=False) is model
    with pytest.raises(NotFound):
        stream_owner(registry, owners, "nobody", deleting=False)
