"""The Qwen-VL patch embedding as nn.Conv3d vs as the equal matmul (vlmtrain.models.vision.patch_embed),
forward + backward.

    python benchmarks/patch_embed.py                 # CUDA in bf16 when there is a GPU, else CPU in float32
    python benchmarks/patch_embed.py --patches 8192 --hidden 1152 --rounds 20

Shapes default to Qwen3-VL-8B's vision tower (3 x 2 x 16 x 16 patches, hidden 1152) and two 1,024-token images
(4 patches per image token: 8,192 patches). Prints the median milliseconds per forward + backward of each, their
ratio and the largest difference of their outputs. On PyTorch 2.9 the convolution is the slow one on GPUs (pytorch
issues #166122, #166643, #174051); on CPU both are one matmul-sized piece of work.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from vlmtrain.models.vision.patch_embed import linear_patch_embeddings


def _time(module: torch.nn.Module, x: torch.Tensor, rounds: int, sync) -> float:
    for _ in range(3):  # warm-up
        module(x).sum().backward()
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        module(x).float().sum().backward()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1152)
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kernel = (2, args.patch, args.patch)
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, args.hidden, kernel, stride=kernel, bias=True).to(device, dtype)
    fast = copy.deepcopy(conv)
    linear_patch_embeddings(fast)
    x = torch.randn(args.patches, 3, *kernel, device=device, dtype=dtype)
    diff = (conv(x).float() - fast(x).float()).abs().max().item()
    times = {}
    for _ in range(2):  # alternate, twice
        for name, module in (("conv3d", conv), ("linear", fast)):
            times.setdefault(name, []).append(_time(module, x, args.rounds, sync))
    conv_ms, linear_ms = min(times["conv3d"]), min(times["linear"])
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, {dtype}, torch {torch.__version__}, "
          f"{args.patches} patches of {tuple(kernel)} -> {args.hidden}")
    print(f"conv3d  {conv_ms:8.3f} ms forward+backward")
    print(f"linear  {linear_ms:8.3f} ms forward+backward")
    print(f"conv3d / linear: {conv_ms / linear_ms:.2f}x; largest output difference {diff:.3g}")


if __name__ == "__main__":
    main()
