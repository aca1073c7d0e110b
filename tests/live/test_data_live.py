"""A run on data pinned by hash (``swarmtrain run create --data``): two nodes training on
it read disjoint shares of its training shards that together cover them (the
``data.share`` events), and a node whose copy of a shard was changed is refused at start
with one line naming that shard."""

from __future__ import annotations

import random
import shutil

from node.cli.main import main
from node.harness.local_swarm import NodeProcess, launch_node, stop_all, wait_until
from protocol.run_spec import read_spec_file

DOCS, DOC_BYTES = 40, 64_000  # 2.5 MB of text: three training shards of up to 2^20 tokens


def _corpus(root):
    root.mkdir()
    rng = random.Random(0)
    words = ["swarm", "stage", "peer", "shard", "token", "llama", "averaging", "hash"]
    for i in range(DOCS):
        text, n = [], 0
        while n < DOC_BYTES:
            w = rng.choice(words)
            text.append(w)
            n += len(w) + 1
        (root / f"doc{i:02d}.txt").write_text(" ".join(text) + "\n")
    return root


def _shares(node: NodeProcess, trainers: int) -> list | None:
    """The ranges of ``node``'s last share, once it was dealt among ``trainers``."""
    shares = node.events("data.share")
    if shares and shares[-1]["trainers"] == trainers:
        return shares[-1]["share"]
    return None


def _all_shares(nodes: list[NodeProcess], trainers: int) -> list[list] | None:
    """Every node's last share (``_shares``), once each was dealt among ``trainers``."""
    shares = [_shares(n, trainers) for n in nodes]
    return None if None in shares else shares


def test_two_trainers_take_disjoint_shards_and_a_changed_shard_is_refused(tmp_path):
    spec_file, data = tmp_path / "lab.spec.json", tmp_path / "lab-data"
    src, key = _corpus(tmp_path / "src"), tmp_path / "owner.key"
    assert main(["run", "create", "lab", "--data", str(src), "--owner-key", str(key),
                 "--out", str(spec_file)]) == 0  # fmt: skip
    spec = read_spec_file(spec_file.read_text()).spec
    train = {s.name: s.tokens for s in spec.dataset.train}
    assert len(train) >= 3, train  # so that each trainer gets whole shards of its own

    # A third machine's copy (of the shards run create wrote) with one byte of a training
    # shard changed: it starts after the two, and is refused while they deal their shares.
    changed = tmp_path / "changed-data"
    shutil.copytree(data, changed)
    victim = changed / spec.dataset.train[1].name
    raw = bytearray(victim.read_bytes())
    raw[1234] ^= 0x20
    victim.write_bytes(bytes(raw))

    nodes: list[NodeProcess] = []
    try:
        mine = ["--spec", str(spec_file), "--data", str(data)]
        nodes.append(launch_node(tmp_path, "t0", spec.run, train=True,
                                 extra=[*mine, "--stage", "0"]))  # fmt: skip
        nodes.append(launch_node(tmp_path, "t1", spec.run, initial_peers=[nodes[0].maddr],
                                 train=True, extra=[*mine, "--stage", "1"]))  # fmt: skip
        bad = launch_node(tmp_path, "t2", spec.run, initial_peers=[nodes[0].maddr], train=True,
                          extra=["--data", str(changed)], wait=False)  # fmt: skip
        nodes.append(bad)
        shares = wait_until(lambda: _all_shares(nodes[:2], 2), 180, "both shares dealt among two")
        sets = [{shard for shard, _, _ in share} for share in shares]
        print(f"training shards {train}; shares {shares}")
        assert all(sets) and not sets[0] & sets[1], sets
        assert sets[0] | sets[1] == set(train), (sets, train)
        # Whole shards each (there are more shards than trainers), so the tokens cover them.
        for share in shares:
            assert all(start == 0 and end == train[shard] for shard, start, end in share), share
        wait_until(lambda: all(n.events("train.progress") for n in nodes[:2]), 180,
                   "both nodes training on their shares")  # fmt: skip

        code = bad.proc.wait(120)
        lines = [x for x in bad.output().splitlines() if x.startswith("swarmtrain node: error:")]
        assert code != 0 and lines, bad.output()[-2000:]
        assert len(lines) == 1 and str(victim) in lines[0] and "differs" in lines[0], lines
        assert "Traceback" not in bad.output(), bad.output()[-2000:]
        assert not bad.events("data.share")
        assert all(n.alive() for n in nodes[:2])
    finally:
        stop_all(nodes)
