"""Block-wise int8 / fp8 quantization of ZeRO-3 communication: the documented error bounds."""

import pytest
import torch

from threefold.comm.quantize import BLOCK, dequantize, fp8_supported, quantize
from threefold.config import load_config
from threefold.errors import ConfigError


def test_round_trip_error_bounds():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * BLOCK, generator=g) * torch.logspace(-3, 1, 8).repeat_interleave(BLOCK)
    x[:BLOCK] = 0  # an all-zero block stays zero
    blocks = x.view(-1, BLOCK)
    absmax = blocks.abs().amax(1, keepdim=True)
    got = dequantize(*quantize(x, "int8"), "int8").view(-1, BLOCK)
    assert ((got - blocks).abs() <= absmax / 254 * (1 + 1e-6)).all()
    assert (got[0] == 0).all()
    if fp8_supported(torch.device("cpu")):
        got = dequantize(*quantize(x, "fp8"), "fp8").view(-1, BLOCK)
        bound = torch.maximum(blocks.abs() * 2 ** -4, absmax / 448 * 2 ** -10)
        assert ((got - blocks).abs() <= bound * (1 + 1e-6)).all()
        assert ((got - blocks).abs() > 0).any()  # it is lossy: the bound is not vacuous
    payload, scales = quantize(x, "int8")
    assert payload.dtype == torch.uint8 and payload.numel() == x.numel() and scales.numel() == x.numel() // BLOCK


@pytest.mark.parametrize("key", ["parallel.zero_weight_comm=int8", "parallel.zero_grad_comm=int8"])
def test_quantized_comm_needs_zero_3(key):
    with pytest.raises(ConfigError) as info:
        load_config(None, [key, "parallel.zero=2"]).validate(2)
    assert info.value.field == key.split("=")[0] and "parallel.zero=3" in str(info.value)
