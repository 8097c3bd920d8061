"""``elastic export``: a run sharded over FSDP and tensor parallelism comes out as one
safetensors file that the reference Transformer, and HuggingFace's Llama, load on one device
and compute the run's own held-out loss with; a fine-tune with its source's token ids,
generation config and tokenizer; never written through a link in the output directory."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from elastic import ElasticTrainer
from elastic.cli import main
from elastic.export import export_checkpoint, implied_tokenizer
from elastic.setup.errors import ConfigError
from elastic.setup.hooks import resolve_hooks
from tests.test_token_data import save_word_tokenizer
from tests.tiny import tiny_config
from workers.model import ModelArgs, Transformer


@pytest.fixture(scope="module")
def trained(ray_cluster, tmp_path_factory):
    """One group of shard 2 by tp 2 with Llama 3.1's RoPE, checkpoints at steps 3 and 6, held-out loss at the end."""
    config = tiny_config(tmp_path_factory.mktemp("export"), shard=2, tp=2, steps=6, checkpoint__every=3, eval__every=6,
                         eval__samples=16, model__n_kv_heads=2, model__rope_theta=500000.0,
                         model__rope_scaling={"factor": 8.0, "original_max_len": 16})  # Llama 3.1's RoPE, as HF reads it
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    return config, result


def held_out_loss(model, config) -> float:
    """The trainer's held-out loss, computed here: every target of the first eval.samples."""
    held_out = resolve_hooks(config).eval_dataset
    tokens = torch.stack([held_out[i] for i in range(min(config.eval.samples, len(held_out)))])
    with torch.no_grad():
        logits = model(tokens[:, :-1])
        logits = getattr(logits, "logits", logits)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).item()


def test_the_native_export_loads_into_the_transformer_and_gives_the_runs_held_out_loss(trained, tmp_path, capsys):
    config, result = trained
    assert main(["export", result.run_dir, "--output", str(tmp_path)]) == 0
    assert "exported step 6" in capsys.readouterr().out
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o044  # readable by others, as the JSON beside it
    model = Transformer(ModelArgs(**json.loads((tmp_path / "model_args.json").read_text())))
    model.load_state_dict(load_file(tmp_path / "model.safetensors"))  # strict: every name, every shape
    assert abs(held_out_loss(model, config) - result.summary["final_eval_loss"]) <= 1e-5


