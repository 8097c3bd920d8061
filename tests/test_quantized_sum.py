"""The pseudo-gradients' sum in fp8 and int4 codes (``workers.quantized_sum``): the codes'
error bounds, their size, and the sum over a real gloo group of three ranks, which every rank
decodes alike."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from torch import nn

from workers.quantized_sum import BLOCK, CODES, QuantizedSum, decode, encode


def blocks_of(values: torch.Tensor) -> torch.Tensor:
    return values.view(-1, BLOCK).abs().amax(dim=1, keepdim=True).expand(-1, BLOCK).reshape(-1)


def test_int4_codes_each_value_within_half_a_step_of_its_blocks_scale():
    values = torch.randn(40 * BLOCK, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 40 * BLOCK)
    coded = encode(values, CODES["int4"])
    assert coded.dtype == torch.uint8 and coded.shape == (40, BLOCK // 2 + 4)  # 4.5 bits a value
    error = (decode(coded, CODES["int4"]) - values).abs()
    assert (error <= blocks_of(values) / 14 * (1 + 1e-6)).all()
    assert error.max() > 0  # it is a code, not a copy


def test_fp8_codes_each_value_to_e4m3s_precision_of_its_blocks_scale():
    values = torch.randn(40 * BLOCK, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 40 * BLOCK)
    coded = encode(values, CODES["fp8"])
    assert coded.shape == (40, BLOCK + 4)
    error = (decode(coded, CODES["fp8"]) - values).abs()
    # 3 mantissa bits: half an ulp is 1/16 of a normal value; below e4m3's normals, a fixed step
    assert (error <= torch.maximum(values.abs() / 16, blocks_of(values) / 448 * 2**-9) * (1 + 1e-6)).all()


def test_a_block_of_zeros_decodes_to_zeros():
    for code in CODES.values():
        assert torch.equal(decode(encode(torch.zeros(2 * BLOCK), code), code), torch.zeros(2 * BLOCK))


def sum_on_ranks(precision: str, contributions: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Each rank's parameters' gradients set to its contributions, summed by ``QuantizedSum``
    over one gloo group of the ranks (threads of this process); each rank's sums."""
    ranks, store = len(contributions), dist.HashStore()

    def rank_sum(rank: int) -> list[torch.Tensor]:
        group = dist.ProcessGroupGloo(store, rank, ranks, datetime.timedelta(seconds=30))
        params = [nn.Parameter(torch.zeros_like(values)) for values in contributions[rank]]
        for param, values in zip(params, contributions[rank]):
            param.grad = values.clone()
        exchange = QuantizedSum(params, precision)
        exchange.start(group)
        exchange.finish(lambda work: work.wait())
        return [param.grad for param in params]

    with ThreadPoolExecutor(ranks) as pool:
        return list(pool.map(rank_sum, range(ranks)))


@pytest.mark.parametrize("precision, bound", [("int4", 0.2), ("fp8", 0.06)])
def test_the_sum_over_three_ranks_is_the_same_bytes_on_each_and_near_the_exact_sum(precision, bound):
    generator = torch.Generator().manual_seed(2)
    shapes = [(7, 33), (5,), (130,)]  # 366 values: not a whole number of blocks for three owners
    contributions = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(3)]
    sums = sum_on_ranks(precision, contributions)
    for other in sums[1:]:
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(sums[0], other))
    exact = torch.cat([sum(parts).reshape(-1) for parts in zip(*contributions)])
    got = torch.cat([part.reshape(-1) for part in sums[0]])
    assert 0 < (got - exact).norm() / exact.norm() <= bound


def test_a_rank_hands_its_codes_and_its_owned_blocks_sum_under_a_fifth_of_fp32s_at_int4():
    param = nn.Parameter(torch.zeros(3 * 4096))
    exchange = QuantizedSum([param], "int4")
    per_value = exchange.handed_bytes(3) / param.numel()
    assert per_value == pytest.approx((0.5 + 4 / BLOCK) * (1 + 1 / 3)) and per_value < 4 / 5
    assert QuantizedSum([param], "fp8").handed_bytes(3) / param.numel() == pytest.approx((1 + 4 / BLOCK) * (1 + 1 / 3))
