"""llama.cpp's built-in chat templates render what llm_chat_apply_template renders.

The expected strings were written from reading llama.cpp's src/llama-chat.cpp: one fixed
conversation (system, user, assistant, tool, user) through every built-in name.
"""

from __future__ import annotations

import pytest

from mlxcel_compat.chat import builtin_templates
from mlxcel_compat.chat.builtin_templates import BUILTIN_TEMPLATE_NAMES, BuiltinTemplate, detect, render
from mlxcel_compat.compat import load_manifest

CONVERSATION = [
    {"role": "system", "content": "You are a bot."},
    {"role": "user", "content": " Hello "},
    {"role": "assistant", "content": "Hi there"},
    {"role": "tool", "content": "42"},
    {"role": "user", "content": "Why?"},
]

EXPECTED = {
    "bailing": "<role>SYSTEM</role>You are a bot.<role>HUMAN</role> Hello <role>ASSISTANT</role>Hi there<role>TOOL</role>42<role>HUMAN</role>Why?<role>ASSISTANT</role>",
    "chatglm3": "[gMASK]sop<|system|>\n You are a bot.<|user|>\n  Hello <|assistant|>\n Hi there<|tool|>\n 42<|user|>\n Why?<|assistant|>",
    "chatglm4": "[gMASK]<sop><|system|>\nYou are a bot.<|user|>\n Hello <|assistant|>\nHi there<|tool|>\n42<|user|>\nWhy?<|assistant|>\n",
    "chatml": "<|im_start|>system\nYou are a bot.<|im_end|>\n<|im_start|>user\n Hello <|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a bot.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Why?<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "deepseek": "You are a bot.### Instruction:\n Hello \n### Response:\nHi there\n<|EOT|>\n### Instruction:\nWhy?\n### Response:\n",
    "deepseek2": "You are a bot.\n\nUser:  Hello \n\nAssistant: Hi there<｜end▁of▁sentence｜>User: Why?\n\nAssistant:",
    "deepseek3": "You are a bot.\n\n<｜User｜> Hello <｜Assistant｜>Hi there<｜end▁of▁sentence｜><｜User｜>Why?<｜Assistant｜>",
    "exaone3": "[|system|]You are a bot.[|endofturn|]\n[|user|]Hello\n[|assistant|]Hi there[|endofturn|]\n[|user|]Why?\n[|assistant|]",
    "exaone4": "[|system|]You are a bot.[|endofturn|]\n[|user|]Hello\n[|assistant|]Hi there[|endofturn|]\n[|tool|]42[|endofturn|]\n[|user|]Why?\n[|assistant|]",
    "falcon3": "<|system|>\nYou are a bot.\n<|user|>\n Hello \n<|assistant|>\nHi there\n<|tool|>\n42\n<|user|>\nWhy?\n<|assistant|>\n",
    "gemma": "<start_of_turn>user\nYou are a bot.\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>tool\n42<end_of_turn>\n<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n",
    "gigachat": "<s>You are a bot.<|message_sep|>user<|role_sep|> Hello <|message_sep|>available functions<|role_sep|>[]<|message_sep|>assistant<|role_sep|>Hi there<|message_sep|>user<|role_sep|>Why?<|message_sep|>available functions<|role_sep|>[]<|message_sep|>assistant<|role_sep|>",
    "glmedge": "<|system|>\nYou are a bot.<|user|>\n Hello <|assistant|>\nHi there<|tool|>\n42<|user|>\nWhy?<|assistant|>",
    "gpt-oss": "<|start|>system<|message|>You are a bot.<|end|><|start|>user<|message|> Hello <|end|><|start|>assistant<|message|>Hi there<|return|><|start|>tool<|message|>42<|end|><|start|>user<|message|>Why?<|end|><|start|>assistant",
    "granite": "<|start_of_role|>system<|end_of_role|>You are a bot.<|end_of_text|>\n<|start_of_role|>user<|end_of_role|> Hello <|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Hi there<|end_of_text|>\n<|start_of_role|>tool<|end_of_role|>42<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Why?<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>\n",
    "hunyuan-dense": "You are a bot.<｜hy_place▁holder▁no▁3｜><｜hy_User｜> Hello <｜hy_Assistant｜><｜hy_Assistant｜>Hi there<｜hy_place▁holder▁no▁2｜><｜hy_User｜>Why?<｜hy_Assistant｜>",
    "hunyuan-moe": "<|startoftext|>You are a bot.<|extra_4|><|startoftext|> Hello <|extra_0|>Hi there<|eos|><|startoftext|>42<|extra_0|><|startoftext|>Why?<|extra_0|>",
    "kimi-k2": "<|im_system|>system<|im_middle|>You are a bot.<|im_end|><|im_user|>user<|im_middle|> Hello <|im_end|><|im_assistant|>assistant<|im_middle|>Hi there<|im_end|><|im_system|>tool<|im_middle|>42<|im_end|><|im_user|>user<|im_middle|>Why?<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "llama2": "[INST] You are a bot.\n Hello  [/INST]Hi there</s>[INST] 42</s>[INST] Why? [/INST]",
    "llama2-sys": "[INST] <<SYS>>\nYou are a bot.\n<</SYS>>\n\n Hello  [/INST]Hi there</s>[INST] 42</s>[INST] Why? [/INST]",
    "llama2-sys-bos": "[INST] <<SYS>>\nYou are a bot.\n<</SYS>>\n\n Hello  [/INST]Hi there</s><s>[INST] 42</s><s>[INST] Why? [/INST]",
    "llama2-sys-strip": "[INST] <<SYS>>\nYou are a bot.\n<</SYS>>\n\nHello [/INST]Hi there</s>[INST] 42</s>[INST] Why? [/INST]",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a bot.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>tool<|end_header_id|>\n\n42<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhy?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama4": "<|header_start|>system<|header_end|>\n\nYou are a bot.<|eot|><|header_start|>user<|header_end|>\n\nHello<|eot|><|header_start|>assistant<|header_end|>\n\nHi there<|eot|><|header_start|>tool<|header_end|>\n\n42<|eot|><|header_start|>user<|header_end|>\n\nWhy?<|eot|><|header_start|>assistant<|header_end|>\n\n",
    "megrez": "<|role_start|>system<|role_end|>You are a bot.<|turn_end|><|role_start|>user<|role_end|> Hello <|turn_end|><|role_start|>assistant<|role_end|>Hi there<|turn_end|><|role_start|>tool<|role_end|>42<|turn_end|><|role_start|>user<|role_end|>Why?<|turn_end|><|role_start|>assistant<|role_end|>",
    "minicpm": "You are a bot.<用户>Hello<AI>Hi there42<用户>Why?<AI>",
    "mistral-v1": " [INST] You are a bot.\n\n Hello  [/INST] Hi there</s> [INST]  42</s> [INST] Why? [/INST]",
    "mistral-v3": "[INST] You are a bot.\n\n Hello [/INST] Hi there</s>[INST]  42</s>[INST] Why?[/INST]",
    "mistral-v3-tekken": "[INST]You are a bot.\n\n Hello [/INST]Hi there</s>[INST]42</s>[INST]Why?[/INST]",
    "mistral-v7": "[SYSTEM_PROMPT] You are a bot.[/SYSTEM_PROMPT][INST]  Hello [/INST] Hi there</s> 42</s>[INST] Why?[/INST]",
    "mistral-v7-tekken": "[SYSTEM_PROMPT]You are a bot.[/SYSTEM_PROMPT][INST] Hello [/INST]Hi there</s>42</s>[INST]Why?[/INST]",
    "monarch": "system\nYou are a bot.</s>\n<s>user\n Hello </s>\n<s>assistant\nHi there</s>\n<s>tool\n42</s>\n<s>user\nWhy?</s>\n<s>assistant\n",
    "openchat": "You are a bot.<|end_of_turn|>GPT4 Correct User:  Hello <|end_of_turn|>GPT4 Correct Assistant: Hi there<|end_of_turn|>GPT4 Correct Tool: 42<|end_of_turn|>GPT4 Correct User: Why?<|end_of_turn|>GPT4 Correct Assistant:",
    "orion": "Human: You are a bot.\n\n Hello \n\nAssistant: </s>Hi there</s>42</s>Human: Why?\n\nAssistant: </s>",
    "phi3": "<|system|>\nYou are a bot.<|end|>\n<|user|>\n Hello <|end|>\n<|assistant|>\nHi there<|end|>\n<|tool|>\n42<|end|>\n<|user|>\nWhy?<|end|>\n<|assistant|>\n",
    "phi4": "<|im_start|>system<|im_sep|>You are a bot.<|im_end|><|im_start|>user<|im_sep|> Hello <|im_end|><|im_start|>assistant<|im_sep|>Hi there<|im_end|><|im_start|>tool<|im_sep|>42<|im_end|><|im_start|>user<|im_sep|>Why?<|im_end|><|im_start|>assistant<|im_sep|>",
    "rwkv-world": "System: You are a bot.\n\nUser: Hello\n\nAssistant: Hi there\n\nUser: Why?\n\nAssistant:",
    "seed_oss": "<seed:bos>system\nYou are a bot.<seed:eos><seed:bos>user\n Hello <seed:eos><seed:bos>assistant\nHi there<seed:eos><seed:bos>tool\n42<seed:eos><seed:bos>user\nWhy?<seed:eos><seed:bos>assistant\n",
    "smolvlm": "<|im_start|>You are a bot.\n\nUser:  Hello <end_of_utterance>\nAssistant: Hi there<end_of_utterance>\nAssistant: 42<end_of_utterance>\nUser: Why?<end_of_utterance>\nAssistant:",
    "vicuna": "You are a bot.\n\nUSER:  Hello \nASSISTANT: Hi there</s>\nUSER: Why?\nASSISTANT:",
    "vicuna-orca": "SYSTEM: You are a bot.\nUSER:  Hello \nASSISTANT: Hi there</s>\nUSER: Why?\nASSISTANT:",
    "yandex": " Пользователь:  Hello \n\n Ассистент: Hi there\n\n Пользователь: Why?\n\n Ассистент:[SEP]",
    "zephyr": "<|system|>\nYou are a bot.<|endoftext|>\n<|user|>\n Hello <|endoftext|>\n<|assistant|>\nHi there<|endoftext|>\n<|tool|>\n42<|endoftext|>\n<|user|>\nWhy?<|endoftext|>\n<|assistant|>\n",
}


