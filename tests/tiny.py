"""Tiny models and data shared by the tests (random weights, no network)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 48


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def token_samples(n: int = 64, seed: int = 0, min_len: int = 4, max_len: int = 12,
                  mask_prompt: bool = True) -> list[dict]:
    """Random token sequences of different lengths; the first 2 tokens are a 'prompt' masked to -100, so
    samples have different target counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        labels = [-100, -100] + ids[2:] if mask_prompt else list(ids)
        out.append({"input_ids": ids, "labels": labels, "attention_mask": [1] * length})
    return out


class TwoLossModel(nn.Module):
    """A tiny regression model that returns `loss` = loss_a + loss_b, both per-item means, and num_items."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))

    def forward(self, x, y, mask):
        pred = self.net(x)
        n = mask.sum()
        loss_a = (((pred[..., 0] - y[..., 0]) ** 2) * mask).sum() / n
        loss_b = ((pred[..., 1] - y[..., 1]).abs() * mask).sum() / n
        return {"loss": loss_a + loss_b, "loss_a": loss_a, "loss_b": loss_b, "num_items": n}
