"""The ``/apply-template`` bodies that llama-server and this server are compared on.

``scripts/check_apply_template.py`` posts each body (with ``add_generation_prompt`` true and false)
to both servers for every llama.cpp template; ``test_render_pins.py`` renders the cases pinned in
``apply_template_pins.json`` (llama-server's prompts, written by that script) without a server.
"""

from __future__ import annotations

from typing import Any

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city's name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
# Nine alphanumeric characters: Mistral's templates refuse any other id.
CALL_IDS = ("call00001", "call00002", "call00003")

PLAIN = [
    SYSTEM,
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi! How can I help you today?"},
    {"role": "user", "content": "What is 2 + 2?"},
]
HISTORY = [
    SYSTEM,
    {"role": "user", "content": "What is the weather in Paris, and in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_IDS[0], "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": CALL_IDS[0], "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": CALL_IDS[1], "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "unit": "celsius"}'}},
        {"id": CALL_IDS[2], "type": "function",
         "function": {"name": "search_web", "arguments": '{"query": "Tokyo weather tomorrow"}'}}]},
    {"role": "tool", "tool_call_id": CALL_IDS[1], "content": '{"temperature": 18, "sky": "rain"}'},
    {"role": "tool", "tool_call_id": CALL_IDS[2], "name": "search_web", "content": "Rain all week."},
    {"role": "assistant", "content": "Paris: 21°C and clear. Tokyo: 18°C and rain, all week."},
    {"role": "user", "content": "Thanks! And Berlin?"},
]
# One call a turn: Llama 3.x refuses two calls in one message.
HISTORY_SINGLE = [
    {"role": "user", "content": "What is the weather in Paris, and in Tokyo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": CALL_IDS[0], "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": CALL_IDS[0], "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_IDS[1], "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": CALL_IDS[1], "name": "get_weather", "content": "18 degrees, rain"},
    {"role": "assistant", "content": "Paris: 21°C and clear. Tokyo: 18°C and rain."},
    {"role": "user", "content": "Thanks!"},
]
PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
    {"role": "user", "content": [{"type": "text", "text": "Hello!"}, {"type": "text", "text": "What is 2 + 2?"}]},
]
REASONING = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "reasoning_content": "The user greets me; greet back.", "content": "Hi! How can I help?"},
    {"role": "user", "content": "What is 2 + 2?"},
]
REASONING_CALL = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "reasoning_content": "I should call the weather tool.", "content": "", "tool_calls": [
        {"id": CALL_IDS[0], "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": CALL_IDS[0], "content": '{"temperature": 21}'},
    {"role": "assistant", "reasoning_content": "The tool answered.", "content": "It is 21°C in Paris."},
    {"role": "user", "content": "Thanks!"},
]
# Two calls answered out of order (DeepSeek V4 puts results back in the calls' order).
HISTORY_REORDERED = [
    {"role": "user", "content": "What is the weather in Paris, and in Tokyo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": CALL_IDS[0], "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": CALL_IDS[1], "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": CALL_IDS[1], "content": "18 degrees, rain"},
    {"role": "tool", "tool_call_id": CALL_IDS[0], "content": "21 degrees, clear"},
]
# An agent's loop in progress: the reasoned call of this turn and its result, no user turn after.
REASONING_LOOP = REASONING_CALL[:3]

# A trailing assistant message: the server continues it (llama-server's --prefill-assistant).
PREFILL = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "The answer is"},
]

# body name -> (table column, body without add_generation_prompt)
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("plain", {"messages": PLAIN}),
    "plain-parts": ("plain", {"messages": PARTS}),
    "tools": ("tools", {"messages": PLAIN, "tools": TOOLS}),
    "tools-choice-none": ("tools", {"messages": PLAIN, "tools": TOOLS, "tool_choice": "none"}),
    "tools-choice-required": ("tools", {"messages": PLAIN, "tools": TOOLS, "tool_choice": "required"}),
    "history": ("history", {"messages": HISTORY, "tools": TOOLS}),
    "history-single": ("history", {"messages": HISTORY_SINGLE, "tools": TOOLS}),
    "history-reordered": ("history", {"messages": HISTORY_REORDERED, "tools": TOOLS}),
    "reasoning": ("reasoning", {"messages": REASONING}),
    "reasoning-call": ("reasoning", {"messages": REASONING_CALL, "tools": TOOLS}),
    "reasoning-loop": ("reasoning", {"messages": REASONING_LOOP, "tools": TOOLS}),
    "reasoning-off": ("reasoning", {"messages": REASONING, "chat_template_kwargs": {"enable_thinking": False}}),
    "reasoning-effort": ("reasoning", {"messages": REASONING, "reasoning_effort": "high"}),
    "prefill": ("prefill", {"messages": PREFILL}),
}
# The columns the comparison must pass; "prefill" is reported beside them (docs/chat-templates.md
# says why it differs).
COLUMNS = ("plain", "tools", "history", "reasoning")
INFORMATIVE_COLUMNS = ("prefill",)

# What tests/chat/test_render_pins.py pins, per template (``--pin`` of the script writes
# llama-server's prompts for these): the representative families' tool histories, and a case for
# each of llama-server's changes to the messages (chat/message_fixes.py) and to the variables.
PINNED: dict[str, tuple[str, ...]] = {
    "meta-llama-Llama-3.1-8B-Instruct": ("history-single/gen",),
    "mistralai-Mistral-Nemo-Instruct-2407": ("history/gen",),
    "Qwen-Qwen3-0.6B": ("history/gen", "reasoning-call/gen"),
    "deepseek-ai-DeepSeek-V3.1": ("history/gen",),
    "openai-gpt-oss-120b": ("history/gen", "reasoning-loop/gen", "reasoning-call/nogen"),
    "GLM-4.6": ("history/gen",),
    "mistralai-Ministral-3-14B-Reasoning-2512": ("reasoning/gen",),
    "google-gemma-4-31B-it-interleaved": ("history-single/gen",),
    "Kimi-K2-Instruct": ("history/gen",),
    "deepseek-ai-DeepSeek-V4": ("history/gen", "history-reordered/gen"),
    "Apertus-8B-Instruct": ("plain/gen",),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("plain/gen",),
    "google-gemma-2-2b-it": ("plain/gen",),
    "meetkai-functionary-medium-v3.1": ("tools/gen",),
    "LFM2-8B-A1B": ("plain-parts/gen",),
}


def cases() -> list[tuple[str, dict[str, Any]]]:
    """Every ``(case, body)``: each body with ``add_generation_prompt`` true (``name/gen``) and false (``name/nogen``)."""
    return [(f"{name}/{agp}", case_body(f"{name}/{agp}")) for name in BODIES for agp in ("gen", "nogen")]


def case_body(case: str) -> dict[str, Any]:
    """The body of a case (``name/gen`` or ``name/nogen``)."""
    name, agp = case.split("/")
    return {**BODIES[name][1], "add_generation_prompt": agp == "gen"}
