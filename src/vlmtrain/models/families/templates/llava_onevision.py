"""LLaVA-OneVision's chat template (llava-hf's) and its training variant.

llava-hf's ChatML variant: ``<|im_start|>role `` then images, then ``\\n`` + each text. Its assistant text
already sits in generation markers, but its ``<|im_end|>`` does not; the training template marks the reply text
and ``<|im_end|>`` (not the ``\\n`` before the text: the generation prompt ``<|im_start|>assistant\\n``
already ends with it). Its user turns render their content blocks in order, so images placed by ``<image>``
placeholders stay where the text put them (the checkpoint's template would move a turn's images to its start);
with images first the two render the same.
"""

# llava-hf/llava-onevision-qwen2-0.5b-ov-hf chat_template.json, byte for byte.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\\n' + content['text'] }}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}{{'<|im_end|>'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# User turns render their blocks in order (the checkpoint's puts a turn's images first): the same text when the
# images come first, and each image where its <image> placeholder stood otherwise; only the first text block
# gets the checkpoint's newline prefix.
TRAINING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{% if message['role'] != 'assistant' %}{% set text = namespace(first=true) %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<image>' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>' }}"
    "{% elif content['type'] == 'text' %}{% if text.first %}{{ '\\n' }}{% set text.first = false %}{% endif %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{{'<|im_end|>'}}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\\n' }}{% generation %}{{ content['text'] }}{% endgeneration %}{% endfor %}"
    "{% generation %}{{'<|im_end|>'}}{% endgeneration %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
