"""memlm.model.device: the one resolution of --device and --dtype, and the commands that use it."""

from __future__ import annotations

import pytest
import torch

from memlm.errors import MemlmError
from memlm.model.device import DTYPES, resolve_device, resolve_dtype


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_is_cuda_only_when_visible(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("asked", ["cuda", "cuda:0"])
def test_cuda_without_gpu_is_refused(no_gpu, asked) -> None:
    with pytest.raises(MemlmError, match=f"--device {asked} was asked for but no CUDA GPU is visible"):
        resolve_device(asked)


@pytest.mark.parametrize("asked", ["tpu", "gpu", "", "cuda:x"])
def test_unknown_device_is_refused(monkeypatch, asked) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(MemlmError, match=r"--device must be auto, cpu or cuda\[:N\], got"):
        resolve_device(asked)


def test_dtype_auto_follows_device_and_names_resolve() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    for name, dtype in DTYPES.items():
        assert resolve_dtype(name, torch.device("cpu")) is dtype
        assert resolve_dtype(dtype, torch.device("cpu")) is dtype
    with pytest.raises(MemlmError, match="--dtype must be auto, float32, bfloat16, float16; got 'fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))
    with pytest.raises(MemlmError, match="--dtype must be auto, float32, bfloat16, float16; got torch.int8"):
        resolve_dtype(torch.int8, torch.device("cpu"))


def test_train_resolves_its_device_here(no_gpu) -> None:
    # Train resolves its device with the shared rule: "cuda:0" without a GPU is refused at once, not later in torch.
    from memlm.jobs.train import TrainConfig, train

    with pytest.raises(MemlmError, match="--device cuda:0 was asked for but no CUDA GPU is visible"):
        train(TrainConfig(device="cuda:0"), train_docs=[[1, 2, 3]])
    with pytest.raises(MemlmError, match=r"--device must be auto, cpu or cuda\[:N\], got 'tpu'"):
        train(TrainConfig(device="tpu"), train_docs=[[1, 2, 3]])

