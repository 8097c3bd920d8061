"""The parallel layout has one owner, ``elastic.core.topology.Topology``: no other module
computes a formula over the layout's degrees (``ranks_per_group`` and the like), each reads it
from the owner. Read from the source with ``ast``, importing nothing, like ``test_imports``."""

import ast
from pathlib import Path

from elastic.core.topology import Topology

ROOT = Path(__file__).parents[1]
PACKAGES = ("elastic", "workers", "checkpointing", "bench")
OWNER = ROOT / "elastic" / "core" / "topology.py"
DEGREES = {"pp", "shard", "cp", "tp", "ep"}
# The at-scale simulation models other jobs' groups (docs/presets.md's rows), not a run's
# layout: its shapes are its own (issue 69 leaves them to it).
ELSEWHERE = {ROOT / "elastic" / "simulation" / "designs.py"}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _factors(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _factors(node.left) + _factors(node.right)
    return [node]


def layout_products(source: str, path: str = "<source>") -> list[tuple[int, list[str]]]:
    """Each product of the layout's degrees alone (``pp * shard * cp * tp``, ``self.shard * self.cp``)
    in ``source``, by line: the whole of each chain of multiplications, none of its parts."""
    tree = ast.parse(source, path)
    inner = {id(node.left) for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and id(node) not in inner:
            names = [_name(factor) for factor in _factors(node)]
            if all(name in DEGREES for name in names):
                found.append((node.lineno, names))
    return found


def test_the_check_sees_a_product_of_degrees_however_spelled():
    assert layout_products("a = pp * shard * cp * tp") == [(1, ["pp", "shard", "cp", "tp"])]
    assert layout_products("a = self.pipeline.pp * self.shard") == [(1, ["pp", "shard"])]
    assert layout_products("a = micro_batch * shard * pp") == []  # a batch, not the layout
    assert layout_products("a = 2 * cp") == []


def test_no_module_but_the_owner_computes_a_layout_formula():
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == OWNER or path in ELSEWHERE:
                continue
            products = layout_products(path.read_text(), str(path))
            if products:
                found[str(path.relative_to(ROOT))] = products
    assert not found, f"read these from elastic.core.topology.Topology instead: {found}"


def test_only_the_owner_defines_the_ranks_of_a_group():
    """Others may name it (``RankSpec.ranks_per_group``), returning the owner's."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == OWNER:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef) and node.name == "ranks_per_group":
                    returns = [statement for statement in node.body if isinstance(statement, ast.Return)]
                    assert len(returns) == 1 and _name(returns[0].value) == "ranks_per_group", (
                        f"{path.relative_to(ROOT)}:{node.lineno} computes ranks_per_group; return the Topology's"
                    )


def test_the_record_names_every_degree_with_ep():
    layout = Topology(shard=4, tp=2, max_groups=3, pp=2, ep=2, cp=1)
    assert layout.record() == {"pp": 2, "shard": 4, "cp": 1, "tp": 2, "ep": 2, "max_groups": 3}
    assert layout.ranks_per_group == 16 and layout.fsdp_ranks == 8 and layout.expert_parallel


def test_the_mesh_names_its_dimensions_and_the_flattened_ones():
    assert Topology(shard=2, tp=2, pp=2).mesh_shape() == ((2, 2, 2), ("pp", "shard", "tp"), {})
    assert Topology(shard=2, tp=1, cp=2).mesh_shape() == (
        (1, 2, 2, 1), ("pp", "shard", "cp", "tp"), {"shard_cp": ("shard", "cp")})
    assert Topology(shard=4, tp=1, ep=2).mesh_shape() == (
        (1, 2, 2, 1), ("pp", "expert_shard", "ep", "tp"), {"shard": ("expert_shard", "ep")})
    # ep == shard: the mesh of ep == 1; the layout tells them apart
    at_shard, unsplit = Topology(shard=2, tp=1, ep=2), Topology(shard=2, tp=1)
    assert at_shard.mesh_shape() == unsplit.mesh_shape()
    assert at_shard.expert_parallel and not unsplit.expert_parallel


def test_the_config_builds_the_layout_the_default_parallelize_reads():
    from elastic.setup.config import parse_config
    from elastic.setup.hooks import default_parallelize

    config = parse_config({"scaling": {"shard": 2, "tp": 1, "ep": 2}, "model": {"experts": 4}})
    assert config.scaling.topology == Topology(shard=2, tp=1, max_groups=config.scaling.max_groups, ep=2)
    assert default_parallelize(config).splits_experts
    assert not default_parallelize(parse_config({"scaling": {"shard": 2, "tp": 1}})).splits_experts
