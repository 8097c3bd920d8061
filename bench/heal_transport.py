"""The heal's copy of a rank's state from its peer, by three roads between two actors: rank
to rank over a gloo pair group, as the product heals (``RayFleet.copy_state``: the source's
``send_state`` streams its committed state in checked buckets to the target's
``receive_state``, ``workers.state_transfer``); through the object store, the product's
fallback and its road before (``import_state.remote(export_state.remote())``, the state copied
to host memory by ``checkpointing.healing.export_local_state``); and, on a GPU, device to
device over Ray Direct Transport's CUDA IPC (``tensor_transport="cuda_ipc"``: the receiver
maps the sender's memory and copies from it on the GPU).

Two actors hold the same model (the reference Transformer at ``--dim``/``--layers``) with its
AdamW state; the source's state is copied into the target by each road, ``--repeats`` times in
turn, and the target's state is checked equal to the source's after each. Prints each road's
seconds and GB/s (the state's bytes over the copy's wall time, from the driver's calls to
their answers), and each road's time over the object store's.

On CPU (``--device cpu``) the rank-to-rank road runs against the object store (CUDA IPC needs
a GPU). Gloo sends host memory only, so on a GPU that road copies each bucket through the host.

    python bench/heal_transport.py --device cuda              # the 1.23 B shape: 14.7 GB of state
    python bench/heal_transport.py --device cpu --dim 640 --layers 5   # 0.30 GB of state
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


@ray.remote
class StateHolder:
    """A rank's model and AdamW state on its device, as a healed rank and its peer hold them."""

    def __init__(self, dim: int, layers: int, device: str, seed: int):
        from workers.model import ModelArgs, Transformer

        self.device = torch.device(device)
        torch.manual_seed(seed)
        with self.device:
            self.model = Transformer(ModelArgs(vocab_size=256, dim=dim, n_layers=layers, n_heads=16, n_kv_heads=16,
                                               ffn_hidden=dim * 11 // 4, max_seq_len=256))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        for param in self.model.parameters():  # one step: AdamW's moments exist, as a trained rank's do
            param.grad = torch.randn_like(param)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def send_state(self, heal: int, store_port: int) -> int:
        """The product's send (``RankWorker.send_state``): the state as it lies, in buckets."""
        from checkpointing.healing import local_state
        from workers import rng, state_transfer

        group = self._pair(heal, store_port, is_target=False)
        return state_transfer.send_state([group], {**local_state(self.model, self.optimizer),
                                                   "rng": rng.capture(self.device.type == "cuda")})

    def receive_state(self, heal: int, store_port: int) -> float:
        """The product's receive (``RankWorker.receive_state``); the seconds of its load."""
        from workers import state_transfer

        return self.import_state(state_transfer.receive_state(self._pair(heal, store_port, is_target=True)))

    def _pair(self, heal: int, store_port: int, is_target: bool):
        import datetime

        import torch.distributed as dist
        from workers.world import heal_pair

        timeout = datetime.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
        return heal_pair(store, f"heal{heal}", 0, 1, is_target, timeout)

    def state_bytes(self) -> int:
        from workers.memory_tier import state_bytes
        from checkpointing.healing import export_local_state

        return state_bytes(export_local_state(self.model, self.optimizer))

    def export_state(self) -> dict:
        """The product's export: every tensor copied to host memory, for the object store."""
        from checkpointing.healing import export_local_state

        return export_local_state(self.model, self.optimizer)

    @ray.method(tensor_transport="cuda_ipc")
    def export_on_device(self) -> dict:
        """The same state as the device's own tensors (views, no copy): Ray Direct Transport
        sends the receiver their CUDA IPC handles. AdamW's step counts live on the host, and one
        transport carries one device's tensors: they travel as numbers."""
        state = self.optimizer.state_dict()
        return {"model": [param.detach() for param in self.model.parameters()],
                "optimizer": {"state": {index: {key: value.item() if key == "step" else value
                                                for key, value in entry.items()}
                                        for index, entry in state["state"].items()},
                              "param_groups": state["param_groups"]}}

    def import_from_device(self, state: dict) -> float:
        """``import_state`` of what ``export_on_device`` sent: its step counts host tensors
        again, and the moments copied into this process's memory (the optimizer would keep the
        mapped tensors themselves, the peer's memory, as its own)."""
        started = time.perf_counter()
        for entry in state["optimizer"]["state"].values():
            for key, value in entry.items():
                entry[key] = torch.tensor(value) if key == "step" else value.clone()
        return time.perf_counter() - started + self.import_state(state)

    def import_state(self, state: dict) -> float:
        """Loads ``state`` (``checkpointing.healing.import_local_state``): the seconds since
        this call's arguments arrived are the load's alone."""
        from checkpointing.healing import import_local_state

        started = time.perf_counter()
        import_local_state(self.model, self.optimizer, state)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def fingerprint(self) -> list[float]:
        """A sum per tensor, parameters and moments: equal lists, equal states (for this check)."""
        sums = [param.detach().double().sum().item() for param in self.model.parameters()]
        for entry in self.optimizer.state.values():
            sums += [value.double().sum().item() for value in entry.values() if torch.is_tensor(value)]
        return sums

    def perturb(self) -> None:
        """Changes every tensor, so each copy has work to do and its check means something."""
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(1.0)
            for entry in self.optimizer.state.values():
                for value in entry.values():
                    if torch.is_tensor(value) and value.dim() > 0:
                        value.add_(1.0)


def measure(dim: int, layers: int, device: str, repeats: int) -> dict:
    """Seconds of each copy by each road, the state's bytes, and whether every copy arrived whole."""
    gpus = 0.5 if device == "cuda" else 0
    source, target = (StateHolder.options(num_gpus=gpus, num_cpus=1).remote(dim, layers, device, seed)
                      for seed in (0, 1))
    size = ray.get(source.state_bytes.remote())
    print(f"{size / 1e9:.2f} GB of state on each of two actors", flush=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the run's store, as the driver's
    heals = itertools.count()

    def rank_to_rank() -> list:
        heal = next(heals)
        return [source.send_state.remote(heal, store.port), target.receive_state.remote(heal, store.port)]

    roads = {"rank to rank": rank_to_rank,
             "object store": lambda: target.import_state.remote(source.export_state.remote())}
    if device == "cuda":
        roads["CUDA IPC"] = lambda: target.import_from_device.remote(source.export_on_device.remote())
    seconds: dict[str, list[float]] = {road: [] for road in roads}
    whole = True
    for _ in range(repeats):
        for road, copy in roads.items():
            ray.get(target.perturb.remote())
            started = time.perf_counter()
            ray.get(copy())
            seconds[road].append(time.perf_counter() - started)
            whole &= ray.get(target.fingerprint.remote()) == ray.get(source.fingerprint.remote())
            print(f"{road}: {seconds[road][-1]:.3f} s, whole so far: {whole}", flush=True)
    for actor in (source, target):
        ray.kill(actor)
    return {"bytes": size, "seconds": seconds, "whole": whole}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from elastic.fleet.ray_connection import start_local_ray

    start_local_ray(log_to_driver=False, **({"num_gpus": 1} if args.device == "cuda" else {}))
    result = measure(args.dim, args.layers, args.device, args.repeats)
    print(f"state of dim {args.dim}, {args.layers} layers with AdamW: {result['bytes'] / 1e9:.2f} GB; "
          f"every copy arrived whole: {result['whole']}")
    medians = {road: statistics.median(seconds) for road, seconds in result["seconds"].items()}
    for road, median in medians.items():
        print(f"  {road}: median {median:.3f} s, {result['bytes'] / median / 1e9:.2f} GB/s, "
              f"{median / medians['object store']:.2f}x the object store's time")
    return 0 if result["whole"] else 1


if __name__ == "__main__":
    sys.exit(main())
