"""On CUDA every policy forward runs without cuDNN's attention kernel (rlvr.models.sdpa); elsewhere
nothing changes. The flags are checked on this CPU build (they are process-wide switches); the
wiring by recording which device each forward asks for."""

import contextlib

import pytest
import torch

from rlvr.models import sdpa, tiny
from rlvr.models.tiny import TinyConfig, TinyTransformer

FLAGS = ("cudnn_sdp_enabled", "flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled")


def flags() -> dict[str, bool]:
    return {f: getattr(torch.backends.cuda, f)() for f in FLAGS}


def test_cuda_forwards_drop_cudnn_attention_and_keep_the_others():
    pytest.importorskip("torch.nn.attention")
    before = flags()
    with sdpa.gpu_attention(torch.device("cuda")):
        assert flags() == {"cudnn_sdp_enabled": False, "flash_sdp_enabled": True,
                           "mem_efficient_sdp_enabled": True, "math_sdp_enabled": True}
    assert flags() == before                                    # restored on exit


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_other_devices_change_nothing(device):
    before = flags()
    with sdpa.gpu_attention(torch.device(device)):
        assert flags() == before


def recorder(monkeypatch, module):
    asked = []

    def record(device):
        asked.append(device.type)
        return contextlib.nullcontext()
    monkeypatch.setattr(module, "gpu_attention", record)
    return asked


def test_tiny_model_forward_asks_for_its_device(monkeypatch):
    asked = recorder(monkeypatch, tiny)
    m = TinyTransformer(TinyConfig(vocab_size=7, n_layer=1, n_embd=16, n_head=2)).eval()
    cache = m.new_cache(2, 4)
    m(torch.tensor([[1, 2], [3, 4]]), cache=cache)
    m(torch.tensor([[5], [6]]), cache=cache)                   # a decode step
    assert asked == ["cpu", "cpu"]


def test_hf_forwards_ask_for_their_device_on_both_paths(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from hf_models import make_model_dir

    from rlvr.models import hf_policy
    from rlvr.models.hf import load_policy

    policy, _ = load_policy(make_model_dir(tmp_path))
    asked = recorder(monkeypatch, hf_policy)
    ids = torch.tensor([[5, 6, 7]])
    assert policy.uses_fast_path
    policy(ids)                                                 # the lean Llama forward
    policy.fast_path = False
    policy(ids)                                                 # transformers' own forward
    assert asked == ["cpu", "cpu"]
