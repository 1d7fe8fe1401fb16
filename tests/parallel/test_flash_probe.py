"""flash-attn that is installed but does not import (a wheel built for another torch: ``undefined symbol``; a missing
CUDA library: OSError) is not "available": `flash_attn_status` imports both packages for real, says why not in one
line (package, error, fix), logs it once, and context parallelism falls back to the exact torch ring, whose result
equals full attention. Fake packages on sys.path stand in for the broken installs."""

import logging
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close
from torch._subclasses.fake_tensor import FakeTensorMode

import rl_lightning.attention.kernels as kernels
import rl_lightning.attention.ring as ring
from rl_lightning.attention.zigzag import shard_tokens, zigzag_layout

UNDEFINED = "/site-packages/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"
BROKEN = {
    "ImportError": f"raise ImportError({UNDEFINED!r})",
    "OSError": "raise OSError('libcudart.so.12: cannot open shared object file:\\nNo such file or directory')",
}


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch):
    """No real or cached flash packages: each test sees only what it puts on sys.path."""
    for name in ("flash_attn", "ring_flash_attn"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    ring.flash_attn_status.cache_clear()
    yield
    ring.flash_attn_status.cache_clear()


def _cuda_query(dtype=torch.bfloat16, head_dim=64):
    """A CUDA query without a GPU (fake tensor): what the flash route is chosen from."""
    with FakeTensorMode():
        return torch.empty(1, 4, 10, head_dim, device="cuda", dtype=dtype)


def _package(root, name, body):
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(body + "\n")


@pytest.mark.parametrize("error", list(BROKEN))
def test_a_broken_flash_attn_is_unusable_with_one_line_naming_it_and_the_fix(error, tmp_path, monkeypatch, caplog):
    _package(tmp_path, "flash_attn", BROKEN[error])
    _package(tmp_path, "ring_flash_attn", "")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=ring.__name__):
        usable, reason = ring.flash_attn_status()
        assert ring.flash_attn_status() == (usable, reason)  # cached: probed and logged once
    assert not usable and not ring._flash_ring_available(_cuda_query())  # installed, but not available
    detail = {"ImportError": f"ImportError: {UNDEFINED}",
              "OSError": "OSError: libcudart.so.12: cannot open shared object file: No such file or directory"}[error]
    assert reason == (f"flash-attn is installed but cannot be imported ({detail}); fix: reinstall it for torch "
                      f"{torch.__version__} (CUDA {torch.version.cuda}): pip install --no-build-isolation "
                      '--no-cache-dir "flash-attn>=2.8,<2.9" --force-reinstall, or pip uninstall flash-attn')
    assert [r.getMessage() for r in caplog.records] == [
        f"{reason}; context-parallel attention falls back to the exact torch ring (slower)"]
    assert "\n" not in caplog.records[0].getMessage()


def test_a_broken_ring_flash_attn_is_named_and_missing_packages_are_not_warned_about(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger=ring.__name__):
        assert ring.flash_attn_status() == (False, 'flash-attn is not installed (pip install --no-build-isolation '
                                                   '--no-cache-dir "flash-attn>=2.8,<2.9")')
        assert caplog.records == []  # not installed is the CPU normal: nothing to warn about
        _package(tmp_path, "flash_attn", "")  # imports fine
        _package(tmp_path, "ring_flash_attn", "raise RuntimeError('CUDA driver version is insufficient')")
        monkeypatch.syspath_prepend(str(tmp_path))
        ring.flash_attn_status.cache_clear()
        usable, reason = ring.flash_attn_status()
    assert not usable
    assert reason.startswith("ring-flash-attn is installed but cannot be imported (RuntimeError: CUDA driver version "
                             "is insufficient); fix: reinstall it for torch")
    assert reason.endswith("pip install ring-flash-attn==0.1.8 --force-reinstall, or pip uninstall ring-flash-attn")
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING


def test_both_importable_is_usable(tmp_path, monkeypatch):
    _package(tmp_path, "flash_attn", "")
    _package(tmp_path, "ring_flash_attn", "")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ring.flash_attn_status() == (True, "flash-attn and ring-flash-attn import")
    assert ring._flash_ring_available(_cuda_query())
    # the checks torch's flash path makes: flash-attn has no fp32 and takes head sizes % 8 up to 256
    for query in (_cuda_query(torch.float32), _cuda_query(head_dim=12), _cuda_query(head_dim=512),
                  torch.zeros(1, 4, 10, 64, dtype=torch.bfloat16)):
        assert not ring._flash_ring_available(query), (query.device, query.dtype, query.shape)


def test_the_ring_falls_back_to_the_exact_torch_ring_when_flash_attn_is_broken(tmp_path, monkeypatch):
    _package(tmp_path, "flash_attn", BROKEN["ImportError"])
    _package(tmp_path, "ring_flash_attn", "raise AssertionError('never imported: flash_attn is probed first')")
    monkeypatch.syspath_prepend(str(tmp_path))
    # Inputs flash would take (CUDA, bf16, head dim) stand in for a GPU: only the probe keeps the flash route away.
    monkeypatch.setattr(kernels, "flash_inputs_supported", lambda query: True)
    monkeypatch.setattr(kernels, "flash_varlen_available", lambda device: False)  # the torch ring's math blocks
    lengths = [13, 1, 30, 7]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    torch.manual_seed(0)
    n = sum(lengths)
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    layout = zigzag_layout(cu, 0, 1)
    assert not ring._flash_ring_available(q)
    out = ring.ring_attention(*(shard_tokens(t, layout, dim=2) for t in (q, k, v)), layout)
    full = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                     enable_gqa=True) for s, e in zip(cu[:-1], cu[1:], strict=True)],
                     dim=2).transpose(1, 2)  # (1, N, H, D)
    real = shard_tokens(torch.ones(1, n), layout)[0].bool()
    assert_close(out[0, real], shard_tokens(full, layout)[0, real], atol=1e-5)
