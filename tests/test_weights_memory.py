"""model.weights_on_huge_pages: a loaded CPU model's weights move into one buffer advised as transparent huge
pages, with their values, sharing and kernels unchanged."""
from __future__ import annotations

import pytest
import torch

import model as M
import quantize as Q
from test_quantize import PACKED, quantize_file, tiny_checkpoint

# ~12 MB of fp32 weights: past the 2 MB below which weights_on_huge_pages leaves a model alone
WIDE = dict(vocab_size=8192, dim=256, n_layer=2, n_head=4, n_kv_head=2, head_dim=64, intermediate_size=512)


def wide_checkpoint(directory, tie):
    """test_quantize's tiny checkpoint at WIDE's dimensions -> (its path, the state it saved)."""
    path = tiny_checkpoint(directory, tie, dims=WIDE)
    return path, torch.load(path, weights_only=True)


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = lo <= address < hi
            elif inside:
                fields[head.rstrip(":")] = line.split()[1]
    return fields


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_loaded_weights_are_the_checkpoints_on_huge_pages(tmp_path, tie, dtype):
    path, saved = wide_checkpoint(tmp_path, tie)
    model = M.load_model(path, dtype=dtype)
    state = model.state_dict()
    for name, want in saved.items():
        assert state[name].dtype == dtype and torch.equal(state[name], want.to(dtype)), name
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    if not M._transparent_huge_pages():
        pytest.skip("this kernel has no transparent huge pages: the weights stay where they were loaded")
    for name in ("tok_embeddings.weight", "layers.1.feed_forward.w2.weight"):
        smaps = mapping_of(state[name].data_ptr())
        assert smaps.get("THPeligible") == "1", (name, smaps)  # advised MADV_HUGEPAGE (anon, or the file's map: 0)


@pytest.mark.parametrize("mode,group_size", [("int8", None), ("int4", 32)])
def test_a_quantized_model_on_huge_pages_computes_what_it_did_without_them(tmp_path, monkeypatch, mode, group_size):
    path, _ = wide_checkpoint(tmp_path, tie=True)
    out = quantize_file(path, mode, group_size)
    moved = M.load_model(out, kernels=PACKED, quantized=Q.LOADING)
    if M._transparent_huge_pages():  # every tensor the kernels read was moved, the packed ones too
        for name, t in list(moved.named_buffers()) + list(moved.named_parameters()):
            if t.numel():
                assert mapping_of(t.data_ptr()).get("THPeligible") == "1", name
    monkeypatch.setattr(M, "_transparent_huge_pages", lambda: False)
    kept = M.load_model(out, kernels=PACKED, quantized=Q.LOADING)
    idx = torch.randint(0, WIDE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for m in (moved, kept):
            m.setup_caches(2, 8)
        prefill = [m.prefill(idx, torch.arange(5), 5) for m in (moved, kept)]
        step = [m.decode(idx[:, :1], torch.tensor([5]), 6) for m in (moved, kept)]
    assert torch.equal(*prefill) and torch.equal(*step)
