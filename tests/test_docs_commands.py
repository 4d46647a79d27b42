"""What a newcomer copies from the README and docs/*.md works as written: every `pip install` of vlmtrain is the
clone's editable install (vlmtrain is not on PyPI) with extras that pyproject.toml defines, torchvision is
installed as the build of the installed torch, and every python block that uses transformers or a vlmtrain
Trainer runs under the installed (pinned) transformers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from PIL import Image
from torch import nn

from tests.tiny import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
# A `pip install ...` command, up to the end of its code span, line or shell comment (`\[` is the reference's
# escaped bracket).
PIP = re.compile(r"pip install\s+([^`\n#|]*)")
TARGET = re.compile(r"""(?P<name>vlmtrain|\.)\\?\[(?P<extras>[^\]\\]*)\\?\]""")


def _commands() -> list[tuple[str, str]]:
    return [(page.relative_to(ROOT).as_posix(), m.group(1).strip()) for page in PAGES if page.name != "changelog.md"
            for m in PIP.finditer(page.read_text())]


def test_every_pip_install_of_vlmtrain_is_the_clones_with_extras_pyproject_defines():
    found, wrong = 0, []
    for page, command in _commands():
        for m in TARGET.finditer(command):
            found += 1
            extras = {e.strip() for e in m.group("extras").split(",")}
            if m.group("name") == "vlmtrain" or "-e" not in command.split() or not extras <= EXTRAS:
                wrong.append(f"{page}: pip install {command}")
    assert found > 10, found  # (the pattern still finds the install lines)
    assert not wrong, "vlmtrain is installed from a clone: pip install -e \".[EXTRA]\" with an extra of " \
                      "pyproject.toml:\n" + "\n".join(wrong)


def test_torchvision_is_installed_as_the_installed_torchs_build():
    """A bare `pip install torchvision` replaces a CPU torch with the newest CUDA one (and ~17 nvidia packages):
    the docs pin torchvision 0.(N+15) for torch 2.N from PyTorch's CPU index."""
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert major == 2
    commands = [(page, c) for page, c in _commands() if re.search(r"\btorchvision\b", c)]
    assert commands
    for page, command in commands:
        assert f"torchvision==0.{minor + 15}." in command, (page, command)
        assert "--index-url https://download.pytorch.org/whl/cpu" in command, (page, command)


# -- the python blocks ------------------------------------------------------------------------------------------
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
USES = re.compile(r"^\s*(from|import) transformers\b|\b(Trainer|DPOTrainer|RewardTrainer|GRPOTrainer)\b", re.M)
HUB_ID = re.compile(r"""(?:from_pretrained\(\s*|\bmodel=)["']([^"'/]+/[^"']+)["']""")  # (a Hub id: owner/name)
# Blocks that transformers cannot run on a machine without torchvision, as written (their processor is the
# Hub checkpoint's real class, whose video processor needs it): run where torchvision imports.
NEEDS_TORCHVISION = {"AutoProcessor.from_pretrained("}
# Blocks that are illustrative only (kept few): (page, first line) -> why.
ILLUSTRATIVE = {
    ("docs/hub-vlms.md", "from transformers import AutoModelForImageTextToText, AutoProcessor"):
        "loads an export a run wrote at scale (the export itself: tests/test_hub_checkpoint.py)",
}


def _blocks() -> list:
    out = []
    for page in PAGES:
        if page.name == "index.md":  # (the README, generated: scripts/gen_docs_index.py)
            continue
        text = page.read_text()
        for m in BLOCK.finditer(text):
            code = m.group(1)
            if not USES.search(code):
                continue
            name = f"{page.relative_to(ROOT).as_posix()}:{text[:m.start()].count(chr(10)) + 1}"
            out.append(pytest.param(page.relative_to(ROOT).as_posix(), code, None, id=name))
            was = re.search(r"^(.*?)\s*# was: (from transformers import .*)$", code, re.M)
            if was:  # the transformers script it was: the same block with the original import
                original = code.replace(was.group(0), was.group(2))
                out.append(pytest.param(page.relative_to(ROOT).as_posix(), original, was.group(2),
                                        id=f"{name}-as-{was.group(2).split()[1]}"))
    return out


class _Regressor(nn.Module):
    """A model as the Trainer examples take it (forward returns a mapping with loss), with the submodules their
    module_learning_rates name."""

    def __init__(self) -> None:
        super().__init__()
        self.vision, self.projector = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.projector(torch.tanh(self.vision(x))).squeeze(-1)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def _rows(n: int, seed: int) -> list[dict]:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return [{"x": row, "labels": row.sum()} for row in x]


def _collate(batch: list[dict]) -> dict:
    return {key: torch.stack([b[key] for b in batch]) for key in batch[0]}


def _mse(pred) -> dict:
    return {"mse": float(np.mean((pred.predictions - pred.label_ids) ** 2))}


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """Qwen/Qwen3-0.6B's stand-in: a tiny Llama with a byte-level tokenizer (any text, no merges) and a chat
    template, written offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + sorted(
        pre_tokenizers.ByteLevel.alphabet()))}, merges=[]))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")
    path = tmp_path_factory.mktemp("tiny_lm")
    tiny_llama(vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("page, code, original", _blocks())
def test_every_python_block_using_transformers_or_a_trainer_runs_as_written(page, code, original, tmp_path,
                                                                            monkeypatch, tiny_lm, tiny_hub):
    """Each block runs as written under the installed transformers (and, where its first line says what it was,
    as that script too): only a Hub model it names is replaced by a tiny one, and the names it leaves to the
    reader (model, train, val, test, collate, my_metrics, args, my_counter) are defined here."""
    first = code.splitlines()[0]
    if (page, first) in ILLUSTRATIVE:
        pytest.skip(ILLUSTRATIVE[page, first])
    if any(s in code for s in NEEDS_TORCHVISION):
        pytest.importorskip("torchvision", reason="the block's processor is transformers' real class")
    hub = {"Qwen/Qwen3-0.6B": lambda: tiny_lm, "Qwen/Qwen3-VL-2B-Instruct": lambda: tiny_hub("qwen3_vl")[1]}
    for name in set(HUB_ID.findall(code)):
        assert name in hub, f"{page}: a Hub model without a tiny stand-in here: {name}"
        code = code.replace(f'"{name}"', repr(str(hub[name]())))
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (32, 32), "orange").save("cat.png")
    from vlmtrain import TrainingArguments

    torch.manual_seed(0)
    names = {"model": _Regressor(), "train": _rows(64, 0), "val": _rows(16, 1), "test": _rows(16, 2),
             "collate": _collate, "my_metrics": _mse, "my_counter": lambda model: (lambda batch: 0),
             "args": TrainingArguments(output_dir="runs/mine", max_steps=1, report_to="none")}
    if "DPOTrainer(" in code and "pairs =" not in code:  # a DPO block's model, pairs and processor
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer

        names.update(model=AutoModelForCausalLM.from_pretrained(tiny_lm), processor=AutoTokenizer.from_pretrained(
            tiny_lm), pairs=Dataset.from_list([{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}] * 8))
    exec(compile(code, f"{page} ({original or 'as written'})", "exec"), names)
