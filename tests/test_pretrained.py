"""``model.init_from``: a run starts from a HuggingFace Llama checkpoint's weights.

- On real gloo groups and no Ray: four processes shard the reference model ``shard 2 x tp
  2`` (FSDP2 over TP) and load a checkpoint's weights, each rank reading only its slices
  (under a third of the checkpoint's bytes); the whole model gathered back equals the model
  the checkpoint was written from.
- The config: the model fields come from ``config.json``; a field given that differs is
  refused before anything starts, naming it; a directory that is not a Llama checkpoint is
  refused naming what is missing.
- On Ray: a run from a checkpoint trains its first step from those weights (its loss is the
  checkpoint's own on that batch), and its resume reads its own checkpoints, not the source.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from checkpointing.huggingface import INDEX_NAME, layout_of
from checkpointing.pretrained import PretrainedSource, load_pretrained
from checkpointing.storage import StorageOptions
from elastic import ElasticTrainer
from elastic.export import huggingface_model, model_state
from elastic.setup.errors import ConfigError
from elastic.setup.hooks import model_args
from elastic.testing.gloo_ranks import gloo_ranks
from tests.tiny import tiny_config
from workers.model import ModelArgs, RopeScaling, Transformer
from workers.model_build import first_model
from workers.parallelize import Parallelize

ARGS = ModelArgs(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32,
                 rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0, original_max_len=16))
WORLD = 4


def write_checkpoint(directory, args: ModelArgs = ARGS, sharded: bool = False) -> dict[str, torch.Tensor]:
    """A HuggingFace Llama directory of a seeded model; returns the model's own state."""
    torch.manual_seed(11)
    state = Transformer(args).state_dict()
    weights, config = huggingface_model(state, args)
    os.makedirs(directory, exist_ok=True)
    if sharded:  # two files and their index, as large checkpoints come
        names = sorted(weights)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, part in halves.items():
            save_file({name: weights[name].contiguous() for name in part}, os.path.join(directory, file))
        index = {"weight_map": {name: file for file, part in halves.items() for name in part}}
        (directory / INDEX_NAME).write_text(json.dumps(index))
    else:
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return state


def loading_rank(rank: int, directory: str, args: ModelArgs = ARGS) -> tuple[dict[str, torch.Tensor], int]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
    read = []
    # As a rank builds: on the meta device, sharded, then allocated and read slice by slice.
    model, _ = first_model(lambda: Transformer(args), lambda model: (Parallelize()(model, mesh), []),
                           torch.device("cpu"), lambda model: read.append(load_pretrained(
                               model, PretrainedSource(directory, layout_of(args)), StorageOptions(),
                               dist.group.WORLD)))
    whole = {name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
             for name, tensor in model.state_dict().items()}
    torch.testing.assert_close(model.freqs, Transformer(args).freqs, rtol=0, atol=0)  # computed again
    return whole, read[0]


def test_fsdp_and_tp_ranks_load_their_slices_of_a_sharded_huggingface_checkpoint(tmp_path):
    expected = write_checkpoint(tmp_path / "llama", sharded=True)  # one file: the run below
    for whole, read in gloo_ranks(loading_rank, WORLD, str(tmp_path / "init"), str(tmp_path / "llama")):
        assert whole.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(whole[name], tensor, rtol=0, atol=0, msg=name)
        # A quarter of the matrices (FSDP2 over TP), half of the norms (replicated over TP), and
        # the query and key rows of whole heads: the share a rank reads falls with the ranks.
        assert read <= 0.3 * sum(tensor.nbytes for tensor in expected.values()), read


def tiny_qwen3(transformers):
    """Qwen3's own heads: wider than hidden_size / heads, a norm on each head's query and key."""
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64))


def tiny_qwen3_moe(transformers):
    """Qwen3-MoE's own shape: Qwen3's heads, a dense first layer, experts narrower than it,
    weights normalised over the chosen."""
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[0], norm_topk_prob=True, max_position_embeddings=64))


def as_trained(model):
    """``model`` with every parameter drawn at random, as training leaves it: transformers
    starts each norm's weight at ones, where a weight read in the wrong order changes nothing."""
    generator = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for parameter in model.parameters():
            drawn = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.5 * drawn if parameter.dim() == 1 else 0.1 * drawn)  # the norms' around one
    return model


