"""The one request-field table: every JSON body field the routes know, with its status and schema.

Like ``settings.py`` for options, this table is the single source for request fields. It
generates the ``request_fields`` and ``request_field_scopes`` sections of the compatibility
manifest (docs/compat/llama-server.json, by ``scripts/gen_docs.py``) and the request-body schemas
of the OpenAPI document served at ``/openapi.json`` (``server/openapi.py``), so the two cannot
drift apart, and tests check both against the code.

A field's ``schema`` is the JSON Schema (2020-12, as OpenAPI 3.1 uses) of the values this server
serves: a value outside it gets a 4xx naming the field (or, for ``unsupported`` fields, a 501).
``null`` always means "absent" (llama-server's rule) and is added by the OpenAPI builder. Strings
``"$name"`` in a schema are bounds the server fills in from its settings and model
(:func:`bounds`), e.g. ``"$n_probs_max"`` is ``--n-probs-max``.

``scope`` says which routes read a field: ``all`` (the native routes, passed through by the OpenAI
ones), ``completion``, ``infill``, ``chat``, ``tokenize``, ``detokenize``, ``vertex``, and the agent APIs'
own bodies, ``messages`` (Anthropic) and ``responses`` (OpenAI Responses). A name is unique
within a scope. A dotted name (``stream_options.
include_usage``) is a member of an object field; ``messages[].content[].image_url`` names a content
part type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from mlxcel_compat.engine.sampling.parsing import SAMPLER_ALIASES, SAMPLER_CHARS

SCOPES: dict[str, str] = {
    "all": "native routes; the OpenAI routes pass these through too",
    "completion": "/completion, /completions, /v1/completions",
    "chat": "/chat/completions, /v1/chat/completions (and /apply-template, which renders the chat only)",
    "infill": "/infill (every native field too)",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "vertex": "/predict (Vertex AI prediction mode, AIP_MODE=PREDICTION)",
    "messages": "/v1/messages, /v1/messages/count_tokens (Anthropic)",
    "responses": "/v1/responses, /responses, /v1/responses/input_tokens (OpenAI Responses)",
    "slots": "/slots/{id_slot}?action=save|restore|erase (needs --slot-save-path)",
    "cache_reset": "/v1/cache/reset, /flush_cache",
    "embeddings": "/embedding, /embeddings, /v1/embeddings (needs --embeddings)",
    "rerank": "/rerank, /reranking, /v1/rerank, /v1/reranking (needs --rerank)",
    "streams_lookup": "/v1/streams/lookup (resumable streams)",
    "control": "/v1/chat/completions/control",
}
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)

# --------------------------------------------------------------------------- schema pieces

BOOL = {"type": "boolean"}
NUMBER = {"type": "number"}
INTEGER = {"type": "integer"}  # soft-clamped (top_k) or taken modulo (id_slot): any integer is served
STRING = {"type": "string"}
OBJECT = {"type": "object"}


def int_range(lo: Any = None, hi: Any = None) -> dict[str, Any]:
    """An integer field: llama.cpp's schema reads them as int32 (a value out of that range is a 400)."""
    return {"type": "integer", "minimum": INT32_MIN if lo is None else lo, "maximum": INT32_MAX if hi is None else hi}


TOKEN_ID = int_range(0, "$n_vocab_max")
PIECES = {"type": "array", "items": {"anyOf": [TOKEN_ID, STRING]}}  # token ids and strings, mixed
PROMPT_OBJECT = {"type": "object", "properties": {"prompt_string": STRING}, "required": ["prompt_string"]}
STOP_STRINGS = {"type": "array", "items": {"type": "string", "maxLength": "$max_stop_chars"}, "maxItems": "$max_stop_strings"}
TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": STRING}, "required": ["type", "text"]}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "id": STRING,
        "type": {"const": "function"},
        "function": {"type": "object", "properties": {"name": STRING, "arguments": STRING}, "required": ["name"]},
    },
    "required": ["function"],
}
MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [STRING, {"type": "null"}, {"type": "array", "items": TEXT_PART}]},
        "name": STRING,
        "tool_calls": {"type": "array", "items": TOOL_CALL},
        "tool_call_id": STRING,
        "reasoning_content": STRING,
    },
    "required": ["role", "content"],
}
TOOL = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": STRING, "description": STRING, "parameters": OBJECT},
            "required": ["name"],
        },
    },
    "required": ["type", "function"],
}
ANTHROPIC_BLOCK = {"type": "object", "properties": {"type": {"enum": ["text", "tool_use", "tool_result", "thinking"]}}, "required": ["type"]}
ANTHROPIC_MESSAGE = {
    "type": "object",
    "properties": {"role": {"enum": ["user", "assistant"]}, "content": {"anyOf": [STRING, {"type": "array", "items": ANTHROPIC_BLOCK}]}},
    "required": ["role", "content"],
}
ANTHROPIC_TOOL = {"type": "object", "properties": {"name": STRING, "description": STRING, "input_schema": OBJECT}, "required": ["name"]}


