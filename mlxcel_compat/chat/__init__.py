"""Chat templates and chat-request handling for the chat routes.

``template`` compiles and renders sandboxed Jinja chat templates (HF semantics; the environment in
``sandbox``, the inputs shaped in ``template_inputs``) and detects their capabilities
(``template_caps``); ``builtin_templates`` renders llama.cpp's C++ formats by name. ``request``
validates OpenAI chat bodies llama-server style and ``render`` renders the final prompt;
``reasoning``, ``tool_calls`` and ``stream_splitter`` parse reasoning and tool calls out of
generations, and ``tool_grammar`` forces well-formed calls.
"""
