"""Resumable streams behind the router: which model owns a conversation's stream.

A streamed request carrying ``X-Conversation-Id`` becomes a resumable stream in the model that
serves it (``server/streams.py``). Its later routes name only the conversation, not the model, so
the router remembers the owner of each conversation id it forwarded, as llama-server's router
does (``conv_models`` in ``tools/server/server-models.cpp``), and answers as it does:

- ``GET /v1/stream?conv_id=ID&from=N``: handed to the owning model (``?model=`` may name it
  instead); 404 ``Stream not found or expired`` when no loaded model owns it, 503 ``Stream owner
  model is loading, retry later`` while its owner loads;
- ``DELETE /v1/stream?conv_id=ID``: handed to the owner when it is loaded; 204 either way, and the
  conversation is forgotten;
- ``POST /v1/streams/lookup``: each id asked for is looked up in its owner's sessions (only loaded
  owners; ids no model owns are left out), the answers joined in one list.

A request of a conversation that waits for its model to load is not given up when its client
leaves (its generation goes to the stream's buffer, for a later resume), and a ``DELETE`` while
it waits, or a newer request of the same conversation, cancels it before it reaches the model
(llama-server's ``conv_models.alive`` ticket).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from mlxcel_compat.server.errors import InvalidRequest, NotFound, Unavailable, json_response
from mlxcel_compat.server.router_registry import ModelRegistry, RouterModel
from mlxcel_compat.server.streams import CONVERSATION_HEADER

STREAM_PATH = "/v1/stream"
LOOKUP_PATH = "/v1/streams/lookup"
MAX_CONVERSATIONS = 4096  # owners remembered at most (the oldest are forgotten first)


class ConversationOwners:
    """Conversation id -> the name of the model whose stream it is (the most recent request wins),
    with the ticket of that request."""

    def __init__(self, limit: int = MAX_CONVERSATIONS) -> None:
        self.limit = limit
        self.owners: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self.tickets = itertools.count(1)

    def remember(self, conversation: str, model: str) -> int:
        """Record the request's model as the owner; returns the request's ticket."""
        ticket = next(self.tickets)
        self.owners[conversation] = (model, ticket)
        self.owners.move_to_end(conversation)
        while len(self.owners) > self.limit:
            self.owners.popitem(last=False)
        return ticket

    def lookup(self, conversation: str) -> str | None:
        entry = self.owners.get(conversation)
        return entry[0] if entry is not None else None

    def alive(self, conversation: str, ticket: int) -> bool:
        """Whether the request of ``ticket`` is still the conversation's (no stop, no newer request)."""
        entry = self.owners.get(conversation)
        return entry is not None and entry[1] == ticket

    def forget(self, conversation: str) -> None:
        self.owners.pop(conversation, None)


def conversation_header(scope: Any) -> str:
    """The request's ``X-Conversation-Id`` ("" when it has none)."""
    for key, value in scope.get("headers") or ():
        if key.decode("latin-1").lower() == CONVERSATION_HEADER:
            return value.decode("latin-1").strip()
    return ""


def stream_owner(registry: ModelRegistry, owners: ConversationOwners, conversation: str,
                 deleting: bool) -> RouterModel | None:
    """The loaded model owning ``conversation``'s stream. None for a ``DELETE`` with no loaded
    owner (answered 204 all the same); for a ``GET``, 404 or (its owner still loading) 503."""
    if not conversation:
        raise InvalidRequest("Missing conversation id in path")
    name = owners.lookup(conversation)
    model = registry.find(name) if name is not None else None
    if model is not None and model.status == "loaded" and model.app is not None:
        return model
    if deleting:
        return None
    if model is not None and model.status == "loading":
        raise Unavailable("Stream owner model is loading, retry later")
    raise NotFound("Stream not found or expired")


async def streams_lookup(request: Request) -> Response:
    """``POST /v1/streams/lookup`` across the models: each id's owner answers for it."""
    state = request.app.state.ctx
    raw = await request.body()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        return json_response([])  # llama-server answers an unreadable body with an empty list
    ids = body.get("conversation_ids") if isinstance(body, dict) else None
    wanted = [i for i in ids if isinstance(i, str) and i] if isinstance(ids, list) else []
    per_model: dict[str, list[str]] = {}
    for conversation in wanted:
        name = state.owners.lookup(conversation)
        if name is not None:
            per_model.setdefault(name, []).append(conversation)
    found: list[dict[str, Any]] = []
    for name, conversations in per_model.items():
        model = state.registry.find(name)
        if model is not None and model.status == "loaded" and model.ctx is not None:
            found += [session.to_json() for session in model.ctx.streams.lookup(conversations)]
    return json_response(found)


__all__ = ["LOOKUP_PATH", "STREAM_PATH", "ConversationOwners", "conversation_header", "stream_owner",
           "streams_lookup"]
