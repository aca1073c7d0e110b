"""Overlapped DiLoCo outer rounds: the pure count of a copy's samples around its rounds
(``protocol.averaging.OuterRound``) and the run setting that turns overlap on
(``AveragingSpec.overlap``, ``run create --averaging-overlap``)."""

from __future__ import annotations

import json

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.averaging import OuterRound
from protocol.identity import peer_id_of
from protocol.run_spec import AveragingSpec, decode_run_spec, make_run_spec, sign_run_spec

BATCH = 32


def _steps(rounds: OuterRound, n: int) -> None:
    for _ in range(n):
        assert rounds.may_step(BATCH, BATCH)
        rounds.stepped(BATCH)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_round_takes_the_inner_samples_and_only_overlap_steps_during_it(overlap):
    rounds = OuterRound(overlap=overlap)
    assert rounds.may_begin and rounds.admits(0, BATCH) and not rounds.may_step(8, BATCH)
    _steps(rounds, 3)
    assert rounds.pending == 3 * BATCH
    assert not rounds.admits(BATCH, BATCH)  # a complete batch waits for its inner step
    assert rounds.begin() == 3 * BATCH
    assert rounds.in_flight and not rounds.may_begin
    with pytest.raises(RuntimeError, match="in flight"):
        rounds.begin()  # at most one round in flight
    # Its groupmates must still see this copy at the round's target until it ends.
    assert rounds.pending == 3 * BATCH
    assert rounds.admits(0, BATCH) is overlap
    assert rounds.may_step(BATCH, BATCH) is overlap
    if overlap:
        _steps(rounds, 2)  # during the round: toward the next one
        assert rounds.pending == 5 * BATCH
    rounds.finished()
    assert not rounds.in_flight and rounds.may_begin
    assert rounds.pending == (2 * BATCH if overlap else 0)
    assert rounds.admits(0, BATCH) and rounds.may_step(BATCH, BATCH)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_round_gives_its_samples_back(overlap):
    rounds = OuterRound(overlap=overlap)
    _steps(rounds, 4)
    weight = rounds.begin()
    if overlap:
        _steps(rounds, 1)
    rounds.given_back(weight)
    assert not rounds.in_flight and rounds.in_round == 0
    assert rounds.pending == (5 if overlap else 4) * BATCH  # no sample lost, none twice
    assert rounds.begin() == rounds.pending  # the next round takes them all
    rounds.given_back(0)  # a contribution dropped as unfit: its samples are gone
    assert rounds.pending == 0 and rounds.may_begin


def test_a_loaded_state_drops_the_inner_samples():
    rounds = OuterRound(overlap=True)
    _steps(rounds, 2)
    rounds.loaded()
    assert rounds.pending == 0 and rounds.may_begin


def test_overlap_is_a_diloco_setting_left_out_of_the_signed_bytes_when_off():
    with pytest.raises(ValueError, match="overlap needs averaging.mode diloco"):
        AveragingSpec(overlap=True)
    assert AveragingSpec(mode="diloco", overlap=True).overlap
    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    owner = peer_id_of(key.public_key())

    def signed(**averaging) -> dict:
        spec = make_run_spec("o", "tiny", 2, owner=owner, created=1.0,
                             averaging=AveragingSpec(mode="diloco", **averaging))  # fmt: skip
        raw = sign_run_spec(spec, key).raw
        assert decode_run_spec(raw, run=spec.run).spec == spec
        return json.loads(msgpack.unpackb(raw)["spec"])["averaging"]

    assert "overlap" not in signed()  # a spec from before the setting: the same bytes
    assert signed(overlap=True)["overlap"] is True


def test_run_create_sets_overlap_and_refuses_it_in_gradient_mode_in_one_line(tmp_path, capsys):
    from node.cli.main import main
    from protocol.run_spec import read_spec_file

    base = ["run", "create", "lap", "--owner-key", str(tmp_path / "owner.key")]
    out = tmp_path / "lap.spec.json"
    assert main([*base, "--averaging", "diloco", "--averaging-overlap", "--out", str(out)]) == 0
    assert read_spec_file(out.read_text()).spec.averaging.overlap
    capsys.readouterr()
    assert main([*base, "--averaging-overlap", "--out", str(tmp_path / "no.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "overlap" in err and "pydantic" not in err, err
    assert not (tmp_path / "no.json").exists()


def test_an_overdue_round_goes_on_overlapped_until_it_ends():
    rounds = OuterRound()
    assert not rounds.overdue()  # no round in flight: nothing changes
    assert not rounds.admits(BATCH, BATCH)
    _steps(rounds, 2)
    weight = rounds.begin()
    assert not rounds.admits(0, BATCH) and not rounds.may_step(BATCH, BATCH)  # held
    assert rounds.overdue()  # one waited as long as a stage holds one: overlapped now
    assert not rounds.overdue()  # once per round
    assert rounds.admits(0, BATCH) and not rounds.admits(BATCH, BATCH)  # batches as usual
    _steps(rounds, 1)  # toward the next round
    assert rounds.pending == weight + BATCH
    rounds.finished()
    assert rounds.pending == BATCH
    rounds.begin()
    assert not rounds.admits(0, BATCH)  # the next round holds again
    assert rounds.overdue()
    rounds.given_back(BATCH)
    rounds.begin()
    assert not rounds.admits(0, BATCH)
    assert not OuterRound(overlap=True).overdue()  # overlapped already