def test_the_huggingface_export_loads_as_llama_with_the_same_logits_and_the_tokenizer_beside_it(trained, tmp_path,
                                                                                               capsys):
    transformers = pytest.importorskip("transformers")
    config, result = trained
    assert main(["export", result.run_dir, "--output", str(tmp_path / "native")]) == 0
    # With the tokenizer the data was prepared with: the directory loads whole, as a Hub model does.
    save_word_tokenizer(tmp_path / "tokenizer", "the quick brown fox".split())
    assert main(["export", result.run_dir, "--output", str(tmp_path / "hf"), "--format", "huggingface",
                 "--tokenizer", str(tmp_path / "tokenizer")]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("the fox", add_special_tokens=False).input_ids == [6, 4]
    ours = Transformer(ModelArgs(**json.loads((tmp_path / "native" / "model_args.json").read_text())))
    ours.load_state_dict(load_file(tmp_path / "native" / "model.safetensors"))
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    tokens = torch.randint(0, config.model.vocab_size, (2, config.data.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(llama(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)
    assert abs(held_out_loss(llama, config) - result.summary["final_eval_loss"]) <= 1e-4


def test_an_earlier_step_exports_and_a_missing_one_is_refused_naming_those_there(trained, tmp_path, capsys):
    _, result = trained
    assert main(["export", result.run_dir, "--output", str(tmp_path), "--step", "3", "--dtype", "bfloat16"]) == 0
    assert "exported step 3" in capsys.readouterr().out
    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}
    assert main(["export", result.run_dir, "--output", str(tmp_path), "--step", "4"]) == 2
    assert capsys.readouterr().err.strip().endswith("no usable checkpoint of step 4 under "
                                                    f"{result.run_dir}/checkpoints; checkpoints there: [3, 6]")
    (tmp_path / "a-file").write_text("")
    assert main(["export", result.run_dir, "--output", str(tmp_path / "a-file")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "a-file: a file is there; give a directory" in line


def flip_a_shards_last_byte(step) -> str:
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    return f"{shard.name} checksum mismatch"


def truncate_the_manifest(step) -> str:
    manifest = step / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    return "unreadable manifest"


@pytest.mark.parametrize("damage", [flip_a_shards_last_byte, truncate_the_manifest])
def test_an_older_step_written_for_a_newest_that_does_not_load_says_so_and_a_named_step_is_never_replaced(
        trained, tmp_path, capsys, damage):
    """Step 6 damaged after its commit: the newest export writes step 3 and names step 6 and why
    it was not written; asked for step 6, nothing is written; storage is left as it was."""
    import shutil

    _, result = trained
    run = tmp_path / "run"
    shutil.copytree(result.run_dir, run)
    step = run / "checkpoints" / "step-00000006"
    reason = damage(step)
    exported = export_checkpoint(str(run), str(tmp_path / "newest"))
    assert exported.step == 3
    assert [later.step for later in exported.passed_over] == [6]
    assert reason in exported.passed_over[0].reason
    with safe_open(tmp_path / "newest" / "model.safetensors", framework="pt") as weights:
        assert weights.metadata()["step"] == "3"
    assert main(["export", str(run), "--output", str(tmp_path / "cli")]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("exported step 3 ") and "; step 6 was not: " in line and reason in line, line
    assert main(["export", str(run), "--output", str(tmp_path / "step-6"), "--step", "6"]) == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "step-6").exists()
    assert step.is_dir()  # not moved aside: export changes nothing in storage


def test_the_huggingface_config_keeps_the_sources_max_position_embeddings(trained, tmp_path):
    """A run started from a HuggingFace Llama made for 2,048 positions and trained on 32 exports
    as made for 2,048; a run from no source, as made for the length it trained on."""
    config, result = trained
    source = tmp_path / "source"
    assert main(["export", result.run_dir, "--output", str(source), "--format", "huggingface"]) == 0
    source_config = json.loads((source / "config.json").read_text())
    assert source_config["max_position_embeddings"] == config.data.seq_len == 32
    (source / "config.json").write_text(json.dumps({**source_config, "max_position_embeddings": 2048}))
    tuned = ElasticTrainer(tiny_config(tmp_path, run_name="tuned", steps=1, checkpoint__every=1,
                                       model__init_from=str(source))).fit()
    assert tuned.ok, tuned.exit
    assert main(["export", tuned.run_dir, "--output", str(tmp_path / "tuned"), "--format", "huggingface"]) == 0
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["max_position_embeddings"] == 2048


def test_a_checkpoint_that_does_not_load_is_one_line_and_nothing_is_exported(trained, tmp_path, capsys):
    """Its .metadata forged to read a file outside the checkpoint, its manifest rewritten to match."""
    import hashlib
    import pickle
    import shutil
    from dataclasses import replace

    from checkpointing.safe_loading import load_metadata

    _, result = trained
    shutil.copytree(result.run_dir, tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "step-00000006"
    metadata = load_metadata(open(step / ".metadata", "rb"))
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = replace(metadata.storage_data[index], relative_path="/etc/passwd")
    forged = pickle.dumps(metadata)
    (step / ".metadata").write_bytes(forged)
    manifest = json.loads((step / "manifest.json").read_text())
    for record in manifest["files"]:
        if record["name"] == ".metadata":
            record.update(size=len(forged), sha256=hashlib.sha256(forged).hexdigest())
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "out"), "--step", "6"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "/etc/passwd" in line and "refused" in line, line
    assert not (tmp_path / "out").exists()


def test_a_huggingface_export_generates_as_its_source_did_its_ids_generation_config_and_tokenizer(trained, tmp_path):
    """A run started from a HuggingFace directory whose config.json sets the token ids and
    which holds a generation_config.json and a tokenizer: the export carries all three, so
    the fine-tune stops where its source stops."""
    transformers = pytest.importorskip("transformers")
    _, result = trained
    source = tmp_path / "source"
    assert main(["export", result.run_dir, "--output", str(source), "--format", "huggingface"]) == 0
    ids = {"bos_token_id": 1, "eos_token_id": [2, 5], "pad_token_id": 0}
    source_config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**source_config, **ids}))
    generation = {"bos_token_id": 1, "eos_token_id": [2, 5], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    (source / "generation_config.json").write_text(json.dumps(generation))
    save_word_tokenizer(source, "the quick brown fox".split())
    tuned = ElasticTrainer(tiny_config(tmp_path, run_name="tuned", steps=1, checkpoint__every=1,
                                       model__init_from=str(source))).fit()
    assert tuned.ok, tuned.exit
    out = tmp_path / "out"
    assert main(["export", tuned.run_dir, "--output", str(out), "--format", "huggingface"]) == 0
    exported = json.loads((out / "config.json").read_text())
    assert {name: exported[name] for name in ids} == ids
    assert json.loads((out / "generation_config.json").read_text()) == generation
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == [2, 5] and model.generation_config.temperature == 0.6
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("the fox", add_special_tokens=False).input_ids == [6, 4] and tokenizer.eos_token_id == 2
    (source / "config.json").write_text(json.dumps({**source_config, "eos_token_id": "</s>"}))
    with pytest.raises(ConfigError, match=r"^model.init_from .*source: eos_token_id is '</s>' in config.json; it "
                                          r"must be a token id or a list of them, or null"):
        export_checkpoint(tuned.run_dir, str(tmp_path / "refused"), layout="huggingface")
    assert not (tmp_path / "refused").exists()


def test_the_tokenizer_an_export_saves_is_the_runs_data_tokenizer_else_its_sources(tmp_path):
    pytest.importorskip("transformers")
    save_word_tokenizer(tmp_path / "data-tokenizer", "lazy dog".split())
    save_word_tokenizer(tmp_path / "source", "quick fox".split())
    (tmp_path / "bare").mkdir()
    data = {"data": {"tokenizer": str(tmp_path / "data-tokenizer")}}
    assert "lazy" in implied_tokenizer(data, str(tmp_path / "source")).get_vocab()
    assert "quick" in implied_tokenizer({"data": {"tokenizer": None}}, str(tmp_path / "source")).get_vocab()
    assert implied_tokenizer({"data": {"tokenizer": None}}, str(tmp_path / "bare")) is None
    assert implied_tokenizer({"data": {"tokenizer": None}}, None) is None
    with pytest.raises(ConfigError, match=r"^data.tokenizer '.*bare': .*; --tokenizer NAME_OR_PATH saves another$"):
        implied_tokenizer({"data": {"tokenizer": str(tmp_path / "bare")}}, None)


def test_an_export_replaces_links_in_its_output_never_writing_through_them(trained, tmp_path, capsys):
    """An output directory whose files link to files elsewhere: each link is replaced by the
    file exported, and what it pointed at is left as it was; a directory in a file's place is
    refused in one line."""
    transformers = pytest.importorskip("transformers")
    _, result = trained
    save_word_tokenizer(tmp_path / "tokenizer", "the quick brown fox".split())
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    elsewhere.mkdir()
    out.mkdir()
    names = ["config.json", "model.safetensors", "tokenizer.json"]
    for name in names:
        (elsewhere / name).write_text(f"not to be overwritten: {name}")
        (out / name).symlink_to(elsewhere / name)
    assert main(["export", result.run_dir, "--output", str(out), "--format", "huggingface",
                 "--tokenizer", str(tmp_path / "tokenizer")]) == 0
    for name in names:
        assert (elsewhere / name).read_text() == f"not to be overwritten: {name}"
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    transformers.LlamaForCausalLM.from_pretrained(out)
    assert [path.name for path in out.iterdir() if path.name.startswith(".")] == []  # nothing left behind
    blocked = tmp_path / "blocked"
    (blocked / "model.safetensors").mkdir(parents=True)
    capsys.readouterr()  # transformers' own words, loading
    assert main(["export", result.run_dir, "--output", str(blocked)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "model.safetensors there cannot be replaced" in line, line
    assert sorted(path.name for path in blocked.iterdir()) == ["model.safetensors"]
