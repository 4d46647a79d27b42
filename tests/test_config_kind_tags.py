"""A `data.*` key's "(kind, ...)" tag in --help and docs/configuration.md names the model kinds whose code reads
the key: each kind's build (model, processing, collator) and a batch of its samples run with the data section
recording which keys they read, and a tagged key read by a kind its tag leaves out fails here."""

from __future__ import annotations

import dataclasses
import re

import pytest

from vlmtrain.config import DataConfig, load_run_config
from vlmtrain.data.registry import get_source
from vlmtrain.models.kinds import KINDS, get_kind

FIELDS = {f.name for f in dataclasses.fields(DataConfig)}
READS: set[str] = set()


class _Recording(DataConfig):
    """The run's data section, noting each key read."""

    def __getattribute__(self, name: str):
        if name in FIELDS:
            READS.add(name)
        return super().__getattribute__(name)


def _tagged_kinds(doc: str) -> set[str] | None:
    """The kinds a docstring's leading "(...)" tag names; None without a kind tag."""
    m = re.match(r"\(([^)]*)\)", doc.strip())
    kinds = set(re.findall(r"\b(" + "|".join(KINDS) + r")\b", m.group(1))) if m else set()
    return kinds or None


CONFIGS = {  # one tiny run per kind, on the data source its demos use
    "causal_lm": {"model": {"kind": "causal_lm", "config": {
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}},
        "data": {"source": "addition", "num_train": 8, "num_eval": 4}},
    "vlm": {"model": {"kind": "vlm", "vision": {"model_type": "siglip_vision_model", "image_size": 32,
                                                 "patch_size": 8, "hidden_size": 32, "intermediate_size": 64,
                                                 "num_hidden_layers": 1, "num_attention_heads": 2},
                      "text": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 256}},
            "data": {"source": "shapes", "num_train": 8, "num_eval": 4, "max_length": 256}},
    "hub_vlm": {"model": {"kind": "hub_vlm"},
                "data": {"source": "shapes", "num_train": 8, "num_eval": 4, "max_length": 256}},
}


@pytest.fixture(scope="module")
def readers(tiny_hub, tmp_path_factory) -> dict[str, set[str]]:
    """data key -> the kinds whose build and batch processing read it."""
    import yaml

    out: dict[str, set[str]] = {}
    for name, run in CONFIGS.items():
        run = {**run, "train": {"output_dir": str(tmp_path_factory.mktemp(name)), "report_to": "none"}}
        if name == "hub_vlm":
            run["model"] = {**run["model"], "pretrained": tiny_hub("qwen3_vl")[1]}
        path = tmp_path_factory.mktemp("cfg") / f"{name}.yaml"
        path.write_text(yaml.safe_dump(run))
        cfg = load_run_config(path)
        data = get_source(cfg.data.source).build(cfg)  # (the source's own reads are not the kind's)
        READS.clear()
        cfg.data.__class__ = _Recording
        parts = get_kind(name).build(cfg, data, None)
        parts["data_collator"]([parts["train_dataset"][i] for i in range(2)])
        for key in READS:
            out.setdefault(key, set()).add(name)
    return out


def test_a_kind_tag_names_every_kind_that_reads_the_key(readers):
    docs = gen_docs()
    wrong = [f"data.{key}: tagged {sorted(tagged)}, read by {sorted(readers[key])}"
             for key, tagged in ((k, _tagged_kinds(d)) for k, d in docs.items())
             if tagged is not None and key in readers and not readers[key] <= tagged]
    assert len(readers) > 5, readers  # (the recording sees the kinds' reads)
    assert not wrong, "\n".join(wrong)


def gen_docs() -> dict[str, str]:
    """Each data key's docstring, as --help and docs/configuration.md show it."""
    from vlmtrain.config import build_parser

    parser = build_parser()
    return {a.dest.split(".", 1)[1]: a.help or "" for a in parser._actions
            if a.dest.startswith("data.") and a.dest.split(".", 1)[1] in FIELDS}
