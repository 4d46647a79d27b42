"""transformers-only arguments that transformers reads only while a feature is on (hub options without
push_to_hub, fsdp_config without fsdp, ...): accepted with the feature off, as transformers accepts them, their
value forms checked as transformers checks them; with the feature on, an error naming the setting."""

from __future__ import annotations

import pytest
import transformers

from vlmtrain import TrainingArguments
from vlmtrain.compat.arguments import REFUSED, WHEN_USED
from vlmtrain.errors import ConfigError

# name -> (a value transformers accepts, the arguments that turn its feature on)
CASES = {
    "hub_token": ("hf_x", {"push_to_hub": True}),
    "hub_private_repo": (True, {"push_to_hub": True}),
    "hub_model_id": ("me/model", {"push_to_hub": True}),
    "hub_strategy": ("end", {"push_to_hub": True}),
    "hub_always_push": (True, {"push_to_hub": True}),
    "hub_revision": ("dev", {"push_to_hub": True}),
    "trackio_static_space_id": ("me/space", {"report_to": "trackio"}),
    "fsdp_config": ({"min_num_params": 10}, {"fsdp": "full_shard auto_wrap"}),
    "eval_delay": (2.0, {"eval_strategy": "steps"}),
    "length_column_name": ("n_tokens", {"train_sampling_strategy": "group_by_length"}),
    "optim_args": ("momentum=0.9", {"optim": "sgd"}),
    "optim_target_modules": (["q_proj"], {"optim": "galore_adamw"}),
}


def _plain(value):
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return getattr(value, "value", value)


def test_every_name_used_only_with_a_feature_has_a_case():
    assert set(CASES) == set(WHEN_USED) and set(WHEN_USED) <= set(REFUSED)


@pytest.mark.parametrize("name", sorted(CASES))
def test_accepted_with_the_feature_off_as_transformers(name):
    value, _ = CASES[name]
    ours = TrainingArguments(**{name: value}, use_cpu=True)
    hf = transformers.TrainingArguments(**{name: value}, use_cpu=True)
    assert _plain(getattr(ours, name)) == _plain(getattr(hf, name))


@pytest.mark.parametrize("name", sorted(CASES))
def test_with_the_feature_on_an_error_names_the_setting(name):
    value, on = CASES[name]
    kwargs = {name: value, **on}
    with pytest.raises(ConfigError) as e:
        TrainingArguments(**kwargs)
    # the name itself, or (push_to_hub, which vlmtrain does not do) the feature that would read it
    bad = name if name in on or "push_to_hub" not in on else "push_to_hub"
    assert str(e.value).startswith(f"{bad}={kwargs[bad]!r} is not supported by vlmtrain; {REFUSED[bad]}")


@pytest.mark.parametrize("name,value", [("hub_strategy", "sometimes"), ("debug", "underflow tpu_metrics_debug")])
def test_a_value_transformers_refuses_at_construction_is_refused(name, value):
    with pytest.raises(ValueError):
        transformers.TrainingArguments(**{name: value}, use_cpu=True)
    with pytest.raises(ConfigError, match=f"^{name}="):
        TrainingArguments(**{name: value})
