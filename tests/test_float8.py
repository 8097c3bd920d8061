"""``compute.float8``: torchao's float8 training, applied before TP and FSDP2 as TorchTitan does.

torchao's float8 matmul has a CPU implementation, so the composition runs here on real gloo
groups: four processes train the reference model at ``shard 2 x tp 2`` (with and without
sequence parallelism) converted to float8. Every block's linear layer is a ``Float8Linear``
sharded by TP and FSDP2, the output projection is not, and the losses track the same
model's in fp32 within float8's precision while they fall. A run on CPU ranks is refused
before any actor starts; float8's speed is a GPU figure (``bench/gpu_check.py --only float8``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from elastic import ElasticTrainer
from elastic.setup.errors import ConfigError
from elastic.testing.gloo_ranks import gloo_ranks
from tests.tiny import tiny_config
from workers.model import ModelArgs, Transformer
from workers.parallelize import Parallelize

pytest.importorskip("torchao")

ARGS = ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32)
WORLD = 4
STEPS = 5  # enough for the losses to fall by a sixth: a step of four float8 ranks takes seconds on CPU


def batch() -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (8, 33), generator=torch.Generator().manual_seed(3))


def train(model: torch.nn.Module) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, losses = batch(), []
    for _ in range(STEPS):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def float8_rank(rank: int) -> dict[bool, tuple[list[str], bool, list[float]]]:
    """Both layouts in one set of processes (without and with sequence parallelism): each
    start of four ranks imports torch and torchao again, seconds of the suite."""
    from torchao.float8.float8_linear import Float8Linear

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
    layouts = {}
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        model = Parallelize(float8=True, sequence_parallel=sequence_parallel)(Transformer(ARGS), mesh)
        converted = sorted(name for name, module in model.named_modules() if isinstance(module, Float8Linear))
        sharded = all(isinstance(module.weight, DTensor) and module.weight.device_mesh.ndim == 2
                      for module in model.modules() if isinstance(module, Float8Linear))
        layouts[sequence_parallel] = converted, sharded, train(model)
    return layouts


def test_float8_linears_shard_under_tp_and_fsdp2_and_train_as_fp32_does(tmp_path):
    torch.manual_seed(0)
    reference = train(Transformer(ARGS))
    answers = gloo_ranks(float8_rank, WORLD, str(tmp_path / "init"), wait_s=180)
    blocks = [f"layers.{layer}.{name}" for layer in range(ARGS.n_layers)
              for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    for sequence_parallel in (False, True):
        converted, sharded, losses = answers[0][sequence_parallel]
        assert converted == sorted(blocks), sequence_parallel  # every block's linear, never the output projection
        assert sharded, sequence_parallel
        assert all(answer[sequence_parallel][2] == losses for answer in answers)  # every rank, the same loss
        assert losses[-1] < 0.85 * losses[0], sequence_parallel
        # float8's e4m3 keeps 3 mantissa bits: the losses follow fp32's to within a few per cent.
        for got, expected in zip(losses, reference):
            assert got == pytest.approx(expected, rel=0.04), sequence_parallel
        assert losses != reference, sequence_parallel  # the matmuls did run in float8


def test_float8_on_cpu_ranks_is_refused_before_any_actor_starts(ray_cluster, tmp_path):
    with pytest.raises(ConfigError, match=r"compute.float8: the ranks train on CPU .* set compute.float8 = false"):
        ElasticTrainer(tiny_config(tmp_path, compute__float8=True, scaling__device="cpu")).fit()
