"""Schemathesis against the live server, from its own /openapi.json: every route, 80 examples each
(200 with ``scripts/test.sh --slow``).

Standard checks on every response: no server error (a 5xx, or a 5xx error event inside an SSE
stream), the status code is one the document lists, the content type and the body match the
documented response. Afterwards /health answers 200 and every slot is idle.

CI-sized: the tiny model, a 256-token context, at most 4 new tokens and 4 prompts per request
(server flags), so a request costs milliseconds; generating the bodies is what takes the time, so
routes with the same body (aliases, the token-counting routes, the embedding and rerank routes,
/apply-template's subset of the chat body) share the cases generated for one of them.
``MLXCEL_SCHEMATHESIS_EXAMPLES`` changes the count (default 80; ``scripts/test.sh --slow`` sets 200).
"""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from mlxcel_compat.server.app import routes
from mlxcel_compat.server.openapi import served_routes
from tests.conftest import tiny_model
from tests.e2e.helpers import wait_idle

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("MLXCEL_SCHEMATHESIS_EXAMPLES", "80"))


@pytest.fixture(scope="module")
def fuzzed_server(server_factory, tmp_path_factory) -> str:
    slot_dir = tmp_path_factory.mktemp("fuzzed-slots")  # the slot-file route answers 501 without it
    # A model with FIM tokens: /infill answers 501 without them.
    server = server_factory(
        ["-m", str(tiny_model("qwen2_coder")), "-np", "4", "-c", "256", "-b", "64", "--metrics", "--props",
         "--n-predict-max", "4", "--max-prompts", "4", "--alias", "fuzz", "--slot-save-path", str(slot_dir)]
    )
    return server.base_url


@pytest.fixture(scope="module")
def rerank_fuzzed_server(server_factory, tmp_path_factory) -> str:
    """The embedding and rerank routes' server (without --embeddings/--rerank they are 501s):
    the factory's reranker GGUF with --rerank, the other server's limits."""
    from mlxcel_compat.testing.gguf_writer import write_gguf
    from tests.conftest import tiny_model

    out = tmp_path_factory.mktemp("fuzzed-reranker") / "qwen3-reranker.gguf"
    write_gguf("qwen3", "tiny", out, "f32", model_dir=tiny_model("qwen3"), reranker=True)
    server = server_factory(["-m", str(out), "-np", "4", "-c", "256", "--rerank", "--max-prompts", "4", "--alias", "fuzz"])
    return server.base_url


EMBEDDING_PATHS = ("/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking")


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    schema = schemathesis.openapi.from_url(fuzzed_server + "/openapi.json")
    schema.config.generation.update(modes=["positive"], max_examples=EXAMPLES)
    return schema


def no_server_error_in_stream(response) -> None:
    """A stream answers 200 before it runs: an engine failure shows as an error event in it."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    # SSE lines end with CR, LF or CRLF only; str.splitlines() would also cut at U+2028 and other
    # separators, which JSON strings may hold unescaped (a fuzzed field echoed back, for instance).
    for line in re.split(r"\r\n|\r|\n", response.text):
        if line.startswith("data: {"):
            event = json.loads(line[len("data: ") :])
            error = event.get("error") if isinstance(event, dict) else None
            assert not (isinstance(error, dict) and error.get("code", 0) >= 500), f"server error in stream: {error}"


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance, response_schema_conformance]

# Routes whose documented body is the same as another route's (or a subset of it: unknown fields
# are ignored) get that route's generated cases too, so generation runs once per body schema:
# each of them still receives every example, validated against its own documentation.
SHARERS = {
    ("POST", "/completion"): [("POST", "/completions"), ("POST", "/v1/completions")],
    # The token-counting routes document exactly their generating route's body.
    ("POST", "/v1/chat/completions"): [("POST", "/chat/completions"), ("POST", "/apply-template"),
                                       ("POST", "/v1/chat/completions/input_tokens"), ("POST", "/chat/completions/input_tokens")],
    ("POST", "/v1/messages"): [("POST", "/v1/messages/count_tokens")],
    ("GET", "/health"): [("GET", "/v1/health")],
    ("GET", "/models"): [("GET", "/v1/models")],
    ("POST", "/v1/responses"): [("POST", "/responses"), ("POST", "/v1/responses/input_tokens"), ("POST", "/responses/input_tokens")],
    ("POST", "/v1/cache/reset"): [("POST", "/flush_cache")],
    ("POST", "/embedding"): [("POST", "/embeddings"), ("POST", "/v1/embeddings")],
    ("POST", "/rerank"): [("POST", "/reranking"), ("POST", "/v1/rerank"), ("POST", "/v1/reranking")],
}
SHARED = {route for routes_ in SHARERS.values() for route in routes_}
SOURCES = [route for route in served_routes(routes()) if route not in SHARED]


@pytest.mark.parametrize(("method", "path"), SOURCES, ids=lambda value: value)
def test_every_route_against_its_documentation(api_schema, fuzzed_server, request, method: str, path: str) -> None:
    if path in EMBEDDING_PATHS:
        fuzzed_server = request.getfixturevalue("rerank_fuzzed_server")
    targets = [(method, path), *SHARERS.get((method, path), [])]
    operations = {route: api_schema[route[1]][route[0]] for route in targets}
    calls: dict[tuple[str, str], list[int]] = {route: [] for route in targets}

    @given(case=operations[(method, path)].as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        for route, operation in operations.items():
            sent = case if route == (method, path) else operation.Case(body=case.body, query=case.query, media_type=case.media_type)
            response = sent.call_and_validate(base_url=fuzzed_server, checks=CHECKS, timeout=60)
            no_server_error_in_stream(response)
            calls[route].append(response.status_code)

    run()
    for route in targets:
        documented = api_schema.raw_schema["paths"][route[1]][route[0].lower()]
        has_inputs = "requestBody" in documented or "parameters" in documented
        # A route without inputs has one distinct request; every other one got all its examples.
        assert len(calls[route]) >= (EXAMPLES if has_inputs else 1), (route, len(calls[route]), sorted(set(calls[route])))
    assert {route for route in served_routes(routes())} == set(SOURCES) | SHARED  # every route is fuzzed


def test_routes_that_share_cases_document_a_subset_of_their_sources_inputs(api_schema) -> None:
    """What makes sharing sound: a sharer's documented body fields are its source's, defined the
    same way, it requires nothing more, and its parameters are the same."""
    def inputs(method: str, path: str) -> tuple[dict, list]:
        documented = api_schema.raw_schema["paths"][path][method.lower()]
        body = documented.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
        if "$ref" in body:
            body = api_schema.raw_schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
        return body, documented.get("parameters", [])

    for source, sharers in SHARERS.items():
        body, parameters = inputs(*source)
        for route in sharers:
            theirs, their_parameters = inputs(*route)
            fields = theirs.get("properties", {})
            assert {name: body.get("properties", {}).get(name) for name in fields} == fields, route
            assert set(theirs.get("required", [])) <= set(body.get("required", [])), route
            assert their_parameters == parameters, route


def test_server_is_healthy_and_idle_after_fuzzing(fuzzed_server: str) -> None:
    with httpx.Client(base_url=fuzzed_server, timeout=30) as client:
        assert client.get("/health").status_code == 200
        wait_idle(client, timeout=30)
        assert client.post("/completion", json={"prompt": "still fine", "n_predict": 2}).status_code == 200