def assert_computes_the_same(theirs, ours: Transformer, tokens: torch.Tensor) -> None:
    """A transformers model and the reference model: the same logits, so the same loss."""
    with torch.no_grad():
        expected, logits = theirs(tokens[:, :-1]).logits, ours(tokens[:, :-1])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    targets = tokens[:, 1:].flatten()
    loss, expected_loss = (torch.nn.functional.cross_entropy(out.flatten(0, 1), targets) for out in (logits, expected))
    assert abs(loss - expected_loss) <= 1e-6 * expected_loss


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process reads it: the point
@pytest.mark.parametrize("family", [tiny_qwen3, tiny_qwen3_moe], ids=["qwen3", "qwen3-moe"])
def test_a_trained_qwen3_loads_as_the_model_transformers_computes_and_exports_as_itself(tmp_path, family):
    """Every weight drawn, the query-key norms' included: read into the reference model at one
    rank it computes transformers' logits; read at shard 2 x tp 2 each rank holds that
    model's slices; exported, transformers computes the reference model's logits."""
    transformers = pytest.importorskip("transformers")
    source = tmp_path / "source"
    theirs = as_trained(family(transformers)).eval()
    theirs.save_pretrained(source)
    args = model_args(tiny_config(tmp_path, model__init_from=str(source)))
    ours = Transformer(args)
    load_pretrained(ours, PretrainedSource(str(source), layout_of(args)), StorageOptions(), None)
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len + 1), generator=torch.Generator().manual_seed(3))
    assert_computes_the_same(theirs, ours, tokens)
    for whole, _ in gloo_ranks(loading_rank, WORLD, str(tmp_path / "init"), str(source), args):
        for name, tensor in ours.state_dict().items():
            torch.testing.assert_close(whole[name], tensor, rtol=0, atol=0, msg=name)
    weights, config = huggingface_model(ours.state_dict(), args)
    exported = tmp_path / "exported"
    exported.mkdir()
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, exported / "model.safetensors")
    (exported / "config.json").write_text(json.dumps(config))
    assert_computes_the_same(transformers.AutoModelForCausalLM.from_pretrained(exported), ours, tokens)


def unloadable_rank(rank: int, directory: str) -> str:
    from checkpointing.pretrained import PretrainedUnloadable

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("shard", "tp"))
    layout = layout_of(ARGS)
    try:
        first_model(lambda: Transformer(ARGS), lambda model: (Parallelize()(model, mesh), []), torch.device("cpu"),
                    lambda model: load_pretrained(model, PretrainedSource(directory, layout), StorageOptions(),
                                                  dist.group.WORLD))
    except PretrainedUnloadable as error:  # an Exception: the rank reports it as its own, not a peer's
        return str(error)
    return "loaded"


def test_weights_that_do_not_load_on_the_ranks_are_the_weights_error_on_every_rank(tmp_path):
    """Past preflight (a file changed since), DCP gathers one rank's failure into a
    ``CheckpointException`` on every rank, a BaseException that escaped the rank's build as no
    error of its own: the group was rebuilt on the same processes a hundred times."""
    from safetensors.torch import load_file

    write_checkpoint(tmp_path / "llama")
    weights = load_file(tmp_path / "llama" / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:128].contiguous()
    save_file(weights, tmp_path / "llama" / "model.safetensors")
    for line in gloo_ranks(unloadable_rank, 2, str(tmp_path / "init"), str(tmp_path / "llama")):
        assert line.startswith(f"{tmp_path / 'llama'} does not load: ValueError: Size mismatch"), line
        assert "\n" not in line


def test_the_model_fields_come_from_the_checkpoints_config(tmp_path):
    write_checkpoint(tmp_path / "llama")
    config = tiny_config(tmp_path, model__init_from=str(tmp_path / "llama"))
    model = config.model
    assert (model.dim, model.n_layers, model.n_heads, model.kv_heads, model.ffn_hidden, model.vocab_size) == (
        32, 2, 4, 2, 64, 256)
    assert model.rope_theta == 500000.0 and model.rope_scaling.factor == 8.0
    assert model.rope_scaling.original_max_len == 16


