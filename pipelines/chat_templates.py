"""The chat template of the Qwen2 / Qwen2.5 family (ChatML with Hermes-style function
calling), for the tiny thinkers: the tools are offered in the system turn inside
`<tools></tools>`, the model answers a call as `<tool_call>{"name", "arguments"}</tool_call>`
(what vLLM's `hermes` parser reads), and results come back in a user turn as
`<tool_response>` blocks. `multimodal` adds the Omni families' content parts (audio, image
and video parts as their placeholder spans).
"""

from __future__ import annotations

TOOL_TOKENS = ("<tool_call>", "</tool_call>")  # added tokens of the family's vocabulary (not special)

_TOOLS_PREAMBLE = (
    "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FORMAT = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call>"
)

# each modality's placeholder span, per family
OMNI25_SPANS = {"image": "<|vision_bos|><|IMAGE|><|vision_eos|>", "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
                "video": "<|vision_bos|><|VIDEO|><|vision_eos|>"}
OMNI3_SPANS = {"image": "<|vision_start|><|image_pad|><|vision_end|>", "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
               "video": "<|vision_start|><|video_pad|><|vision_end|>"}


def _parts(spans: dict[str, str]) -> str:
    return (
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    + spans["image"] +
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}"
    + spans["audio"] +
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    + spans["video"] +
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}"
    )


def qwen_chat_template(default_system: str | None, multimodal: bool, spans: dict[str, str] = OMNI25_SPANS) -> str:
    """The template; `default_system`: the system turn a conversation without one gets
    (None: none, unless tools are offered); `spans`: the multimodal parts' placeholders."""
    content = (
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}" + _parts(spans) + "{% endif %}"
        if multimodal
        else "{{ message['content'] or '' }}"
    )
    system = default_system or ""
    head = (
        "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
        "{% set video_count = namespace(value=0) %}"
        "{% set first_system = messages and messages[0]['role'] == 'system' %}"
        "{% if tools %}<|im_start|>system\n"
        "{% if first_system %}{{ messages[0]['content'] }}{% else %}" + system + "{% endif %}"
        "{{ '" + _TOOLS_PREAMBLE + "' }}"
        "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
        "{{ '" + _TOOLS_FORMAT + "' }}<|im_end|>\n"
    )
    head += "{% elif not first_system %}<|im_start|>system\n" + system + "<|im_end|>\n{% endif %}" if default_system else "{% endif %}"
    body = (
        "{% for message in messages %}"
        "{% if tools and loop.first and message['role'] == 'system' %}"  # already in the tools turn
        "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
        "<|im_start|>assistant{% if message['content'] %}\n{{ message['content'] }}{% endif %}"
        "{% for call in message['tool_calls'] %}{% set fn = call['function'] if call['function'] is defined else call %}"
        '\n<tool_call>\n{"name": "{{ fn[\'name\'] }}", "arguments": '
        "{% if fn['arguments'] is string %}{{ fn['arguments'] }}{% else %}{{ fn['arguments'] | tojson }}{% endif %}"
        "}\n</tool_call>{% endfor %}<|im_end|>\n"
        "{% elif message['role'] == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
        "\n<tool_response>\n{{ message['content'] }}\n</tool_response>"
        "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
        "{% else %}<|im_start|>{{ message['role'] }}\n" + content + "<|im_end|>\n{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return head + body
