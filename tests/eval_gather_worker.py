"""One rank of tests/test_eval_memory.py's 2-process gather test: `python eval_gather_worker.py RANK STORE OUT`.

Each rank fills evaluation's buffers as evaluation_loop would (uneven rows, different sequence lengths, one
buffer empty on rank 1), joins a gloo group through a file store, gathers with evaluation/gather.py's
gather_shards (vlmtrain.Trainer's eval_gather part), and writes what it got (and whether any tensor went
through all_gather_object) to OUT as JSON.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
import torch.distributed as dist

from vlmtrain.evaluation.gather import gather_shards
from vlmtrain.trainer.predictions import Collected
from vlmtrain.trainer.stats import LossAverager


def main(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    pickled: list[str] = []
    real = dist.all_gather_object

    def spy(output, obj, group=None):  # what goes through pickling
        pickled.append(repr(obj))
        return real(output, obj, group=group)

    dist.all_gather_object = spy
    # rank 0 evaluated samples 0 2 4 (batches [0 2] [4]), rank 1 samples 1 3 (one batch [1 3])
    batches = [[0, 2], [4]] if rank == 0 else [[1, 3]]
    preds, labels, losses = Collected(), Collected(), LossAverager()
    for ids in batches:
        rows = torch.tensor(ids)
        width = 2 + rank + len(ids)  # generated lengths differ per batch and per rank
        generated = rows[:, None] * 10 + torch.arange(width)
        preds.add({"generated": generated, "logits_score": rows[:, None].float() / 4})
        if rank == 0:  # rank 1 has no labels at all (e.g. its batches carried none)
            labels.add(rows * 100)
        losses.add({"loss": torch.tensor(float(rank + 1))}, float(len(ids)), {})
    total, samples, skipped = gather_shards(losses, preds, labels, len(sum(batches, [])), Counter(bad=rank),
                                            interleave=True)
    result = {"generated": preds.named("")["generated"].tolist(), "score": preds.named("logits_")["score"].tolist(),
              "labels": labels.result().tolist(), "loss": total.compute(across_ranks=False)["loss"],
              "samples": samples, "skipped": dict(skipped), "pickled": pickled}
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
