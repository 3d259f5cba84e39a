"""The synthetic presets' chat template (written into their tokenizer_config.json by synth.py).

ChatML, like Qwen's (Qwen2.5/Qwen3): tools as a system turn listing their JSON schemas with Qwen's
instructions (the system message, if first, merged into it); an assistant's tool calls as
`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` (what `--tool-call-parser hermes`
reads back); consecutive tool results as one user turn of `<tool_response>` blocks; Qwen3's
`enable_thinking=False` as an empty think block after the generation prompt (what vLLM users pass
in `chat_template_kwargs`). Without tools, tool calls or tool results it renders exactly as
SYNTH_VERSION 2's template did.
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "{{- messages[0]['content'] + '\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}\n"
    "{%- for tool in tools %}\n"
    "{{- '\\n' + (tool | tojson) }}\n"
    "{%- endfor %}\n"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if tools and loop.first and message['role'] == 'system' %}\n"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}\n"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}\n"
    "{%- for call in message['tool_calls'] %}\n"
    "{%- if (loop.first and message['content']) or not loop.first %}{{- '\\n' }}{%- endif %}\n"
    "{%- set fn = call['function'] if call['function'] is defined else call %}\n"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}\n"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}\n"
    "{{- '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message['role'] == 'tool' %}\n"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- else %}\n"
    "{%- for part in message['content'] %}\n"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)


__all__ = ["CHAT_TEMPLATE"]
