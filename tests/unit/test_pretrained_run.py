"""Creating a run from a preset or a local checkpoint: the signed spec pins the
checkpoint's files (not where they are), ``--dry-run`` writes nothing and prints each
stage's memory, and a node checks its copy of the checkpoint before loading from it."""

from __future__ import annotations

import hashlib
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.cli.main import main
from protocol.identity import peer_id_of
from protocol.run_spec import AveragingSpec, make_run_spec, read_spec_file, sign_run_spec

# A spec file written before the llama settings and --from-pretrained existed.
OLD_SPEC = {
    "spec": '{"run":"old@bpumbzr7tgajleyk3pyysza6","version":1,"arch":{"vocab_size":256,'
    '"block_size":64,"n_layer":4,"n_head":4,"n_embd":64,"dropout":0.0,"bias":true,'
    '"tie_embeddings":false,"init_seed":0},"optimizer":{"lr":0.003,"betas":[0.9,0.95],'
    '"weight_decay":0.1,"warmup_steps":20,"grad_clip":1.0,"micro_batch_size":8,'
    '"target_batch_size":32,"max_staleness":0},"boundaries":[[0,3],[3,6]],'
    '"compression":"none","averaging":{"mode":"gradient","compression":"none",'
    '"matchmaking_s":2.0,"round_timeout_s":15.0,"allreduce_timeout_s":30.0,'
    '"chunk_timeout_s":5.0,"report_period_s":0.5,"inner_steps":50,"outer_lr":0.7,'
    '"outer_momentum":0.9},"data":"stdlib","seed":0,'
    '"owner":"12D3KooWA4Xop1JaT3MHxwYMkCepYsv4iPVopMXwCz5iHYdBfeSB","private":false,'
    '"created":1764547200.0}',
    "signature": "46279f8465351b837203fa5886644089ddbf25288f89a1c122b4003740c3ca08560e66b24d3e2"
    "cace17f640aa545c33f53ca90fb791adfb8c657b11143f2690d",
}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_an_old_spec_decodes_and_a_gpt_spec_signs_to_the_same_bytes():
    old = read_spec_file(json.dumps(OLD_SPEC))
    assert old.spec.model.family == "gpt" and old.spec.pretrained is None
    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    # Its settings, named: the defaults have changed since (int4 boundaries, 8-bit rounds).
    today = make_run_spec(
        "old", "tiny", 2, owner=peer_id_of(key.public_key()), created=1764547200.0,
        compression="none", averaging=AveragingSpec(compression="none"),
    )  # fmt: skip
    assert sign_run_spec(today, key).raw == old.raw


def test_a_run_from_a_checkpoint_pins_its_files_not_its_place(home, capsys):
    transformers = pytest.importorskip("transformers")
    from tests.hf_checkpoints import tiny_llama

    _, directory = tiny_llama(home, vocab_size=300)
    out = home / "ft.spec.json"
    argv = ["run", "create", "ft", "--from-pretrained", str(directory), "--stages", "3"]
    assert main([*argv, "--owner-key", str(home / "o.key"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"--pretrained {directory}" in printed
    text = out.read_text()
    assert str(directory) not in text and str(home) not in text
    spec = read_spec_file(text).spec
    assert spec.pretrained.architecture == "LlamaForCausalLM"
    assert spec.pretrained.files == {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
        for name in ("config.json", "model.safetensors")
    }
    hf = transformers.LlamaConfig.from_pretrained(directory)
    m = spec.model
    assert (m.family, m.n_layer, m.n_embd, m.n_head, m.n_kv_head, m.vocab_size) == (
        "llama", hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads,
        hf.num_key_value_heads, 300,
    )  # fmt: skip
    assert spec.n_stages == 3 and spec.optim.lr == 1e-4


def test_a_node_checks_its_copy_of_the_checkpoint(home):
    pytest.importorskip("transformers")
    from node.daemon.join import NodeError
    from node.daemon.start import pretrained_copy
    from tests.hf_checkpoints import tiny_llama

    _, directory = tiny_llama(home)
    out = home / "ft.spec.json"
    argv = ["run", "create", "ft", "--from-pretrained", str(directory), "--out", str(out)]
    assert main([*argv, "--owner-key", str(home / "o.key")]) == 0
    spec = read_spec_file(out.read_text()).spec
    with pytest.raises(NodeError, match="LlamaForCausalLM checkpoint: give .* --pretrained DIR"):
        pretrained_copy(spec, None)
    copy = pretrained_copy(spec, directory)
    assert copy.directory == directory and copy.config == spec.model
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(NodeError, match=r"model.safetensors: differs from the run's checkpoint"):
        pretrained_copy(spec, directory)
    assert pretrained_copy(make_run_spec("g", "tiny", 2, owner=spec.owner), directory) is None


def test_dry_run_prints_each_stages_memory_and_writes_nothing(home, capsys):
    from models.config import preset
    from models.memory import stage_memory
    from models.stages import even_boundaries

    argv = ["run", "create", "big", "--preset", "llama-1b", "--stages", "4", "--dry-run"]
    assert main([*argv, "--owner-key", str(home / "o.key")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert list(home.iterdir()) == [], "a dry run writes nothing, not even a key"
    model = preset("llama-1b")[0]
    for i, r in enumerate(even_boundaries(model, 4)):
        m = stage_memory(model, r)
        assert m.total == 16 * m.parameters  # weights, gradients, two AdamW moments
        row = lines[1 + i].split()
        assert row[0] == str(i) and row[-1] == f"{m.total:,}", lines
        assert f"{m.total / 1024**3:.2f}" in lines[1 + i]
    total = sum(stage_memory(model, r).parameters for r in even_boundaries(model, 4))
    assert 1.0e9 < total < 1.2e9


def test_bad_checkpoints_and_flags_are_one_line_errors(home, capsys):
    directory = home / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    argv = ["run", "create", "x", "--from-pretrained", str(directory), "--dry-run"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{directory / 'config.json'}: architecture BertModel is not supported" in err
    assert "LlamaForCausalLM, GPT2LMHeadModel" in err
    assert main([*argv, "--preset", "tiny"]) == 2
    assert "choose one" in capsys.readouterr().err
    assert main(["run", "create", "x", "--preset", "llama-9b", "--dry-run"]) == 2
    assert "unknown preset 'llama-9b'" in capsys.readouterr().err


def test_the_light_parser_names_every_preset():
    from models.config import PRESETS
    from node.cli.args import PRESET_NAMES

    assert PRESET_NAMES.split(", ") == list(PRESETS)