def test_every_name_has_an_expected_rendering() -> None:
    assert sorted(EXPECTED) == list(BUILTIN_TEMPLATE_NAMES)


@pytest.mark.parametrize("name", BUILTIN_TEMPLATE_NAMES)
def test_builtin_template_renders_as_llama_cpp(name: str) -> None:
    assert render(name, CONVERSATION) == EXPECTED[name]


@pytest.mark.parametrize("name", ["chatml", "llama3", "gemma", "phi3", "kimi-k2"])
def test_without_generation_prompt(name: str) -> None:
    with_prompt = render(name, CONVERSATION, add_generation_prompt=True)
    without = render(name, CONVERSATION, add_generation_prompt=False)
    assert with_prompt.startswith(without) and with_prompt != without


def test_mistral_v7_has_no_generation_prompt() -> None:
    assert render("mistral-v7", CONVERSATION, True) == render("mistral-v7", CONVERSATION, False)


def test_typed_content_parts_join_with_a_newline() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert render("chatml", [{"role": "user", "content": parts}], False) == "<|im_start|>user\na\nb<|im_end|>\n"


def test_template_object_continue_final_message_and_caps() -> None:
    tpl = BuiltinTemplate("command-r")
    text = tpl.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure,"}],
                      add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|CHATBOT_TOKEN|>Sure,")
    assert tpl.caps()["supports_system_role"] is True
    assert BuiltinTemplate("yandex").caps()["supports_system_role"] is False  # yandex drops system text
    with pytest.raises(KeyError):
        BuiltinTemplate("not-a-template")


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", "chatml"),
        ("<|im_start|>x<|im_sep|>", "phi4"),
        ("{{ '[SYSTEM_PROMPT]' }}[INST]", "mistral-v7"),
        ("[INST] <<SYS>> content.strip()", "llama2-sys-strip"),
        ("<|start_header_id|>x<|end_header_id|>", "llama3"),
        ("<start_of_turn>", "gemma"),
        ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "command-r"),
        ("<seed:bos>", "seed_oss"),
        ("command-r", "command-r"),
        ("{{ nothing known }}", None),
    ],
)
def test_detect_picks_the_name_llama_cpp_picks(source: str, name: str | None) -> None:
    assert detect(source) == name


def test_names_are_listed_in_the_manifest() -> None:
    manifest = load_manifest()
    assert manifest["builtin_chat_templates"] == list(builtin_templates.BUILTIN_TEMPLATE_NAMES)
