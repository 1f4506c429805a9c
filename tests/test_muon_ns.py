"""Newton–Schulz with bfloat16 matmuls emulated in float32, for devices without bfloat16 GEMMs.

References: torch's own bfloat16 kernels (the path torch.optim.Muon takes) and the same quintic iteration in
float64 without any rounding.
"""

from __future__ import annotations

import pytest
import torch

from engines.training.muon import BF16_KERNELS_ENV, emulate_bf16_matmul, native_bf16_matmul, newton_schulz_

COEFFS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
SHAPES = [(3, 96, 40), (3, 40, 96), (2, 64, 64)]  # tall (iterated transposed), wide, square


def float64_newton_schulz(x: torch.Tensor, steps: int) -> torch.Tensor:
    y = x.double()
    tall = y.size(1) > y.size(2)
    y = y.mT if tall else y
    y = y / torch.stack([m.norm() for m in y]).clamp(min=1e-7).view(-1, 1, 1)
    a, b, c = COEFFS
    for _ in range(steps):
        gram = y @ y.mT
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.mT if tall else y


def batch(shape: tuple[int, int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("shape", SHAPES)
def test_one_emulated_step_equals_the_bfloat16_kernels_bit_for_bit(shape):
    x = batch(shape)
    emulated = newton_schulz_(x.clone(), COEFFS, 1, 1e-7, emulate=True)
    kernels = newton_schulz_(x.clone(), COEFFS, 1, 1e-7, emulate=False)
    assert emulated.dtype == kernels.dtype == torch.bfloat16 and emulated.shape == x.shape
    assert torch.equal(emulated, kernels)


@pytest.mark.parametrize("shape", SHAPES)
def test_emulated_iteration_is_as_accurate_as_the_kernels_and_rounds_like_them(shape):
    x = batch(shape, seed=1)
    exact = float64_newton_schulz(x, 5)
    err = {emulate: (newton_schulz_(x.clone(), COEFFS, 5, 1e-7, emulate=emulate).double() - exact).abs().mean()
           for emulate in (True, False)}
    assert err[True] <= 1.1 * err[False]
    # rounding only the result lands ~10x nearer the float64 iteration: the emulation rounds every product
    rounded_once = exact.bfloat16().double()
    assert err[True] > 3 * (rounded_once - exact).abs().mean()


def test_default_path_follows_the_device(monkeypatch):
    monkeypatch.delenv(BF16_KERNELS_ENV, raising=False)
    assert not emulate_bf16_matmul("cuda")
    assert emulate_bf16_matmul("cpu") == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert native_bf16_matmul("cpu") == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    monkeypatch.setenv(BF16_KERNELS_ENV, "1")
    assert not emulate_bf16_matmul("cpu")
