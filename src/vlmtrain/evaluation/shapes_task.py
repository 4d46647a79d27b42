"""A local lmms-eval task from shapes-VQA's test split: JSONL + PNG images + the task YAML, no Hub.

    python -m vlmtrain.evaluation.shapes_task OUT_DIR [--num-samples 64] [--seed 0]

writes OUT_DIR/shapes_vqa.yaml (task ``shapes_vqa``: exact match of the answer, one word or, for side and
position questions, the object then its side: "circle left"), shapes_vqa.jsonl (one question per line, image
paths relative to it), images/*.png and utils.py (lmms-eval's ``doc_to_visual``: the images, opened from paths
next to the YAML). The same four files make a task of any JSONL of one's own; ``vlmtrain eval
--train.lmms_eval_include_path OUT_DIR --train.lmms_eval_tasks '[shapes_vqa]'`` runs it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TASK = "shapes_vqa"

TASK_YAML = """\
task: {task}
dataset_path: json  # local files: data_files are relative to this YAML
dataset_kwargs:
  data_files:
    test: {task}.jsonl
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  max_new_tokens: 4
  until: ["\\n"]
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
metadata:
  version: 1.0
"""

UTILS_PY = '''\
"""doc_to_visual for lmms-eval: a doc's images, by paths relative to this file."""

import os

from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))


def doc_to_visual(doc):
    return [Image.open(os.path.join(HERE, path)).convert("RGB") for path in doc["images"]]
'''


def write_shapes_task(out_dir: str, num_samples: int = 64, seed: int = 0, task: str = TASK) -> str:
    """Write the task (YAML, JSONL, images, utils.py) into out_dir; return out_dir (lmms-eval's include_path).
    Questions come from ShapesVQA's test split, so they never share an image with training."""
    from vlmtrain.tasks.shapes import ShapesVQA

    root = Path(out_dir)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, sample in enumerate(ShapesVQA("test", num_samples, seed=seed)):
        paths = []
        for k, image in enumerate(sample["images"]):
            paths.append(f"images/{i}_{k}.png")
            image.save(root / paths[-1])
        turn = sample["texts"][0]
        rows.append({"id": i, "qtype": sample["qtype"], "images": paths, "question": turn["user"],
                     "answer": turn["assistant"]})
    (root / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / f"{task}.yaml").write_text(TASK_YAML.format(task=task))
    (root / "utils.py").write_text(UTILS_PY)
    return str(root)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_shapes_task(args.out_dir, args.num_samples, args.seed))


if __name__ == "__main__":
    main()
