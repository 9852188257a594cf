"""Each kind of bad checkpoint fails with one clear CheckpointError that names the problem."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine.runtime.errors import CheckpointError
from engine.model.loader import load_model


@pytest.fixture
def checkpoint(tiny_model_dir, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, target)
    return target


def rewrite_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor_is_named(checkpoint):
    rewrite_tensors(checkpoint, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight'"):
        load_model(checkpoint)


def test_wrong_shape_names_parameter_and_shapes(checkpoint):
    def shrink(t):
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"][:8]
    rewrite_tensors(checkpoint, shrink)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.q_proj\.weight has shape \[8, 64\] but config\.json implies \[64, 64\]"):
        load_model(checkpoint)


def test_unknown_architecture_names_the_field(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'architectures' is \['LlamaForCausalLM'\]"):
        load_model(checkpoint)


def test_missing_config_field_is_named(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    del cfg["num_local_experts"]
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="lacks required field 'num_local_experts'"):
        load_model(checkpoint)


def test_corrupt_safetensors_is_named(checkpoint):
    data = bytearray((checkpoint / "model.safetensors").read_bytes())
    data[:8] = (10**12).to_bytes(8, "little")  # header length far past the end of the file
    (checkpoint / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        load_model(checkpoint)


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_model(tmp_path)
