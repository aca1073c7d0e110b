"""A run started from a Llama checkpoint made by ``transformers``: 2 stages x 1 peer, each
node with its own copy of the files (``--pretrained``). The swarm's first validation
loss is ``transformers``' on the same windows (the stages start from the checkpoint, not
from seeded weights), and it falls as the nodes train."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from models.data import eval_batches, load_corpus
from node.cli.main import main
from node.harness.local_swarm import NodeProcess, launch_node, stop_all
from protocol.run_spec import read_spec_file
from tests.live.test_resume import _train_and_validate

MICRO_BATCHES = 800  # 50 optimizer steps of the finetune optimizer (64 samples, 4 a batch)


def test_a_run_from_a_llama_checkpoint_starts_from_it_and_trains(tmp_path):
    pytest.importorskip("transformers")
    from tests.hf_checkpoints import tiny_llama

    hf, directory = tiny_llama(tmp_path, vocab_size=256, max_position_embeddings=32)
    spec_file = tmp_path / "ft.spec.json"
    key = tmp_path / "owner.key"
    # Uncompressed boundaries: the swarm's first validation is compared with the
    # checkpoint's own to 1e-3, which int4's stochastic rounding would exceed.
    assert main(["run", "create", "ft", "--from-pretrained", str(directory), "--stages", "2",
                 "--compression", "none", "--owner-key", str(key),
                 "--out", str(spec_file)]) == 0  # fmt: skip
    spec = read_spec_file(spec_file.read_text()).spec
    nodes: list[NodeProcess] = []
    try:
        mine = ["--pretrained", str(directory), "--spec", str(spec_file)]
        nodes.append(launch_node(tmp_path, "s0", spec.run, extra=[*mine, "--stage", "0"]))
        nodes.append(launch_node(tmp_path, "s1", spec.run, initial_peers=[nodes[0].maddr],
                                 extra=[*mine, "--stage", "1"]))  # fmt: skip
        for n in nodes:
            n.wait_serving(90)
        assert all(n.events("stage.held")[-1]["loaded"] == "initial" for n in nodes)

        initial, _ = asyncio.run(_train_and_validate(spec.run, nodes[0].maddr, 0))
        model, optim = spec.model, spec.optim
        windows = eval_batches(load_corpus(spec.data).val, model.block_size,
                               optim.micro_batch_size, 8)  # fmt: skip
        with torch.no_grad():
            theirs = [float(F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()))
                      for x, y in windows]  # fmt: skip
        assert abs(initial - sum(theirs) / len(theirs)) < 1e-3, (initial, theirs)

        after, samples = asyncio.run(_train_and_validate(spec.run, nodes[0].maddr, MICRO_BATCHES))
        assert samples == MICRO_BATCHES * optim.micro_batch_size
        assert after < initial - 0.2, (initial, after)
    finally:
        stop_all(nodes)
