"""The parallel layout has one owner, ``elastic.core.topology.Topology``: no other module
computes a formula over the layout's degrees (``ranks_per_group`` and the like), each reads it
from the owner. The model's shape likewise has one, ``elastic.core.model_shape.ModelShape`` (below).
Read from the source with ``ast``, importing nothing, like ``test_imports``."""

import ast
from pathlib import Path

from elastic.core.topology import Topology
from tests.python_source import parse

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
    tree = parse(source, path)
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


def findings(check, skip) -> dict:
    """What ``check(source, filename)`` finds in each module of the packages but ``skip``."""
    paths = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")) if path not in skip]
    found = {str(path.relative_to(ROOT)): check(path.read_text(), str(path)) for path in paths}
    return {path: hits for path, hits in found.items() if hits}


def test_no_module_but_the_owner_computes_a_layout_formula():
    found = findings(layout_products, {OWNER, *ELSEWHERE})
    assert not found, f"read these from elastic.core.topology.Topology instead: {found}"


def test_only_the_owner_defines_the_ranks_of_a_group():
    """Others may name it (``RankSpec.ranks_per_group``), returning the owner's."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == OWNER:
                continue
            for node in ast.walk(parse(path.read_text(), str(path))):
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
    names = ("pp", "expert_shard", "ep", "cp", "tp")
    flattened = {"shard": ("expert_shard", "ep"), "shard_cp": ("expert_shard", "ep", "cp")}
    assert Topology(shard=2, tp=2, pp=2).mesh_shape() == ((2, 2, 1, 1, 2), names, flattened)
    assert Topology(shard=2, tp=1, cp=2).mesh_shape() == ((1, 2, 1, 2, 1), names, flattened)
    assert Topology(shard=4, tp=1, ep=2).mesh_shape() == ((1, 2, 2, 1, 1), names, flattened)
    # ep == shard: no longer the mesh of ep == 1
    at_shard, unsplit = Topology(shard=2, tp=1, ep=2), Topology(shard=2, tp=1)
    assert at_shard.mesh_shape() == ((1, 1, 2, 1, 1), names, flattened)
    assert unsplit.mesh_shape() == ((1, 2, 1, 1, 1), names, flattened)


LAYOUTS = [Topology(shard=1, tp=1), Topology(shard=2, tp=2, pp=2), Topology(shard=2, tp=1, cp=2),
           Topology(shard=4, tp=2, ep=2), Topology(shard=2, tp=1, ep=2), Topology(shard=4, tp=1, ep=4, pp=2),
           Topology(shard=8, tp=1, ep=1), Topology(shard=2, tp=2, cp=2, pp=2)]


def test_every_degree_reads_back_from_the_mesh_alone():
    """A parallelize_fn reads each degree from the group's mesh (``mesh[name].size()``), at degree
    1 and at ``ep == shard`` too: the mesh's dimensions, flattened or not, give the layout's
    degrees, the ranks FSDP2 shards over and the group's ranks."""
    for layout in LAYOUTS:
        shape = layout.mesh_shape()
        assert {name: shape.size(name) for name in DEGREES} == layout.degrees(), layout
        assert shape.size("shard_cp") == layout.parameter_shards, layout
        assert shape.size("expert_shard") * shape.size("ep") == layout.shard, layout
        assert shape.size("shard_cp") * shape.size("tp") == layout.fsdp_ranks, layout
        assert shape.size("pp") * shape.size("shard_cp") * shape.size("tp") == layout.ranks_per_group, layout
        assert (shape.size("ep") > 1) == layout.expert_parallel, layout
        assert (shape.size("ep") > 1 and shape.size("expert_shard") == 1) == layout.experts_held_whole, layout


def test_the_mesh_numbers_the_ranks_as_the_layout_does():
    """The mesh's ranks, laid out in its shape, sit at the positions ``position_of`` gives them
    (the shard index split into its block and its place in it)."""
    import itertools

    for layout in LAYOUTS:
        shape = layout.mesh_shape()
        for rank, index in enumerate(itertools.product(*map(range, shape.sizes))):
            at = dict(zip(shape.names, index))
            position = layout.position_of(rank)
            assert (position.pp, position.shard, position.cp, position.tp) == (
                at["pp"], at["expert_shard"] * shape.size("ep") + at["ep"], at["cp"], at["tp"]), (layout, rank)