@dataclass(frozen=True)
class RequestField:
    field: str
    schema: Mapping[str, Any] = field(default_factory=dict)
    scope: str = "all"
    status: str = "supported"
    aliases: tuple[str, ...] = ()
    origin: str = "llama-server"
    note: str = ""
    required: bool = False

    @property
    def top_level(self) -> str:
        """The body key that holds this field (``stream_options`` for ``stream_options.include_usage``)."""
        return self.field.split(".")[0].split("[")[0]


def _f(name: str, schema: Mapping[str, Any], **kw: Any) -> RequestField:
    return RequestField(name, schema, **kw)


def _noop(name: str, schema: Mapping[str, Any], note: str, **kw: Any) -> RequestField:
    return RequestField(name, schema, status="noop", note=note, **kw)


_CHAT_INTERNAL = "llama.cpp-internal chat field; the chat route computes its own"

REQUEST_FIELDS: tuple[RequestField, ...] = (
    _f("prompt", {"anyOf": [STRING, PIECES, PROMPT_OBJECT,
                            {"type": "array", "maxItems": "$max_prompts", "items": {"anyOf": [STRING, PIECES, PROMPT_OBJECT]}}]},
       scope="completion", required=True,
       note="string, token ids, mixed arrays, several prompts (at most --max-prompts); multimodal_data (base64 images, or "
            "WAV audio told by its bytes on Gemma 3n, at the /props media_marker, one prompt) on a vision-language model "
            "(docs/vision.md), rejected by a text model"),
    _f("stream", BOOL),
    _f("stream_options.include_usage", BOOL),
    _f("cache_prompt", BOOL, note="false = a cold prefill that neither reads nor feeds the prompt cache; also read from extra_body; "
       "true: a prompt sent again is adopted whole when its entry kept the last position's logits (cache_n = the prompt, prompt_n 0; "
       "llama-server computes the last token again: n - 1 and 1)"),
    _f("n_predict", int_range(-1, INT32_MAX), aliases=("max_completion_tokens", "max_tokens"),
       note="lowered to --n-predict-max when that is set"),
    _f("n_keep", int_range(-1), note="tokens kept on a context shift (--context-shift; -1: the whole prompt; the BOS "
       "token is kept on top); default --keep"),
    _f("n_discard", int_range(0), note="tokens dropped after n_keep on a context shift (0: half of the rest)"),
    _f("n_indent", int_range(0), note="a new line indented by fewer than n_indent spaces/tabs stops generation (stop_type 'limit') and is cut from the reply"),
    _f("n_cmpl", int_range(1, "$n_parallel"), aliases=("n",), note="limited to --parallel"),
    _noop("n_cache_reuse", int_range(0), "KV-shift chunk reuse is not implemented; the prompt cache reuses prefixes by itself"),
    _f("t_max_predict_ms", int_range(-1), note="generation stops with stop_type 'limit' at the first newline sent after this many ms of generation (llama-server's rule)"),
    _f("return_tokens", BOOL),
    _f("return_progress", BOOL,
       note="streams prompt_progress {total, cache, processed, time_ms} with llama-server's counts: once at the start "
            "(processed = cache = the reused prefix), then one per -b tokens, the last with processed = total; native and "
            "OpenAI chunks, and response.in_progress events on /v1/responses"),
    _f("timings_per_token", BOOL,
       note="running timings on each streamed token chunk (native, OpenAI completions and chat, Responses text deltas) "
            "and on each prompt_progress report"),
    _f("post_sampling_probs", BOOL),
    _f("n_probs", int_range(0, "$n_probs_max"), aliases=("logprobs",),
       note="at most --n-probs-max (400 above it); logprobs is the /v1/completions spelling"),
    _f("min_keep", int_range(0)),
    _f("response_fields", {"anyOf": [STRING, {"type": "array", "items": STRING}]}),
    _f("sse_ping_interval", int_range(-1)),
    _f("temperature", NUMBER),
    _f("dynatemp_range", NUMBER),
    _f("dynatemp_exponent", NUMBER),
    _f("top_k", INTEGER),
    _f("top_p", NUMBER),
    _f("min_p", NUMBER),
    _f("top_n_sigma", NUMBER),
    _f("typical_p", NUMBER),
    _f("xtc_probability", NUMBER),
    _f("xtc_threshold", NUMBER),
    _f("repeat_last_n", int_range(0)),
    _f("repeat_penalty", NUMBER),
    _f("presence_penalty", NUMBER),
    _f("frequency_penalty", NUMBER),
    _f("dry_multiplier", NUMBER),
    _f("dry_base", NUMBER),
    _f("dry_allowed_length", int_range(0)),
    _f("dry_penalty_last_n", int_range(-1)),
    _f("dry_sequence_breakers", {**STOP_STRINGS, "minItems": 1}, note="at most --max-stop-strings, each at most --max-stop-chars"),
    _f("seed", int_range(INT32_MIN, 2**32 - 1), note="-1 = random; the uint32 range"),
    _f("samplers", {"anyOf": [
        {"type": "array", "items": {"enum": sorted(SAMPLER_ALIASES)}, "maxItems": "$max_samplers"},
        {"type": "string", "pattern": "^[" + "".join(SAMPLER_CHARS) + "]*$", "maxLength": "$max_samplers"},
    ]}, note="at most --max-samplers entries"),
    _f("logit_bias", {"anyOf": [
        {"type": "object", "additionalProperties": {"anyOf": [NUMBER, BOOL]}, "maxProperties": "$max_logit_bias"},
        {"type": "array", "maxItems": "$max_logit_bias",
         "items": {"type": "array", "prefixItems": [{"anyOf": [INTEGER, STRING]}, {"anyOf": [NUMBER, BOOL]}], "minItems": 2, "maxItems": 2}},
    ]}, note="at most --max-logit-bias entries"),
    _f("ignore_eos", BOOL),
    _f("stop", {"anyOf": [{"type": "string", "maxLength": "$max_stop_chars"}, STOP_STRINGS]},
       note="at most --max-stop-strings, each at most --max-stop-chars"),
    _f("mirostat", INTEGER, note="1 or 2 replaces the sampler chain with temperature then Mirostat (v1 m=100 or v2), as llama.cpp's common_sampler; seeded"),
    _f("mirostat_tau", NUMBER),
    _f("mirostat_eta", NUMBER),
    _f("adaptive_target", NUMBER, note="adaptive-p's target probability, clamped to <= 1 (-1 = off); acts when adaptive_p is in samplers"),
    _f("adaptive_decay", NUMBER, note="adaptive-p's decay, [0, 0.99] (a 400 outside)"),
    _noop("backend_sampling", BOOL, "sampling always runs in the engine"),
    _f("json_schema", OBJECT, note="llguidance; a grammar wins on the completion routes, both is a 400 on the chat routes"),
    _f("grammar", STRING, note="llama.cpp GBNF (or Lark, llguidance syntax), compiled by llguidance and cached by text"),
    _f("grammar_lazy", BOOL, note="needs grammar_triggers"),
    _f("grammar_triggers", {"type": "array", "items": {"type": "object", "properties": {"type": {"enum": [0, 1, 2, 3]}, "value": STRING, "token": INTEGER}, "required": ["type", "value"]}},
       note="llama-server's four types: token, word, pattern, full pattern"),
    _f("preserved_tokens", {"type": "array", "items": STRING}, note="one-token entries may be word triggers and are rendered as text"),
    _f("lora", {"type": "array", "items": {"type": "object", "properties": {"id": INTEGER, "scale": NUMBER}}},
       note="per-request adapter scales: adapters not listed get 0, ids out of range are ignored; absent or empty: "
            "the global scales (POST /lora-adapters); its own prompt-cache bucket (lora_id); rows with different "
            "scales share a batched pass, each scaled by its own"),
    _f("id_slot", INTEGER, note="pins the request to a slot, modulo the slot count"),
    _f("verbose", BOOL, note="adds __verbose to OpenAI responses"),
    _f("reasoning_format", {"enum": ["none", "auto", "deepseek", "deepseek-legacy"]}, note="per-request override of --reasoning-format"),
    _noop("chat_format", INTEGER, _CHAT_INTERNAL),
    _noop("chat_parser", STRING, _CHAT_INTERNAL),
    _noop("generation_prompt", STRING, _CHAT_INTERNAL),
    _noop("parse_tool_calls", BOOL, _CHAT_INTERNAL),
    _noop("message_delimiters", OBJECT, "llama.cpp-internal chat field"),
    _f("cache_explain", BOOL, origin="mlxcel",
       note="the response (and a stream's final chunk) gets cache_explain: tokens reused, the best candidate entry and why it "
            "was or was not adopted, the first diverging token and the text around it; also the header X-Cache-Explain: 1 "
            "(docs/prompt-cache.md)"),
    _f("reasoning_control", BOOL, note="arms POST /v1/chat/completions/control's reasoning_end for this completion: the "
       "reasoning block (the template's own tags) is closed on request and the model goes on to its answer"),
    _f("reasoning_budget_tokens", int_range(-1), aliases=("thinking_budget_tokens",),
       note="alias thinking_budget_tokens; default --reasoning-budget; after N tokens inside a thinking block the end tag "
            "(after reasoning_budget_message) is forced token by token; a prompt that opens the block starts the count"),
    _f("reasoning_budget_start_tag", STRING, note="default <think>"),
    _f("reasoning_budget_end_tag", STRING, aliases=("reasoning_budget_end_tags",), note="default </think>"),
    _f("reasoning_budget_message", STRING, note="default --reasoning-budget-message; forced before the end tag"),
    _noop("echo", BOOL, "ignored, as llama-server does", scope="completion"),
    _noop("best_of", INTEGER, "ignored, as llama-server does", scope="completion"),
    _noop("suffix", STRING, "ignored, as llama-server does", scope="completion"),
    _noop("model", STRING, "ignored in single-model mode, as llama-server does; responses carry the server's model name"),
    _f("messages", {"type": "array", "items": MESSAGE}, scope="chat", required=True, note="string, null or text-part content"),
    RequestField("messages[].content[].image_url", scope="chat", status="partial",
                 note="served by a vision-language model directory (mlx-vlm Qwen2-VL, Qwen2.5-VL, Gemma 3, LLaVA; docs/vision.md): data: URIs "
                      "and raw base64, http(s) only with --media-fetch, file:// refused; limits --media-max-*; a text model "
                      "answers llama-server's 500 'image input is not supported - hint: ...' (in any message, tool messages too)"),
    RequestField("messages[].content[].input_audio", scope="chat", status="partial",
                 note="served by a Gemma 3n directory (mlx-vlm's audio tower; docs/vision.md): {data: base64, format: wav|mp3}, "
                      "WAV, MP3 (and FLAC told by its bytes) decoded by miniaudio, as llama-server does; limits --media-max-audio, "
                      "--media-max-audio-seconds, --media-max-bytes; any other model answers llama-server's 500 "
                      "'audio input is not supported - hint: ...'"),
    RequestField("messages[].content[].input_video", scope="chat", status="unsupported", note="video is not served: llama-server's 500"),
    _f("tools", {"type": "array", "items": TOOL}, scope="chat", note="needs --jinja"),
    _f("tool_choice", {"anyOf": [{"enum": ["auto", "none", "required"]},
                                 {"type": "object", "properties": {"type": {"const": "function"},
                                                                   "function": {"type": "object", "properties": {"name": STRING}, "required": ["name"]}},
                                  "required": ["type", "function"]}]},
       scope="chat", note="auto (free text, calls constrained once opened), none, required, or a named function (forced call)"),
    _f("parallel_tool_calls", BOOL, scope="chat", note="false: at most one call (and the grammar allows only one)"),
    _f("chat_template_kwargs", OBJECT, scope="chat", note="merged over --chat-template-kwargs; both override the date_string and datetime every template gets (today, local time)"),
    _f("reasoning_effort", STRING, scope="chat", note="'none' turns thinking off; other values are ignored, as llama-server does"),
    _f("add_generation_prompt", BOOL, scope="chat"),
    _f("continue_final_message", BOOL, scope="chat"),
    _f("response_format", {"type": "object", "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "schema": OBJECT,
                                                             "json_schema": {"type": "object", "properties": {"schema": OBJECT, "strict": BOOL}}},
                           "required": ["type"]},
       scope="chat", note="text, json_object (optional schema), json_schema (strict accepted); also on /v1/completions"),
    _f("logprobs", BOOL, scope="chat", note="boolean; turns on top_logprobs (default 20)"),
    _f("top_logprobs", int_range(0, 20), scope="chat", note="at most 20 (OpenAI's limit); needs logprobs: true"),
    _noop("skip_special_tokens", BOOL, "vLLM/SGLang field routers inject as true on chat and completions bodies; text follows "
          "llama-server's rules (end-of-generation tokens end the reply and are not shown)", origin="mlxcel"),
    _noop("no_stop_trim", BOOL, "SGLang field routers inject as false; stop strings are trimmed as in llama-server", origin="mlxcel"),
    _noop("return_hidden_states", BOOL, "SGLang field routers inject as false; hidden states are never returned", origin="mlxcel"),
    _f("separate_reasoning", BOOL, scope="chat", origin="mlxcel",
       note="SGLang field routers inject as true on every chat body (true changes nothing); false = reasoning_format none when the request gives no reasoning_format"),
    _noop("include_reasoning", BOOL, "vLLM field routers inject as true on every chat body, so it carries no client intent; reasoning follows reasoning_format",
          scope="chat", origin="mlxcel"),
    _noop("stream_reasoning", BOOL, "SGLang field routers inject as true; reasoning is always streamed as reasoning_content deltas", scope="chat", origin="mlxcel"),
    _f("user", STRING, note="prompt-cache session key when neither prompt_cache_key nor a session header (X-Session-ID, Session-ID, session_id, "
                            "X-Session-Affinity, X-User-ID) is given; Anthropic metadata.user_id maps here"),
    _f("prompt_cache_key", STRING, origin="mlxcel",
       note="prompt-cache session key (chat, completions, Responses); also read from extra_body; wins over the X-Session-ID header"),
    _f("cache_salt", STRING, origin="mlxcel",
       note="vLLM's field: a prompt-cache namespace under --prompt-cache-isolation salt or api-key; also read from extra_body"),
    _f("extra_body", {"type": "object", "properties": {"cache_prompt": BOOL, "prompt_cache_key": STRING, "cache_salt": STRING}},
       origin="mlxcel", note="cache_prompt, prompt_cache_key and cache_salt are read from it too"),
    _f("input_prefix", {"anyOf": [STRING, PIECES]}, scope="infill", required=True,
       note="the text before the cursor (or text and token ids mixed); its last 3/4 x --batch-size tokens are kept; "
            "llama-server answers 500 when it is missing, this server 400"),
    _f("input_suffix", {"anyOf": [STRING, PIECES]}, scope="infill", required=True,
       note="the text after the cursor; its first --batch-size/4 - 2 - len(prompt) tokens are kept"),
    _f("input_extra", {"type": "array", "items": {"type": "object", "properties": {"text": STRING, "filename": STRING}, "required": ["text"]}},
       scope="infill",
       note="other files' text before the FIM prefix: repo-level <|repo_name|>/<|file_sep|> layout when the model has those tokens, "
            "else '--- snippet ---' separators; the last n_ctx - --batch-size - 2 x -n tokens are kept; filename defaults to tmp"),
    _f("prompt", STRING, scope="infill", note="text after the prefix, before the FIM suffix token (special tokens parsed); a non-string is ignored, as llama-server does"),
    _f("content", {"anyOf": [STRING, PIECES]}, scope="tokenize", note="text, or text and token ids mixed"),
    _f("add_special", BOOL, scope="tokenize"),
    _noop("parse_special", BOOL, "special tokens in the text are always parsed", scope="tokenize"),
    _f("with_pieces", BOOL, scope="tokenize"),
    _f("tokens", {"type": "array", "items": TOKEN_ID}, scope="detokenize"),
    _f("input", {"anyOf": [STRING, PIECES, {"type": "array", "items": {"anyOf": [STRING, PIECES, PROMPT_OBJECT]}}]}, scope="embeddings",
       note="/completion's prompt shapes; an array of strings (or of token arrays) is one input each, embedded in one request"),
    _f("content", {"anyOf": [STRING, PIECES, {"type": "array", "items": {"anyOf": [STRING, PIECES, PROMPT_OBJECT]}}]}, scope="embeddings",
       note="as input, and the answer takes the native shape even on /v1/embeddings"),
    _f("encoding_format", {"enum": ["float", "base64"]}, scope="embeddings", note="base64: little-endian float32 bytes"),
    _f("embd_normalize", int_range(-1), scope="embeddings",
       note="-1 none, 0 max-abs int16, 1 taxicab, 2 euclidean (default: --embd-normalize), >2 p-norm; pooled vectors only"),
    _noop("model", STRING, "the OpenAI answer echoes it; the served model embeds", scope="embeddings"),
    _f("query", STRING, scope="rerank", required=True),
    _f("documents", {"type": "array", "items": STRING, "minItems": 1}, scope="rerank", note="Jina shape; or texts"),
    _f("texts", {"type": "array", "items": STRING, "minItems": 1}, scope="rerank", note="TEI shape: the answer is a bare array"),
    _f("top_n", int_range(0), scope="rerank", note="default: every document"),
    _f("return_text", BOOL, scope="rerank", note="TEI shape only"),
    _noop("model", STRING, "the answer echoes it; the served model scores", scope="rerank"),
    _f("instances", {"type": "array", "maxItems": 128,
                     "items": {"type": "object", "properties": {"@requestFormat": STRING}, "required": ["@requestFormat"]}},
       scope="vertex", required=True,
       note="each instance is a route's body plus @requestFormat (its path, or chatCompletions-style name); at most 128"),
    # Anthropic Messages (/v1/messages, /v1/messages/count_tokens), translated into a chat body.
    _f("messages", {"type": "array", "items": ANTHROPIC_MESSAGE}, scope="messages", required=True,
       note="user and assistant turns, string or block content"),
    _f("system", {"anyOf": [STRING, {"type": "array", "items": TEXT_PART}]}, scope="messages", note="string or text blocks"),
    _f("cache_explain", BOOL, scope="messages", origin="mlxcel",
       note="cache_explain in the message (and in the stream's message_delta): why the prompt cache reused what it did"),
    RequestField("messages[].content[].type", scope="messages",
       note="text, tool_use, tool_result (string, text or image blocks, is_error), thinking; image blocks (base64) are "
            "served by a vision-language model (docs/vision.md), a text model's 500 'image input is not supported'; document blocks are a 400"),
    _f("tools", {"type": "array", "items": ANTHROPIC_TOOL}, scope="messages"),
    RequestField("tools[].input_schema", scope="messages", note="client tools; server tool types are a 400"),
    _f("tool_choice.type", {"enum": ["auto", "any", "tool", "none"]}, scope="messages",
       note="auto, any (= required), tool + name, none; disable_parallel_tool_use; any and named tools are grammar-constrained (docs/structured-output.md)"),
    _f("stop_sequences", STOP_STRINGS, scope="messages"),
    _f("max_tokens", int_range(1), scope="messages", note="defaults to 4096 when absent, as llama-server"),
    _f("stream", BOOL, scope="messages"),
    _f("temperature", NUMBER, scope="messages"),
    _f("top_p", NUMBER, scope="messages"),
    _f("top_k", INTEGER, scope="messages"),
    _f("thinking", {"type": "object", "properties": {"type": {"enum": ["enabled", "adaptive", "between_tools", "disabled"]}, "budget_tokens": int_range(1)},
                    "required": ["type"]},
       scope="messages",
       note="enabled/adaptive/between_tools/disabled switch the template's enable_thinking; budget_tokens is the reasoning budget (thinking_budget_tokens)"),
    _f("metadata.user_id", STRING, scope="messages", note="the prompt cache's session"),
    _f("cache_control", {"type": "object", "properties": {"type": {"const": "ephemeral"}, "ttl": {"enum": ["5m", "1h"]}}, "required": ["type"]},
       scope="messages", origin="mlxcel",
       note="on a block, a tool_use/tool_result, a tool, or top level (last block): an explicit cache breakpoint pinned in the prompt cache "
            "(dense-KV models); ttl 5m or 1h; also read on chat content parts, messages and tools"),
    _f("output_config.format", OBJECT, scope="messages", note="json_schema output, constrained through response_format (docs/structured-output.md)"),
    # OpenAI Responses (/v1/responses, /responses, input_tokens), translated into a chat body.
    _f("input", {"anyOf": [STRING, {"type": "array", "items": OBJECT}]}, scope="responses",
       note="string or items: messages (input_text, output_text), function_call, function_call_output, reasoning; input_image "
            "(also in a function_call_output) served by a vision-language model (docs/vision.md), a text model's 500 'image input "
            "is not supported'; input_file its 400"),
    _f("instructions", STRING, scope="responses"),
    RequestField("tools[].type", scope="responses", note="function tools; other types are skipped with a warning"),
    _f("max_output_tokens", int_range(1), scope="responses",
       note="a reply it cuts is still status 'completed' and its stream ends with response.completed, as llama-server's"),
    _f("stream", BOOL, scope="responses"),
    _f("temperature", NUMBER, scope="responses"),
    _f("top_p", NUMBER, scope="responses"),
    _f("reasoning.effort", STRING, scope="responses", note="as reasoning_effort on chat: none turns thinking off"),
    _f("text.format", OBJECT, scope="responses", note="json_schema / json_object, constrained through response_format (docs/structured-output.md)"),
    _f("tier", {"enum": ["ram", "disk", "all"]}, scope="cache_reset", origin="mlxcel", note="which tier to clear; all when absent"),
    _f("conversation_ids", {"type": "array", "items": STRING}, scope="streams_lookup",
       note="the X-Conversation-Id values whose resumable streams to describe; an id also matches its id::model variants; "
            "ids that are not non-empty strings are skipped"),
    _f("id", STRING, scope="control", required=True, note="the id streamed back by /v1/chat/completions (chatcmpl-...)"),
    _f("action", {"enum": ["reasoning_end"]}, scope="control", required=True,
       note="reasoning_end: close the reasoning block now (needs reasoning_control: true on the completion)"),
    _f("model", STRING, scope="control", note="router mode only in llama-server; ignored here (one model)"),
    _f("filename", STRING, scope="slots", note="save and restore: a file name inside --slot-save-path (no path separator, no ..)"),
    RequestField("previous_response_id", STRING, scope="responses", status="unsupported", note="400: nothing is stored (llama-server does the same)"),
)



