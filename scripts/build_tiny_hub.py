"""Write a tiny random-init Hub VLM checkpoint (model + image processor + tokenizer + chat template), offline.

    python scripts/build_tiny_hub.py FAMILY OUT_DIR [--seed N] [--text KEY=VALUE ...] [--vision KEY=VALUE ...]

FAMILY is a vlmtrain Hub family (qwen3_vl, qwen2_5_vl, idefics3, llava_onevision, gemma3); OUT_DIR is then a
`model.pretrained` for `model.kind: hub_vlm`. --text / --vision override keys of the family's tiny text /
vision config (values parsed as YAML: `--text hidden_size=128 num_hidden_layers=3`); keep them consistent
(e.g. Qwen3-VL's vision out_hidden_size must equal the text hidden_size). Example (the score-heads proof):

    python scripts/build_tiny_hub.py qwen3_vl runs/tiny-qwen3vl
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

import yaml


def _pairs(items: list[str], flag: str) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} {item!r}: expected KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def build(family: str, out_dir: str, seed: int = 0, text: dict[str, Any] | None = None,
          vision: dict[str, Any] | None = None) -> str:
    """Build the family's tiny checkpoint in out_dir (its build_tiny), with text/vision config overrides."""
    from vlmtrain.models.families import REGISTRY, get_family

    record = get_family(family)
    if not (text or vision):
        return record.build_tiny(out_dir, seed=seed)
    module = importlib.import_module(REGISTRY[family])
    original = getattr(module, "tiny_config", None)
    if original is None:
        raise SystemExit(f"family {family!r} has no tiny_config(): --text / --vision are not supported for it")

    def tiny_config(**overrides: Any) -> Any:
        config = original(**overrides)
        values = config.to_dict()
        for section, changes in (("text_config", text), ("vision_config", vision)):
            unknown = sorted(set(changes or {}) - set(values[section]))
            if unknown:
                raise SystemExit(f"--{section.split('_')[0]}: unknown key(s) {unknown} for {type(config).__name__}")
            if "num_hidden_layers" in (changes or {}) and "layer_types" not in (changes or {}):
                values[section].pop("layer_types", None)  # one per layer: the config derives it again
            values[section].update(changes or {})
        return type(config)(**values)

    module.tiny_config = tiny_config  # build_tiny looks tiny_config up in its module when called
    try:
        return record.build_tiny(out_dir, seed=seed)
    finally:
        module.tiny_config = original


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init")
    parser.add_argument("--text", nargs="*", default=[], metavar="KEY=VALUE", help="text config overrides")
    parser.add_argument("--vision", nargs="*", default=[], metavar="KEY=VALUE", help="vision config overrides")
    args = parser.parse_args(argv)
    path = build(args.family, args.out_dir, args.seed, _pairs(args.text, "--text"), _pairs(args.vision, "--vision"))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
