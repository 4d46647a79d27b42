"""Time to resume a stream at an early and at a late position: vlmtrain's seek vs replaying the stream.

Writes --samples shapes-VQA samples (64px PNGs) as WebDataset shards and as one JSONL file, then for each
source and each position (--early and --late batches consumed) measures the time from a fresh
StatefulDataLoader + load_state_dict to the first resumed batch:

  seek    vlmtrain.data.sources.StreamingDataset: the state is (shard, byte offset); resuming opens that
          shard at that offset
  replay  the same stream without a state_dict (what a plain IterableDataset gets): StatefulDataLoader
          can only re-read and drop the consumed samples

It checks that both resume at the same sample, and prints the times side by side with late/early ratios.

    python benchmarks/resume.py                       # about 30-60 s on 2 cores
    python benchmarks/resume.py --samples 20000 --late 4000
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings

from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from vlmtrain.data.cauldron import write_cauldron_jsonl
from vlmtrain.data.sources import KEY, JsonlSource, StreamingDataset, WebDatasetSource
from vlmtrain.data.tools import write_webdataset
from vlmtrain.tasks.shapes import ShapesVQA


class Replay(IterableDataset):
    """The same samples with no state of its own: a resume must replay them."""

    def __init__(self, stream: StreamingDataset) -> None:
        self.stream = stream

    def __iter__(self):
        return iter(self.stream)


def keys(batch):
    return [s[KEY] for s in batch]


def resume_seconds(make, batches: int, batch_size: int, repeats: int) -> tuple[float, list[str]]:
    loader = StatefulDataLoader(make(), batch_size=batch_size, num_workers=0, collate_fn=list)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = loader.state_dict()
    times, first = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        resumed = StatefulDataLoader(make(), batch_size=batch_size, num_workers=0, collate_fn=list)
        resumed.load_state_dict(state)
        first = keys(next(iter(resumed)))
        times.append(time.perf_counter() - start)
    return statistics.median(times), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--early", type=int, default=10, help="batches consumed before the early resume")
    parser.add_argument("--late", type=int, default=600, help="batches consumed before the late resume")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*naively fast-forwarding.*")  # the replay rows show it
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        data = ShapesVQA("train", args.samples, seed=0, multi_image_fraction=0.4)
        t = time.perf_counter()
        shards = write_webdataset((data[i] for i in range(len(data))), os.path.join(tmp, "wds"), args.shard_size)
        jsonl = write_cauldron_jsonl(data, os.path.join(tmp, "jsonl"))
        print(f"wrote {args.samples} samples: {len(shards)} tar shards + 1 JSONL file "
              f"({time.perf_counter() - t:.1f}s)")
        print(f"\nresume time (median of {args.repeats}), batch size {args.batch_size}:")
        print(f"  {'source':<6} {'method':<7} {f'after {args.early}':>12} {f'after {args.late}':>12} {'late/early':>11}")
        for name, source in (("wds", lambda: WebDatasetSource(shards)), ("jsonl", lambda: JsonlSource(jsonl))):
            first = {}
            for method in ("seek", "replay"):
                def make(method=method, source=source):
                    stream = StreamingDataset([source()], seed=0)
                    return stream if method == "seek" else Replay(stream)
                early, first_early = resume_seconds(make, args.early, args.batch_size, args.repeats)
                late, first_late = resume_seconds(make, args.late, args.batch_size, args.repeats)
                first.setdefault("early", first_early)
                first.setdefault("late", first_late)
                if (first["early"], first["late"]) != (first_early, first_late):
                    raise SystemExit(f"{name}: seek and replay resumed at different samples")
                print(f"  {name:<6} {method:<7} {early * 1e3:>10.1f}ms {late * 1e3:>10.1f}ms {late / early:>10.1f}x")


if __name__ == "__main__":
    main()
