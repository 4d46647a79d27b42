"""train.module_learning_rates {vision: 0} on a full fine-tune of a tiny Hub VLM under 2 gloo ranks (DDP and FSDP):
the tower is frozen before the model is wrapped, so training runs, the tower stays as loaded and the text model
learns."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests import preloaded
from vlmtrain.models.families import get_family

ROOT = Path(__file__).resolve().parents[1]
TOWER = ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks")  # the family's `vision`


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_a_zero_learning_rate_tower_is_frozen_before_ddp_or_fsdp_wrap(tmp_path, wrap):
    tiny = get_family("qwen3_vl").build_tiny(str(tmp_path / "tiny"), seed=0)
    cfg = yaml.safe_load((ROOT / "configs" / "qwen3vl-tiny-score-heads.yaml").read_text())
    cfg["model"]["pretrained"] = tiny
    cfg["data"].update(num_train=16, num_eval=8)
    cfg["train"].update(max_steps=2, per_device_train_batch_size=2, logging_steps=1, eval_strategy="no",
                        save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-2,
                        warmup_ratio=0.0, module_learning_rates={"vision": 0.0}, fsdp=wrap == "fsdp",
                        output_dir=str(tmp_path / "run"))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    # 2 ranks forked with their imports done (tests/preloaded.py), torchrun's rank environment, no launcher
    logs = tmp_path / "logs"
    logs.mkdir()
    codes, output = preloaded.launch("tests.preloaded:run_script", [str(ROOT / "tests" / "frozen_tower_worker.py"),
                                     str(config), str(tmp_path)], env, 2, logs)
    assert codes == [0, 0], output
    result = torch.load(tmp_path / "weights.pt", weights_only=False)
    assert result["global_step"] == 2
    loaded = {}
    for f in Path(tiny).glob("*.safetensors"):
        loaded.update(load_file(str(f)))
    weights = {name.removeprefix("base."): value for name, value in result["weights"].items()}
    tower = [n for n in weights if n.startswith(TOWER)]
    text = [n for n in weights if n.startswith("model.language_model.")]
    assert tower and text and all(n in loaded for n in tower + text)
    for name in tower:
        value, trainable = weights[name]
        assert not trainable and torch.equal(value, loaded[name]), name
    changed = [n for n in text if not torch.equal(weights[n][0], loaded[n])]
    assert len(changed) == len(text), sorted(set(text) - set(changed))
