"""Where a shapes-VQA checkpoint's decoder looks when it answers.

    python scripts/shapes_lookup.py runs/shapes-tiny/checkpoint-3200 [--samples 200] [--json]

For held-out single-image questions of each type that names an object (color: "What color is the
circle?", shape: "What shape is the red object?", position: "Relative to the square, is the circle left
or right?", side: "Is the circle left or right?"): how often the deciding answer token is right (greedy: the
first one; for side and position, answered "circle left", the side word), and, for every decoder layer and
head, where the position that predicts it attends: the image token(s) of the named object(s), the image
tokens of the other objects, the empty image tokens, and the text; of the text, the share on the word(s)
naming the object(s) and the text token that draws the most attention. A type the model answers by looking
the named object up has a head with most of its mass on it: in the demo, ~0.95 on the named shape for
colour and shape questions, 0.62 on the two named objects for relative position (at most 0.25 before the
demo's side-question warm-up, when position stayed at chance). A look-up needs the named word at the
answer position: with one-word side answers a layer-0 head had to bring it there by content, and where it
failed (on seeds 1-2 it put 0.97 of its attention on " left" in side and position questions, 0.67-0.93 on the
noun in colour questions) the look-up head never fired for that type; side and position answers now name the
object first, so the side word is predicted at the noun's own position.

Needs single-image scenes drawn on the shapes grid (one object per image token, as the demo has).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from functools import cache
from typing import Any

import torch
from transformers import AutoTokenizer

from vlmtrain.data.processing import VLMProcessor
from vlmtrain.data.vlm_collate import VLMCollator
from vlmtrain.models.own_vlm.vlm import VisionLanguageModel
from vlmtrain.tasks.shapes import ShapesVQA

QTYPES = ("color", "shape", "position", "side")
GROUPS = ("named", "other_objects", "background", "text")


def named_objects(qtype: str, question: str, scene: list) -> list:
    """The scene's objects the question names, in the order it names them (by shape; by colour for shape)."""
    words = question.rstrip("?").replace(",", " ").split()
    key = 1 if qtype == "shape" else 0
    found = [o for o in scene if o[key] in words]
    return sorted(found, key=lambda o: words.index(o[key]))


def lookup_report(checkpoint: str, samples: int = 200, seed: int = 0) -> dict[str, Any]:
    """Per question type: ``accuracy`` of the deciding answer token and ``attention[layer][head][group]``."""
    model = VisionLanguageModel.from_pretrained(checkpoint).eval()
    model.decoder.set_attn_implementation("eager")  # SDPA returns no attention weights
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    processor = VLMProcessor.for_checkpoint(tokenizer, model.config)
    grid = math.isqrt(model.config.image_token_length)
    cell = model.config.image_size / grid

    def token(o: tuple) -> int:  # the image token an object's centre falls in (row-major grid)
        return int(o[3] // cell) * grid + int(o[2] // cell)

    @cache
    def text(i: int) -> str:  # token id -> its text (" left", "\n", ...), decoded once per id seen
        return tokenizer.decode([i])

    report: dict[str, Any] = {}
    for qtype in QTYPES:
        data = ShapesVQA("test", samples, seed=seed, image_size=model.config.image_size, qtypes=[qtype])
        batch_samples = [data[i] for i in range(samples)]
        batch = VLMCollator(processor)(batch_samples)
        with torch.no_grad():
            embeds = model.embed(batch["input_ids"], batch["pixel_values"])
            out = model.decoder(inputs_embeds=embeds, attention_mask=batch["attention_mask"],
                                output_attentions=True)
        layers, heads = len(out.attentions), out.attentions[0].shape[1]
        mass = torch.zeros(layers, heads, len(GROUPS))
        on_words = torch.zeros(layers, heads)
        by_text: list[list[Counter[str]]] = [[Counter() for _ in range(heads)] for _ in range(layers)]
        correct = 0
        for i, sample in enumerate(batch_samples):
            targets = (batch["labels"][i] != -100).nonzero()[:, 0]
            # The token that decides: the first of a one-word answer; the side word of "circle left" (the last
            # token before the end-of-turn token).
            decide = int(targets[-2] if qtype in ("position", "side") else targets[0])
            answer_pos = decide - 1  # the position whose logits predict it
            correct += int(out.logits[i, answer_pos].argmax()) == int(batch["labels"][i, decide])
            image_pos = (batch["input_ids"][i] == model.config.image_token_id).nonzero()[:, 0]
            scene = sample["scene"][0]
            objects = named_objects(qtype, sample["texts"][0]["user"], scene)
            named = {token(o) for o in objects}
            names = {o[1] if qtype == "shape" else o[0] for o in objects}
            ids = [int(t) for t in batch["input_ids"][i, :answer_pos + 1]]
            text_pos = [p for p, t in enumerate(ids) if t != model.config.image_token_id]
            name_pos = [p for p in text_pos if text(ids[p]).strip() in names]
            others = {token(o) for o in scene} - named
            for layer, attn in enumerate(out.attentions):
                row = attn[i, :, answer_pos]  # [heads, seq]
                on_image = row[:, image_pos]
                parts = [on_image[:, sorted(s)].sum(-1) if s else torch.zeros(heads) for s in (named, others)]
                empty = on_image.sum(-1) - parts[0] - parts[1]
                mass[layer, :, :] += torch.stack([*parts, empty, row.sum(-1) - on_image.sum(-1)], dim=-1)
                on_words[layer] += row[:, name_pos].sum(-1)
                for h, values in enumerate(row[:, text_pos].tolist()):
                    for p, v in zip(text_pos, values):
                        by_text[layer][h][text(ids[p])] += v
        mass /= samples
        on_words /= samples
        report[qtype] = {"accuracy": correct / samples,
                         "attention": [[{**dict(zip(GROUPS, (round(float(v), 3) for v in mass[layer, h]))),
                                         "named_words": round(float(on_words[layer, h]), 3),
                                         "top_text": _top(by_text[layer][h], samples)}
                                        for h in range(heads)] for layer in range(layers)]}
    return report


def _top(mass: dict[str, float], samples: int) -> list:
    """[token, mean attention] of the text token (by its string, summed over a row) drawing the most."""
    word = max(mass, key=mass.get) if mass else ""
    return [word, round(mass.get(word, 0.0) / samples, 3)]


def format_report(report: dict[str, Any]) -> str:
    lines = ["attention of the position predicting the deciding token, per head: named object(s) / other objects / empty / text "
             "(of which on the naming word(s); the text token drawing the most)"]
    for qtype, r in report.items():
        lines.append(f"{qtype}: deciding-token accuracy {r['accuracy']:.3f}")
        for layer, heads in enumerate(r["attention"]):
            cells = "  ".join("/".join(f"{h[g]:.2f}" for g in GROUPS)
                              + f" ({h['named_words']:.2f}; {h['top_text'][0]!r} {h['top_text'][1]:.2f})" for h in heads)
            lines.append(f"  layer {layer}: {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint dir of a VLM trained on shapes-VQA")
    parser.add_argument("--samples", type=int, default=200, help="held-out questions per type")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.checkpoint, "model.safetensors")):
        print(f"error: {args.checkpoint} has no model.safetensors (a VLM checkpoint dir is expected)", file=sys.stderr)
        return 2
    torch.set_num_threads(min(2, torch.get_num_threads()))
    report = lookup_report(args.checkpoint, args.samples)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
