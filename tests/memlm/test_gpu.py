"""GPU code paths against their CPU twins. Skipped with a reason on machines without CUDA."""

import pytest
import torch

from memlm.jobs.evaluate import evaluate_perplexity
from memlm.jobs.windows import WindowConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import KVCache, build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cpu_and_gpu_models(dtype=torch.float32):
    torch.manual_seed(0)
    cpu = build_model(ModelConfig.from_name("tiny")).eval()
    gpu = build_model(ModelConfig.from_name("tiny"), device="cuda", dtype=dtype).eval()
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


def test_forward_on_gpu_equals_cpu():
    cpu, gpu = cpu_and_gpu_models()
    idx = torch.randint(0, 512, (3, 100))
    with torch.no_grad():
        want, got = cpu(idx), gpu(idx.cuda())
    torch.testing.assert_close(got.logits.cpu(), want.logits, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got.knn_key.cpu(), want.knn_key, atol=1e-3, rtol=1e-3)


def test_bfloat16_on_gpu_is_close_to_float32():
    cpu, gpu = cpu_and_gpu_models(torch.bfloat16)
    idx = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        want = torch.log_softmax(cpu(idx).logits, -1)
        got = torch.log_softmax(gpu(idx.cuda()).logits.float(), -1).cpu()
    assert (got - want).abs().mean() < 0.05


def test_kv_cache_decoding_on_gpu_equals_a_full_pass():
    _, gpu = cpu_and_gpu_models()
    idx = torch.randint(0, 512, (2, 24), device="cuda")
    with torch.no_grad():
        full = gpu(idx).logits
        state, steps = KVCache.empty(gpu.config), []
        for t in range(idx.shape[1]):
            out = gpu(idx[:, t : t + 1], state)
            state = out.state
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


def test_perplexity_job_on_gpu_equals_cpu():
    cpu, gpu = cpu_and_gpu_models()
    docs = [torch.randint(1, 512, (n,)).tolist() for n in (300, 77)]
    window = WindowConfig(context=64, stride=32, batch_size=3)
    want = evaluate_perplexity(cpu, docs, window, 0, progress=False)
    got = evaluate_perplexity(gpu, docs, window, 0, progress=False)
    assert got["tokens"] == want["tokens"]
    assert got["perplexity"] == pytest.approx(want["perplexity"], rel=1e-4)
