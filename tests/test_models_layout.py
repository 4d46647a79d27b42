"""models/'s sub-packages import in one direction, as the package's layers do (tests/test_layers.py, whose
import walk this reuses: module-level, function-level and by-name imports alike). Each sub-package may import
the ones before it in SUBPACKAGES, never one after it; the shared modules at models/'s top import no
sub-package, and every sub-package may import them. A new module of models/ belongs to a listed sub-package or
gets a line in SHARED."""

from __future__ import annotations

import pytest

from tests.test_layers import Edge, module_files, package_edges

MODELS = "vlmtrain.models"
# Lowest first: a sub-package imports only those listed before it (docs/architecture.md says what each holds).
SUBPACKAGES = (
    "families",    # one record per Hub VLM family
    "speed",       # chunked LM loss, varlen attention, checkpointing policies, compile, Liger, FLOPs
    "vision",      # around a vision tower: dummy image, patch padding, varlen vision attention, patch embed
    "own_vlm",     # vlmtrain's own VLM and its building
    "objectives",  # losses beyond the LM loss: score heads, DPO, reward model
    "files",       # checkpoint layouts (full, DCP shards, LoRA adapter, heads) and export
    "hub",         # transformers models: Hub VLM loading, causal LMs, local paths, LoRA
    "kinds",       # the model.kind registry: causal_lm, vlm, hub_vlm
)
# Small modules any sub-package uses; they import no sub-package.
SHARED = ("meta", "protocol", "sharding", "generation")


def _place(module: str) -> int | None:
    """The rank of ``module``'s sub-package in SUBPACKAGES, -1 for models/ itself and its shared modules, None
    for a module of models/ that has no place (or a module outside models/)."""
    if module == MODELS or module in (f"{MODELS}.{name}" for name in SHARED):
        return -1
    for rank, name in enumerate(SUBPACKAGES):
        package = f"{MODELS}.{name}"
        if module == package or module.startswith(package + "."):
            return rank
    return None


def _inside(module: str) -> bool:
    return module == MODELS or module.startswith(MODELS + ".")


def _listing(edges: list[Edge]) -> str:
    return "".join(f"\n  {edge}" for edge in edges)


@pytest.fixture(scope="module")
def model_edges() -> list[Edge]:
    return [edge for edge in package_edges() if _inside(edge.importer) and _inside(edge.imported)]


def test_every_module_of_models_has_a_place():
    unplaced = sorted(name for name in module_files() if _inside(name) and _place(name) is None)
    if unplaced:
        pytest.fail(f"modules of models/ in no listed sub-package (add to SUBPACKAGES or SHARED, "
                    f"tests/test_models_layout.py): {unplaced}", pytrace=False)


def test_shared_modules_import_no_subpackage(model_edges):
    down = [edge for edge in model_edges if _place(edge.importer) == -1 and _place(edge.imported) != -1]
    if down:
        pytest.fail("a shared module of models/ imports a sub-package (importer -> imported):" + _listing(down),
                    pytrace=False)


def test_subpackages_import_only_those_before_them(model_edges):
    backward = [edge for edge in model_edges if _place(edge.importer) not in (None, -1)
                and _place(edge.imported) is not None and _place(edge.imported) > _place(edge.importer)]
    if backward:
        pytest.fail(f"a sub-package of models/ imports one listed after it in {SUBPACKAGES} (importer -> "
                    "imported):" + _listing(backward), pytrace=False)
