"""/openapi.json: an OpenAPI 3.1 document generated from the served routes and the request-field
table, so it cannot drift from what the server does (and from the compatibility manifest)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import jsonschema_rs

from mlxcel_compat.compat import manifest_routes
from mlxcel_compat.request_fields import REQUEST_FIELDS
from mlxcel_compat.server.api_vertex import VertexConfig
from mlxcel_compat.server.app import operations, routes
from mlxcel_compat.server.openapi import served_routes

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def document(server) -> dict[str, Any]:
    response = httpx.get(server.base_url + "/openapi.json", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    return response.json()


def test_every_served_route_is_documented_and_nothing_else(document) -> None:
    documented = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    served = set(served_routes(routes()))
    assert documented == served
    assert set(operations()) == served  # each module declares exactly its routes
    # In Vertex AI mode /predict (and an optional health route) join them, documented as well.
    vertex = VertexConfig(enabled=True, health_route="/ping")
    assert set(operations(vertex)) == set(served_routes(routes(vertex)))
    assert {tuple(r) for r in manifest_routes(status="supported")} == set(served_routes(routes(VertexConfig(enabled=True))))


def test_document_is_openapi_3_1_with_valid_schemas(document) -> None:
    assert document["openapi"] == "3.1.0"
    for path, item in document["paths"].items():
        for method, op in item.items():
            assert op["summary"] and op["operationId"]
            schemas = [c["schema"] for r in op["responses"].values() for c in r["content"].values()]
            if "requestBody" in op:
                schemas.append(op["requestBody"]["content"]["application/json"]["schema"])
            for schema in schemas:
                jsonschema_rs.meta.validate({**schema, "$schema": "https://json-schema.org/draft/2020-12/schema"})
            if "requestBody" in op:
                assert {"400", "413"} <= set(op["responses"]), (method, path)


def body_properties(document: dict[str, Any], path: str) -> dict[str, Any]:
    return document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]


@pytest.mark.parametrize(
    ("path", "scopes"),
    [
        ("/completion", ("all", "completion")),
        ("/v1/completions", ("all", "completion")),
        ("/v1/chat/completions", ("all", "chat")),
        ("/tokenize", ("tokenize",)),
        ("/detokenize", ("detokenize",)),
    ],
)
def test_request_bodies_are_the_request_field_table(document, path: str, scopes: tuple[str, ...]) -> None:
    expected = set()
    for f in REQUEST_FIELDS:
        if f.scope in scopes and "[" not in f.field:
            expected |= {f.top_level, *f.aliases}
    assert set(body_properties(document, path)) == expected


def test_limits_come_from_the_running_server(document, http: httpx.Client) -> None:
    props = body_properties(document, "/completion")
    n_probs = props["n_probs"]["anyOf"][0]
    assert n_probs["maximum"] == 100  # --n-probs-max default
    assert props["n_cmpl"]["anyOf"][0]["maximum"] == http.get("/props").json()["total_slots"]
    chat = body_properties(document, "/v1/chat/completions")
    assert chat["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert chat["logprobs"]["anyOf"][0]["type"] == "boolean"  # the chat meaning wins over n_probs' alias
    assert body_properties(document, "/v1/completions")["logprobs"]["anyOf"][0]["type"] == "integer"
    assert document["paths"]["/completion"]["post"]["requestBody"]["content"]["application/json"]["schema"]["required"] == ["prompt"]


def test_documented_responses_match_real_ones(document, http: httpx.Client) -> None:
    """A few real responses validate against their documented schemas (schemathesis does the rest)."""
    components = document["components"]

    def check(path: str, method: str, response: httpx.Response) -> None:
        schema = document["paths"][path][method]["responses"][str(response.status_code)]["content"]["application/json"]["schema"]
        jsonschema_rs.Draft202012Validator({**schema, "components": components}).validate(response.json())

    check("/completion", "post", http.post("/completion", json={"prompt": "Hi", "n_predict": 2, "n_probs": 2}))
    check("/v1/chat/completions", "post", http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True}))
    check("/v1/completions", "post", http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}))
    check("/tokenize", "post", http.post("/tokenize", json={"content": "Hi", "with_pieces": True}))
    check("/completion", "post", http.post("/completion", json={"prompt": "Hi", "n_probs": 1000}))  # a documented 400
