"""A Hub VLM with score heads and LoRA under FSDP (2 gloo ranks): ranks other than 0 build it on the meta device
(from its config, since from_pretrained refuses meta) and receive their shards from rank 0; the losses equal one
process with the same global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.test_distributed import _losses, _run
from vlmtrain.models.families import get_family

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_hub_vlm_with_heads_and_lora_under_fsdp_matches_one_process(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "qwen3vl-tiny-score-heads.yaml").read_text())
    cfg["model"]["pretrained"] = get_family("qwen3_vl").build_tiny(str(tmp_path / "tiny"), seed=0)
    cfg["model"]["lora"] = {"r": 4}
    cfg["data"].update(num_train=64, num_eval=8)
    cfg["train"].update(max_steps=3, logging_steps=1, eval_strategy="no", save_strategy="no",
                        dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-2)
    one = _losses(_run(tmp_path, cfg, "one", nproc=1, batch=4))
    fsdp = _losses(_run(tmp_path, cfg, "fsdp", 2, 2, "--train.fsdp", "true"))
    assert sorted(one) == sorted(fsdp) == [1, 2, 3]
    assert all(abs(one[s] - fsdp[s]) < 1e-4 for s in one), (one, fsdp)
