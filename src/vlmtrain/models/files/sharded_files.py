"""A model's weights read from an FSDP full fine-tune's checkpoint (torch.distributed.checkpoint shards in
`dcp/`, keys as the whole model names them), in one process: for inference, export, and the trainer loading
such a checkpoint into an unsharded model (model_files.py's HubModelFiles reads them with it)."""

from __future__ import annotations

import os
import warnings

import torch

DCP_DIR = "dcp"  # inside checkpoint-<step>/: the DCP shards and .metadata (as trainer/model_files.py names it)


def has_sharded_weights(directory: str) -> bool:
    """True when directory holds DCP shards."""
    return os.path.isfile(os.path.join(directory, DCP_DIR, ".metadata"))


def read_model_weights(directory: str) -> dict[str, torch.Tensor]:
    """The model's full weights from a DCP checkpoint, in one process (no process group needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.join(directory, DCP_DIR)
    metadata = dcp.FileSystemReader(path).read_metadata()
    state = {"model": {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype)
                       for key, meta in metadata.state_dict_metadata.items()
                       if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}}
    if not state["model"]:
        raise FileNotFoundError(f"{path} holds no model weights.")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]
