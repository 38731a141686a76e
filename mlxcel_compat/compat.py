"""The llama-server compatibility manifest (docs/compat/llama-server.json) and its helpers.

The manifest is the machine-readable answer to "what of llama-server does mlxcel_compat do":
every flag (with its variables), every route and every request field, each with a status
(``supported`` | ``partial`` | ``noop`` | ``unsupported`` | ``refused``) and a short note.

Its ``flags`` and ``env_only`` sections are generated from ``settings.SETTINGS``, its
``request_fields`` and ``request_field_scopes`` sections from ``request_fields.REQUEST_FIELDS``
(the OpenAPI document at ``/openapi.json`` comes from the same table) and
``builtin_chat_templates`` from ``chat/builtin_templates.py``, by ``scripts/gen_docs.py``;
``routes`` and ``props_fields`` are maintained by hand in the JSON file, and tests check them
against the app.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxcel_compat.request_fields import SCOPES, manifest_entries
from mlxcel_compat.settings import SETTINGS, Setting

MANIFEST_PATH = Path(__file__).resolve().parent.parent / "docs" / "compat" / "llama-server.json"
MANIFEST_STATUSES = ("supported", "partial", "noop", "unsupported", "refused")


def load_manifest(path: Path | None = None) -> dict[str, Any]:
    """The parsed manifest (from the source tree: docs/ is not installed as package data)."""
    with open(path or MANIFEST_PATH, encoding="utf-8") as f:
        return json.load(f)


def manifest_routes(status: str | None = None, manifest: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """``(method, path)`` pairs, optionally only those with ``status``; paths use ``{param}``."""
    data = manifest if manifest is not None else load_manifest()
    return [(r["method"], r["path"]) for r in data["routes"] if status is None or r["status"] == status]


def manifest_request_fields(
    status: str | None = None, scope: str | None = None, manifest: dict[str, Any] | None = None
) -> list[str]:
    """Request field names (aliases not included), filtered by status and/or scope."""
    data = manifest if manifest is not None else load_manifest()
    return [
        f["field"] for f in data["request_fields"]
        if (status is None or f["status"] == status) and (scope is None or f["scope"] == scope)
    ]


def manifest_flags(status: str | None = None, manifest: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Flag entries (one per setting with flags), optionally only those with ``status``."""
    data = manifest if manifest is not None else load_manifest()
    return [f for f in data["flags"] if status is None or f["status"] == status]


def _flag_entry(s: Setting) -> dict[str, Any]:
    return {
        "setting": s.name,
        "flags": list(s.flags),
        "negative_flags": list(s.negative_flags),
        "takes_value": s.takes_value,
        "env": list(s.env),
        "negative_env": list(s.negative_env),
        "mlxcel_env": s.mlxcel_env,
        "status": s.status,
        "origin": "llama-server" if s.upstream else "mlxcel",
        "note": s.reason,
    }


def _env_only_entry(s: Setting) -> dict[str, Any]:
    return {
        "setting": s.name,
        "env": list(s.env),
        "mlxcel_env": s.mlxcel_env,
        "status": s.status,
        "origin": "llama-server" if s.upstream else "mlxcel",
        "note": s.help,
    }


def generated_sections() -> dict[str, Any]:
    """The manifest sections derived from the settings, request-field and built-in template tables."""
    from mlxcel_compat.chat.builtin_templates import BUILTIN_TEMPLATE_NAMES

    return {
        "flags": [_flag_entry(s) for s in SETTINGS if s.flags or s.negative_flags],
        "env_only": [_env_only_entry(s) for s in SETTINGS if not (s.flags or s.negative_flags)],
        "request_field_scopes": dict(SCOPES),
        "request_fields": manifest_entries(),
        "builtin_chat_templates": list(BUILTIN_TEMPLATE_NAMES),
    }


def with_generated_sections(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` whose generated sections match the table (other keys kept as is)."""
    updated = dict(manifest)
    updated.update(generated_sections())
    return updated


def dump_manifest(manifest: dict[str, Any]) -> str:
    """The manifest's canonical file text."""
    return json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
