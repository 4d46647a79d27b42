"""SmolVLM's chat templates (SmolVLM-Instruct's, SmolVLM2's) and the training variant."""

# SmolVLM-Instruct's chat template (chat_template.json), byte for byte.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# The same, with the assistant's reply after 'Assistant:' and its <end_of_utterance> in generation markers.
TRAINING_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['role'] == 'assistant' %}{{':'}}{% generation %}"
    "{% if message['content'][0]['type'] != 'image' %}{{' '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# SmolVLM2's (HuggingFaceTB/SmolVLM2-*-Instruct): the same plus a video branch.
SMOLVLM2_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}",
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}")