def test_a_model_field_that_differs_from_the_checkpoints_is_refused_naming_it(tmp_path):
    write_checkpoint(tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"model: ffn_hidden 128 \(the source's 64\) differ from "
                                          r"model.init_from's model; leave them out"):
        tiny_config(tmp_path, model__init_from=str(tmp_path / "llama"), model__ffn_hidden=128)


def test_a_directory_that_is_not_a_llama_checkpoint_is_refused_naming_what_it_lacks(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="model.init_from: .*empty: .*config.json"):
        tiny_config(tmp_path, model__init_from=str(tmp_path / "empty"))
    write_checkpoint(tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type is 'gpt2': only 'llama', 'mixtral', 'qwen3', 'qwen3_moe' "):
        tiny_config(tmp_path, model__init_from=str(tmp_path / "other"))


def edited_copy(source, directory, *, index=None, config=None, text=None, tensor=None):
    """A copy of the HuggingFace directory ``source`` with its index or config.json replaced,
    a file's contents replaced by ``text`` (name -> contents), or its tensors changed by
    ``tensor`` (name, tensor -> tensor)."""
    from safetensors.torch import load_file

    shutil.copytree(source, directory)
    if index is not None:
        (directory / INDEX_NAME).write_text(json.dumps(index))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    for name, contents in (text or {}).items():
        (directory / name).write_text(contents)
    for shard in directory.glob("*.safetensors") if tensor is not None else ():
        weights = load_file(shard)
        save_file({name: tensor(name, value).contiguous() for name, value in weights.items()}, shard)
    return directory


def refusal(tmp_path, directory) -> str:
    """The one line a run from ``directory`` is refused with, before Ray or any rank starts."""
    with pytest.raises(ConfigError) as refused:
        ElasticTrainer(tiny_config(tmp_path, model__init_from=str(directory)))
    return str(refused.value)


def test_weights_that_cannot_load_are_refused_in_one_line_before_any_actor_starts(tmp_path):
    """What an attacker or a broken download gives: an index that names files that are not
    there or lie outside the directory, or is not a map; a config.json of the wrong kinds; a
    tensor of the wrong shape or stored as integers. Each is the weights' own error, never a
    rank's to retry."""
    source = tmp_path / "llama"
    write_checkpoint(source, sharded=True)
    weight_map = json.loads((source / INDEX_NAME).read_text())["weight_map"]
    config = json.loads((source / "config.json").read_text())
    embedding = "model.embed_tokens.weight"
    edits = {
        "a file that is not there": ({"index": {"weight_map": {**weight_map, embedding: "gone.safetensors"}}},
                                     "names 'gone.safetensors', which is not a file in the model directory"),
        "a path out of the directory": ({"index": {"weight_map": {**weight_map, embedding: "../../etc/passwd"}}},
                                        "names '../../etc/passwd', outside the model directory: refused"),
        "an absolute path": ({"index": {"weight_map": {**weight_map, embedding: "/etc/passwd"}}},
                             "names '/etc/passwd', outside the model directory: refused"),
        "a device": ({"index": {"weight_map": {**weight_map, embedding: "/dev/zero"}}},
                     "names '/dev/zero', outside the model directory: refused"),
        "numbers for files": ({"index": {"weight_map": dict.fromkeys(weight_map, 1)}},
                              "has no weight_map of tensor names to file names"),
        "no weight map": ({"index": {"metadata": {}}}, "has no weight_map"),
        "a list for an index": ({"index": [1, 2]}, "has no weight_map"),
        "a list for a config": ({"config": [1]}, "config.json holds a list, not a JSON object"),
        "a width as text": ({"config": {**config, "hidden_size": "32"}},
                            "hidden_size is '32' in config.json; it must be a positive integer"),
        "no heads": ({"config": {**config, "num_attention_heads": 0}}, "num_attention_heads is 0 in config.json"),
        # Each field the loader reads, of a kind it is not: a line naming it, not a traceback.
        "a config nested deeper than Python recurses": ({"text": {"config.json": "[" * 100_000}},
                                                        "config.json nests its arrays or objects too deeply to read"),
        "an index nested deeper than Python recurses": ({"text": {INDEX_NAME: '{"weight_map": ' + "[" * 100_000}},
                                                        f"{INDEX_NAME} nests its arrays or objects too deeply"),
        "a config that is not JSON": ({"text": {"config.json": "{"}}, "config.json is not JSON: Expecting"),
        "an epsilon as a list": ({"config": {**config, "rms_norm_eps": [1e-5]}},
                                 r"rms_norm_eps is \[1e-05\] in config.json; it must be a positive number"),
        "a null epsilon": ({"config": {**config, "rms_norm_eps": None}},
                           "rms_norm_eps is None in config.json; it must be a positive number"),
        "an infinite base": ({"config": {**config, "rope_theta": float("inf")}},
                             "rope_theta is inf in config.json; it must be a positive number"),
        "a RoPE scaling as text": ({"config": {**config, "rope_scaling": "llama3"}},
                                   "rope_scaling is 'llama3' in config.json; it must be a JSON object or null"),
        "a RoPE factor as text": ({"config": {**config, "rope_scaling": {**config["rope_scaling"], "factor": "8"}}},
                                  "rope_scaling.factor is '8' in config.json; it must be a positive number"),
        "no RoPE length": ({"config": {**config, "rope_scaling": {
                               **config["rope_scaling"], "original_max_position_embeddings": None}}},
                           "no 'rope_scaling.original_max_position_embeddings' in config.json"),
        "tying as text": ({"config": {**config, "tie_word_embeddings": "false"}},
                          "tie_word_embeddings is 'false' in config.json; it must be true or false"),
        "a model type as a list": ({"config": {**config, "model_type": ["llama"]}},
                                   r"model_type is \['llama'\]: only 'llama', 'mixtral'"),
        "a dropout as text": ({"config": {**config, "attention_dropout": "0.1"}},
                              "attention_dropout is '0.1' in config.json; it must be a number, zero or more"),
        "biases the model lacks": ({"config": {**config, "mlp_bias": True}},
                                   "the reference model does not compute config.json's mlp_bias=True"),
        "integers": ({"tensor": lambda name, value: value.to(torch.int64)}, "is stored as I64, not a floating-point"),
        "a doubled shape": ({"tensor": lambda name, value: value.half().repeat(2, *[1] * (value.dim() - 1))},
                            r"is \[\d+(, \d+)?\] in the source, the model needs"),
        "a short embedding": ({"tensor": lambda name, value: value[:128] if name == embedding else value},
                              r"tok_embeddings.weight is \[128, 32\] in the source, the model needs \[256, 32\] "
                              r"\(vocab_size 256"),
    }
    for what, (edit, expected) in edits.items():
        line = refusal(tmp_path, edited_copy(source, tmp_path / what.replace(" ", "-"), **edit))
        assert re.search(expected, line) and "\n" not in line, (what, line)
        assert line.startswith("invalid config: model.init_from: "), (what, line)


MIXTRAL = ModelArgs(**{**asdict(ARGS), "rope_scaling": None, "experts": 4})


def test_a_sources_training_time_settings_are_told_at_start_in_one_warning_line_each(tmp_path, caplog):
    """Dropout on the attention weights and Mixtral's router jitter are training's alone (the
    weights compute the same without them), and the reference model has neither: the run
    goes on without them, and says so naming the field."""
    llama, mixtral = tmp_path / "llama", tmp_path / "mixtral"
    write_checkpoint(llama)
    write_checkpoint(mixtral, MIXTRAL)
    config = json.loads((mixtral / "config.json").read_text())
    tiny_config(tmp_path, model__init_from=str(mixtral))  # as exported: nothing to tell
    assert not caplog.records
    edited = edited_copy(mixtral, tmp_path / "jitter",
                         config={**config, "attention_dropout": 0.1, "router_jitter_noise": 0.01})
    tiny_config(tmp_path, model__init_from=str(edited))
    assert [(record.name, record.levelname, record.getMessage()) for record in caplog.records] == [
        ("elastic", "WARNING", "config.json's attention_dropout=0.1 is not applied: this trainer trains without "
                               "dropout on the attention weights (model.dropout drops the embeddings and residual "
                               "branches)"),
        ("elastic", "WARNING", "config.json's router_jitter_noise=0.01 is not applied: this trainer routes tokens "
                               "without jitter")]
    caplog.clear()
    # Llama's config.json may hold a null dropout (transformers' own type allows it): none.
    config = json.loads((llama / "config.json").read_text())
    tiny_config(tmp_path, model__init_from=str(edited_copy(llama, tmp_path / "null", config={
        **config, "attention_dropout": None})))
    assert not caplog.records


def test_expert_parallelism_over_a_dense_source_is_refused_naming_scaling_ep(tmp_path):
    """The source's fields come in at preflight: a dense one leaves ep ranks nothing to split."""
    write_checkpoint(tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"^invalid config: scaling.ep=2 with model.experts = 0: a dense model has "
                                          r"no experts to split; set scaling.ep = 1, or start from a mixture of "
                                          r"experts \(model.init_from\)$"):
        tiny_config(tmp_path, shard=2, scaling__ep=2, model__init_from=str(tmp_path / "llama"))
    write_checkpoint(tmp_path / "mixtral", MIXTRAL)
    config = tiny_config(tmp_path, shard=2, scaling__ep=2, model__init_from=str(tmp_path / "mixtral"))
    assert (config.scaling.ep, config.model.experts) == (2, 4)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process reads it: the point
def test_weights_that_are_not_finite_are_refused_as_they_load_naming_the_tensor_and_its_file(tmp_path):
    """A NaN or an infinity in any tensor would spread to every weight in the first step, and
    be trained on and exported: each rank checks the slices it reads. A plain weight, and a
    query projection's, read in the other rotary order."""
    from checkpointing.pretrained import PretrainedUnloadable

    source = tmp_path / "llama"
    write_checkpoint(source, sharded=True)
    layout = layout_of(ARGS)
    bad = {"model.layers.1.mlp.down_proj.weight": float("nan"), "model.layers.0.self_attn.q_proj.weight": float("inf")}
    for name, value in bad.items():
        def spoiled(theirs, tensor):
            return tensor.index_fill(0, torch.tensor([3]), value) if theirs == name else tensor

        directory = edited_copy(source, tmp_path / name, tensor=spoiled)
        file = json.loads((directory / INDEX_NAME).read_text())["weight_map"][name]
        with pytest.raises(PretrainedUnloadable, match=rf"^{directory} does not load: ValueError: '{name}' in {file} "
                                                       "holds NaN or infinite values; download the checkpoint again"):
            load_pretrained(Transformer(ARGS), PretrainedSource(str(directory), layout), StorageOptions(), None)


def first_batch_loss_of(logits_of, config) -> float:
    """The loss of the model ``logits_of`` (tokens -> logits) on the batch the run trains first."""
    from elastic.core.data_plan import DataCursor, epoch_order
    from elastic.setup.hooks import resolve_hooks

    dataset = resolve_hooks(config).dataset
    order = epoch_order(len(dataset), config.seed, DataCursor().epoch)
    tokens = torch.stack([dataset[int(i)] for i in order[:config.global_batch]])
    with torch.no_grad():
        logits = logits_of(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()


def first_batch_loss(state: dict[str, torch.Tensor], config) -> float:
    """The first step's loss of the model in ``state``, on the batch the run trains first."""
    model = Transformer(model_args(config))
    model.load_state_dict(state)
    return first_batch_loss_of(model, config)


def exports_back_bit_for_bit(run_dir: str, source, output) -> None:
    """``elastic export --format huggingface`` of the run gives back every tensor of ``source``."""
    from safetensors.torch import load_file

    from elastic.cli import main

    assert main(["export", run_dir, "--output", str(output), "--format", "huggingface"]) == 0
    exported, original = load_file(output / "model.safetensors"), load_file(source / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], original[name]) for name in original)


