"""Gemma 3's chat template (gemma-3-it's) and its training variant.

The template starts with ``{{ bos_token }}``, and the processor then tokenizes without special tokens, so there
is exactly one BOS. The generation prompt is ``<start_of_turn>model\\n``; the training template marks the reply
and its ``<end_of_turn>`` (not the newline after it).
"""

# google/gemma-3-4b-it's chat template (tokenizer_config.json), byte for byte.
_HEAD = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
)
_CONTENT = (
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
)
_TAIL = (
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
CHAT_TEMPLATE = _HEAD + _CONTENT + "    {{ '<end_of_turn>\n' }}\n" + _TAIL

# The model's turns: content and <end_of_turn> inside generation markers, the newline after them outside. The
# markers touch no whitespace, so removing them (the load-time check) leaves the same whitespace control.
TRAINING_TEMPLATE = (
    _HEAD
    + "    {%- if role == 'model' -%}{% generation %}\n"
    + _CONTENT
    + "    {{ '<end_of_turn>' }}{% endgeneration %}{{ '\n' }}\n"
    + "    {%- else -%}\n"
    + _CONTENT
    + "    {{ '<end_of_turn>\n' }}\n"
    + "    {%- endif -%}\n"
    + _TAIL
)
