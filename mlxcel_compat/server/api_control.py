"""``POST /v1/chat/completions/control``: act on a running chat completion (llama-server's route).

The one action is ``reasoning_end``: the completion, started with ``reasoning_control: true``,
has its reasoning block closed now. The engine forces the template's end-of-thinking marker
token by token, as a spent reasoning budget does (``engine/reasoning_budget.py``), and the model
goes on to its answer. The call is sent while the stream is being read, from another connection.

Answers as llama-server's: 400 for a missing id or an unknown action; otherwise 200
``{"success": bool}``, with a ``message`` when nothing was done (the id names no running
completion, or the completion did not arm reasoning control).
"""

from __future__ import annotations

import functools

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.engine.reasoning_budget import end_reasoning
from mlxcel_compat.server.errors import InvalidRequest, json_response
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import ctx_of, read_json

ACTIONS = ("reasoning_end",)


async def control(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await read_json(request)
    completion_id, action = body.get("id"), body.get("action")
    if not isinstance(completion_id, str) or not completion_id:
        raise InvalidRequest("missing completion id")
    if action not in ACTIONS:
        raise InvalidRequest("unknown control action")
    requests = ctx.completions.get(completion_id)
    if requests is None:
        return json_response({"success": False, "message": "no active completion for this id"})
    budgets = [r.reasoning_budget for r in requests]
    if not any(b is not None and b.control for b in budgets):
        return json_response({"success": False, "message": "reasoning control not enabled for this completion"})
    engine = ctx.engine
    await ctx.client.call(functools.partial(end_reasoning, engine.slots, [r.task_id for r in requests]))
    return json_response({"success": True})


ROUTES = [Route("/v1/chat/completions/control", control, methods=["POST"])]

OPERATIONS = {
    ("POST", "/v1/chat/completions/control"): Operation(
        "Act on a running chat completion: reasoning_end closes its reasoning block (reasoning_control: true)",
        body=("control",),
        ok={"type": "object", "properties": {"success": {"type": "boolean"}, "message": {"type": "string"}}, "required": ["success"]},
    ),
}
