"""The model's CPU weights in one arena advised for huge pages: the same logits, tied weights kept tied, and
the loaded tensors released as they are copied."""

from __future__ import annotations

import gc
import mmap
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.offline.default_model import write_default_model
from engine.model.loader import load_model
from engine.model.weight_arena import ALIGN, huge_page_bytes, mapping_fields, move_weights
from tests.engine.model.conftest import TILE_SHAPED_CONFIG, full_forward_logits

ADVISABLE = hasattr(mmap, "MADV_HUGEPAGE") and Path("/proc/self/smaps").exists()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_loaded_model_keeps_every_weight_in_one_advised_arena_with_the_same_logits(tmp_path, monkeypatch, dtype):
    config = TILE_SHAPED_CONFIG.model_copy(update=dict(tie_word_embeddings=True))
    model_dir = write_default_model(tmp_path / "model", config, seed=3)
    ids = torch.randint(0, config.vocab_size, (19,), generator=torch.Generator().manual_seed(2))
    moved = load_model(model_dir, dtype)
    storages = {p.untyped_storage().data_ptr() for p in moved.parameters()}
    assert len(storages) == 1, f"the weights lie in {len(storages)} allocations, not one"
    assert moved.lm_head.weight is moved.embed.weight
    if ADVISABLE:
        assert "hg" in mapping_fields(moved.embed.weight.data_ptr())["VmFlags"].split()
    monkeypatch.setattr("engine.model.loader.move_weights", lambda model: None)
    as_loaded = load_model(model_dir, dtype)
    assert len({p.untyped_storage().data_ptr() for p in as_loaded.parameters()}) > 1
    assert torch.equal(full_forward_logits(moved, ids), full_forward_logits(as_loaded, ids))


def test_moved_weights_keep_their_values_ties_and_alignment_and_the_old_tensors_are_released():
    model = nn.Module()
    model.embed = nn.Embedding(33, 24)
    model.head = nn.Linear(24, 33, bias=False)
    model.head.weight = model.embed.weight
    model.proj = nn.Linear(24, 7)  # 7 floats of bias: the next tensor must still start on a cache line
    model.norm = nn.LayerNorm(7)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    old = [weakref.ref(p) for p in model.parameters()]

    arena = move_weights(model)

    assert arena is not None and arena.size >= sum(p.numel() * 4 for p in model.parameters())
    assert model.head.weight is model.embed.weight
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
        assert param.data_ptr() % ALIGN == 0 and arena.start <= param.data_ptr() < arena.start + arena.size, name
    gc.collect()
    assert all(ref() is None for ref in old), "move_weights kept a loaded tensor alive"


def test_weights_stay_as_loaded_when_no_arena_can_be_mapped(monkeypatch, caplog):
    model = nn.Linear(8, 8)
    weight = model.weight

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr("engine.model.weight_arena.mmap.mmap", refuse)
    assert move_weights(model) is None and model.weight is weight
    assert "no arena" in caplog.text


def test_a_module_without_cpu_weights_is_left_alone():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    assert move_weights(model) is None and model.weight.device.type == "meta"


def test_the_fields_and_huge_pages_read_are_those_of_the_mapping_holding_the_address(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0\n"
        "Size:               4096 kB\nAnonHugePages:      2048 kB\nVmFlags: rd wr mr mw me ac hg\n"
        "7f0000400000-7f0000401000 r--p 00000000 08:01 42                         /lib/x.so\n"
        "Size:                  4 kB\nAnonHugePages:         0 kB\nVmFlags: rd mr mw me\n")
    assert mapping_fields(0x7F0000200000, smaps) == {"Size": "4096 kB", "AnonHugePages": "2048 kB",
                                                      "VmFlags": "rd wr mr mw me ac hg"}
    assert mapping_fields(0x7F0000400010, smaps)["VmFlags"] == "rd mr mw me"
    assert mapping_fields(0x1000, smaps) == {} and mapping_fields(0x1000, tmp_path / "absent") == {}
    assert huge_page_bytes(0) == 0  # no mapping holds address 0