def bounds(settings: Any, n_parallel: int, n_vocab: int) -> dict[str, int]:
    """The values of the ``"$name"`` placeholders for one server."""
    return {
        "n_vocab_max": n_vocab - 1,
        "n_parallel": n_parallel,
        "n_probs_max": settings.n_probs_max,
        "max_prompts": settings.max_prompts,
        "max_stop_strings": settings.max_stop_strings,
        "max_stop_chars": settings.max_stop_chars,
        "max_logit_bias": settings.max_logit_bias,
        "max_samplers": settings.max_samplers,
    }


def resolve(schema: Any, values: Mapping[str, int]) -> Any:
    """``schema`` with every ``"$name"`` string replaced by its bound."""
    if isinstance(schema, str) and schema.startswith("$"):
        return values[schema[1:]]
    if isinstance(schema, dict):
        return {k: resolve(v, values) for k, v in schema.items()}
    if isinstance(schema, list):
        return [resolve(v, values) for v in schema]
    return schema


def manifest_entries() -> list[dict[str, Any]]:
    """The manifest's ``request_fields`` section."""
    return [
        {"field": f.field, "aliases": list(f.aliases), "scope": f.scope, "status": f.status, "origin": f.origin, "note": f.note}
        for f in REQUEST_FIELDS
    ]


def _check_table() -> None:
    names = [(f.field, f.scope) for f in REQUEST_FIELDS]
    assert len(names) == len(set(names)), "duplicate request field in a scope"
    for f in REQUEST_FIELDS:
        assert f.scope in SCOPES and f.status in ("supported", "partial", "noop", "unsupported"), f.field
        assert f.status == "supported" or f.note, f"{f.field}: a field that is not fully supported needs a note"


_check_table()