def test_a_run_starts_from_the_checkpoints_weights_and_resumes_from_its_own(ray_cluster, tmp_path):
    expected = write_checkpoint(tmp_path / "llama")
    config = tiny_config(tmp_path, shard=2, steps=2, checkpoint__every=2, model__init_from=str(tmp_path / "llama"))
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    assert result.losses[0] == pytest.approx(first_batch_loss(expected, config), rel=1e-5)
    started_from = result.summary["init_from"]
    assert sorted(started_from) == ["config.json", "model.safetensors"]
    resume = tiny_config(tmp_path, shard=2, steps=3, checkpoint__every=2, model__init_from=str(tmp_path / "llama"))
    # Other weights under the source's name: the resume is refused, naming the file.
    torch.manual_seed(5)
    weights, _ = huggingface_model(Transformer(ARGS).state_dict(), ARGS)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, tmp_path / "llama" / "model.safetensors")
    with pytest.raises(ConfigError, match=r"model.init_from changed since the run started from it: "
                                          r"model.safetensors: .* bytes, sha256"):
        ElasticTrainer(resume).fit()
    # The source gone, the run goes on from its own checkpoint of step 2, and records what it started from.
    os.remove(tmp_path / "llama" / "model.safetensors")
    resumed = ElasticTrainer(resume).fit()
    assert resumed.ok, resumed.exit
    assert resumed.summary["resumed_from_step"] == 2 and len(resumed.losses) == 1
    assert resumed.summary["init_from"] == started_from