def test_the_default_parallelize_reads_ep_from_the_mesh_not_the_layout():
    """ep reaches the rank by one road, the group's mesh: ``workers.parallelize`` reads no layout."""
    source = (ROOT / "workers" / "parallelize.py").read_text()
    imported = {node.module for node in ast.walk(parse(source)) if isinstance(node, ast.ImportFrom)}
    assert "elastic.core.topology" not in imported


def test_the_config_builds_the_layout():
    from elastic.setup.config import parse_config

    config = parse_config({"scaling": {"shard": 2, "tp": 1, "ep": 2}, "model": {"experts": 4}})
    assert config.scaling.topology == Topology(shard=2, tp=1, max_groups=config.scaling.max_groups, ep=2)
    assert config.scaling.topology.mesh_shape().size("ep") == 2
    assert parse_config({"scaling": {"shard": 2, "tp": 1}}).scaling.topology.mesh_shape().size("ep") == 1


# The model's shape has one owner too, ``elastic.core.model_shape.ModelShape``: its fields, their
# defaults and bounds, and the rules derived from them. The config's model section is built from
# its fields, ModelArgs is one, and HuggingFace's config.json is read into them and written
# from one: no other class restates the fields with defaults of its own, and no call copies
# them one by one from one record into another.
SHAPE_OWNER = ROOT / "elastic" / "core" / "model_shape.py"


def shape_listings(source: str, path: str = "<source>") -> list[tuple[int, list[str]]]:
    """Each class that declares two or more of the shape's fields with defaults of its own (or as a
    Protocol's properties), and each call that copies three or more of them field by field
    (``dim=model.dim, ...``), by line."""
    from elastic.core.model_shape import SHAPE_FIELDS

    found = []
    for node in ast.walk(parse(source, path)):
        if isinstance(node, ast.ClassDef):
            names = [statement.target.id for statement in node.body
                     if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                     and statement.target.id in SHAPE_FIELDS and statement.value is not None]
            # a Protocol's properties, one per field
            names += [statement.name for statement in node.body if isinstance(statement, ast.FunctionDef)
                      and statement.name in SHAPE_FIELDS and "property" in map(_name, statement.decorator_list)]
            if len(names) >= 2:
                found.append((node.lineno, names))
        elif isinstance(node, ast.Call):
            names = [keyword.arg for keyword in node.keywords if keyword.arg in SHAPE_FIELDS
                     and isinstance(keyword.value, ast.Attribute) and keyword.value.attr == keyword.arg]
            if len(names) >= 3:
                found.append((node.lineno, names))
    return found


def test_the_check_sees_the_shape_restated_however_spelled():
    assert shape_listings("class Args:\n    dim: int = 64\n    n_layers: int = 2\n") == [(1, ["dim", "n_layers"])]
    assert shape_listings("ModelArgs(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, max_seq_len=8)") == [
        (1, ["dim", "n_layers", "n_heads"])]
    assert shape_listings("ModelArgs(dim=64, n_layers=2, n_heads=4)") == []  # a shape's values, not its fields
    assert shape_listings("class Windows:\n    vocab_size: int = 0\n") == []  # one field of its own
    protocol = "class Args(Protocol):\n    @property\n    def dim(self) -> int: ...\n    @property\n    def experts(self): ..."
    assert shape_listings(protocol) == [(1, ["dim", "experts"])]


def test_no_module_but_the_owner_restates_the_model_shape():
    found = findings(shape_listings, {SHAPE_OWNER})
    assert not found, f"read these from elastic.core.model_shape.ModelShape instead: {found}"


def test_the_config_the_model_and_huggingface_read_the_owners_fields():
    from dataclasses import fields

    from checkpointing.huggingface import model_fields
    from elastic.core.model_shape import SHAPE_FIELDS, ModelShape
    from elastic.setup.config import ModelConfig
    from workers.model import ModelArgs

    section = ModelConfig()
    assert set(ModelConfig.model_fields) == {*SHAPE_FIELDS, "max_position_embeddings", "init_from", "preset"}
    assert section.shape == ModelShape()  # the same defaults
    assert [spec.name for spec in fields(ModelArgs)] == [*SHAPE_FIELDS, "max_seq_len"]
    qwen3_moe = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 16, "mlp_only_layers": [0]}
    assert set(model_fields(qwen3_moe)) <= {*SHAPE_FIELDS, "max_position_embeddings"}
