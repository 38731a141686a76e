"""llama-server's slot persistence: ``POST /slots/{id_slot}?action=save|restore|erase``.

Same responses and errors as llama-server (``server-context.cpp``):

- without ``--slot-save-path``: 501 ``not_supported_error``;
- ``id_slot`` is read like ``std::stoi`` (leading digits; "Invalid slot ID" otherwise, and for a
  negative id); a larger id wraps modulo the slot count, and the response echoes it as given;
- ``action`` other than save / restore / erase: 400 "Invalid action";
- ``filename`` must pass llama.cpp's ``fs_validate_filename`` (no path separator, no "..", ...):
  400 "Invalid filename";
- a restore that cannot be done: 400 "Unable to restore slot: <reason>" (another model, chat
  template or version, a damaged file, a prompt longer than the context, a missing file).

One deliberate difference: a missing or non-string ``filename`` is a 400 here (llama-server's JSON
exception makes it a 500). The work runs on the engine thread once the slot is idle
(``engine/slot_files.py``); this module only validates and formats.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from blake3 import blake3
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.engine import slot_files
from mlxcel_compat.server.errors import InvalidRequest, NotSupported, ServerError, json_response
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import ctx_of, read_json

ACTIONS = ("save", "restore", "erase")
_STOI = re.compile(r"\s*([+-]?\d+)")
_INT32 = 2**31
# Characters fs_validate_filename refuses (besides the path separators, always refused here).
_FORBIDDEN = set(':*?"<>|') | {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}


def parse_slot_id(text: str) -> int | None:
    """``std::stoi``: optional spaces and sign, then digits; the rest is ignored. None if invalid."""
    match = _STOI.match(text)
    if match is None:
        return None
    value = int(match.group(1))
    return value if -_INT32 <= value < _INT32 else None


def valid_filename(name: str) -> bool:
    """llama.cpp's ``fs_validate_filename`` without subdirectories."""
    if not name or len(name.encode("utf-8", "surrogatepass")) > 255:
        return False
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or 0xD800 <= c <= 0xDFFF or ch in _FORBIDDEN or ch in "/\\":
            return False
    if name[0] == " " or name[-1] in " .":
        return False
    return ".." not in name and name != "."


def template_digest(request: Request) -> str:
    """BLAKE3 of the chat template the server renders with ("" without one)."""
    template = ctx_of(request).model.chat_template
    source = template.source if template is not None else ""
    return blake3(source.encode()).hexdigest()


async def slot_action(request: Request) -> Response:
    ctx = ctx_of(request)
    save_path = ctx.settings.slot_save_path
    if not save_path:
        await request.body()
        raise NotSupported("This server does not support slots action. Start it with `--slot-save-path`")
    id_slot = parse_slot_id(request.path_params["id_slot"])
    action = request.query_params.get("action", "")
    if id_slot is None or id_slot < 0 or action not in ACTIONS or action == "erase":
        await request.body()  # drained: an unread body breaks the next request on a kept-alive connection
    if id_slot is None or id_slot < 0:
        raise InvalidRequest("Invalid slot ID")
    if action not in ACTIONS:
        raise InvalidRequest("Invalid action")
    slot = id_slot % len(ctx.engine.slots)
    if action == "erase":
        return json_response({**await ctx.client.call_on_slot(slot, slot_files.erase), "id_slot": id_slot})
    filename = (await read_json(request)).get("filename")
    if not isinstance(filename, str):
        raise InvalidRequest('"filename" is required and must be a string')
    if not valid_filename(filename):
        raise InvalidRequest("Invalid filename")
    path = Path(save_path).expanduser() / filename
    engine, digest = ctx.engine, template_digest(request)
    fn = slot_files.save if action == "save" else slot_files.restore
    try:
        result = await ctx.client.call_on_slot(slot, functools.partial(fn, engine, path=path, filename=filename, template_digest=digest))
    except slot_files.SlotHoldsMedia as exc:
        raise NotSupported(str(exc)) from None
    except slot_files.SlotFileError as exc:
        if action == "restore":
            raise InvalidRequest(f"Unable to restore slot: {exc}") from None
        raise ServerError(f"Unable to save slot: {exc}") from None
    except OSError as exc:
        if action == "restore":
            raise InvalidRequest(f"Unable to restore slot: {exc.strerror or exc}") from None
        raise ServerError(f"Unable to save slot: {exc.strerror or exc}") from None
    return json_response({**result, "id_slot": id_slot})  # llama-server echoes the id as given


ROUTES = [Route("/slots/{id_slot}", slot_action, methods=["POST"])]
OPERATIONS = {
    ("POST", "/slots/{id_slot}"): Operation(
        "Save, restore or erase a slot's prompt cache (llama-server's slot files; 501 without --slot-save-path)",
        body=("slots",),
        ok={"type": "object", "properties": {"id_slot": {"type": "integer"}}, "required": ["id_slot"]},
        errors=(500, 501),
        path={"id_slot": {"type": "integer"}},
        query={"action": {"enum": ["save", "restore", "erase"]}},
    ),
}