def test_a_custom_model_with_init_from_is_refused_before_any_actor_starts(tmp_path):
    write_checkpoint(tmp_path / "llama")
    config = tiny_config(tmp_path, model__init_from=str(tmp_path / "llama"))
    with pytest.raises(ConfigError, match="model.init_from = .* loads Llama weights into the reference model"):
        ElasticTrainer(config, model_fn=lambda: Transformer(ARGS)).fit()


def test_a_run_starts_from_another_runs_checkpoint_its_weights_only(ray_cluster, tmp_path):
    source = ElasticTrainer(tiny_config(tmp_path, run_name="source", steps=2, checkpoint__every=2)).fit()
    assert source.ok, source.exit
    config = tiny_config(tmp_path, run_name="tuned", shard=2, steps=1, model__init_from=source.run_dir)
    assert config.model.init_from == f"{source.run_dir}@2"  # the newest checkpoint, pinned for the resume
    weights = model_state(f"{source.run_dir}/checkpoints/step-00000002", StorageOptions())
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    # Weights only: the run's own first batch (its cursor starts fresh) through the source's model
    assert result.losses[0] == pytest.approx(first_batch_loss(weights, config), rel=1e-5)
    assert list(result.summary["init_from"]) == ["manifest.json"]  # it holds every file's sha256
    with pytest.raises(ConfigError, match=r"model: dim 64 \(the source's 32\) differ"):
        tiny_config(tmp_path, run_name="other", model__init_from=source.run_dir, model__dim=64)
    with pytest.raises(ConfigError, match=r"model.init_from: .*@7: .*step 7"):
        tiny_config(tmp_path, run_name="other", model__init_from=f"{source.run_dir}@7")
    # A manifest whose model was edited: the checkpoint's own metadata gives the tensors' shapes.
    tampered = tmp_path / "tampered"
    shutil.copytree(source.run_dir, tampered)
    manifest_path = tampered / "checkpoints" / "step-00000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["config"]["model"]["dim"] = 64
    manifest_path.write_text(json.dumps(manifest))
    config = tiny_config(tmp_path, run_name="other", model__dim=64, model__init_from=str(tampered))
    with pytest.raises(ConfigError, match=r"model.init_from: .*tok_embeddings.weight is \[256, 32\] in the source, "
                                          r"the model needs \[256, 64\]"):
        ElasticTrainer(config)


def test_a_tiny_llama_saved_by_transformers_trains_from_its_loss_and_exports_back_bit_for_bit(ray_cluster, tmp_path):
    """GQA, RoPE base 500000 and Llama 3.1's scaling, saved with save_pretrained; started at
    shard 2 x tp 2, the first step's loss is transformers' own on that batch, and after steps
    that change nothing (SGD at learning rate 0) the export gives back the source's tensors."""
    transformers = pytest.importorskip("transformers")
    source = tmp_path / "hf-llama"
    torch.manual_seed(5)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=64, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}))
    llama.save_pretrained(source)
    config = tiny_config(tmp_path, shard=2, tp=2, steps=2, checkpoint__every=2, model__init_from=str(source))
    assert (config.model.n_kv_heads, config.model.rope_theta, config.model.rope_scaling.factor) == (2, 500000.0, 8.0)
    result = ElasticTrainer(config, optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.0)).fit()
    assert result.ok, result.exit
    expected = first_batch_loss_of(lambda tokens: llama(tokens).logits, config)
    assert abs(result.losses[0] - expected) <= 1e-4 * expected
    exports_back_bit_for_bit(result.run_dir, source, tmp_path / "out")
