"""Qwen2.5-VL's chat template (as the Hub checkpoints ship it) and its training variant."""

_PRE = ("{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
        "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n")
_CONTENT_LIST = (
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
)
_POST = "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"

# Qwen2.5-VL-Instruct's chat template (chat_template.json of the Hub checkpoints; Qwen2-VL's too).
CHAT_TEMPLATE = (_PRE + "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
                 + _CONTENT_LIST + "<|im_end|>\n{% endif %}" + _POST)
"""The checkpoint's own template (what build_tiny saves)."""

_CONTENT = "{% if message['content'] is string %}{{ message['content'] }}{% else %}" + _CONTENT_LIST + "{% endif %}"
# trim_blocks drops a newline right after a block tag, so the newline after {% endgeneration %} is an expression.
TRAINING_TEMPLATE = (_PRE + "{% if message['role'] == 'assistant' %}{% generation %}" + _CONTENT
                     + "<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}" + _CONTENT + "<|im_end|>{{ '\\n' }}"
                     + "{% endif %}" + _POST)
"""CHAT_TEMPLATE with each assistant reply and its <|im_end|> inside {% generation %}."""
