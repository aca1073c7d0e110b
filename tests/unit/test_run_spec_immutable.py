"""A run's spec never changes: the owner's tools refuse a different spec under an
existing run name."""

from __future__ import annotations

import pytest

from node.cli.main import main
from node.daemon.join import NodeError
from node.daemon.settings import NodeSettings
from node.daemon.start import resolve_run
from node.files import load_or_create_key
from protocol.run_spec import AveragingSpec, read_spec_file, sign_run_spec, spec_file_text


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_restarting_a_run_by_name_with_other_settings_is_refused(home):
    run, first = resolve_run(NodeSettings(run="r3", n_stages=2))
    assert first.spec.n_stages == 2
    # A restart with the same flags publishes the very same signed spec.
    again = resolve_run(NodeSettings(run="r3", n_stages=2))[1]
    assert again.raw == first.raw
    with pytest.raises(NodeError, match=r"2 -> 3 stages.*new name"):
        resolve_run(NodeSettings(run="r3", n_stages=3))
    with pytest.raises(NodeError, match="compression 'int4' -> 'float16'"):
        resolve_run(NodeSettings(run="r3", n_stages=2, compression="float16"))
    # What the node's flags did not choose, the recorded run keeps: a run created under
    # older defaults (uncompressed) restarts as it was; a flag that contradicts it is refused.
    old = resolve_run(NodeSettings(run="r5", n_stages=2, compression="none"))[1]
    assert old.spec.compression == "none"
    recorded = home / ".swarmtrain" / "runs" / f"{old.spec.run}.spec.json"
    plain = old.spec.model_copy(update={"averaging": AveragingSpec(compression="none")})
    recorded.write_text(spec_file_text(sign_run_spec(plain, load_or_create_key(
        home / ".swarmtrain" / "owner.key"))))  # fmt: skip
    restarted = resolve_run(NodeSettings(run="r5", n_stages=2))[1].spec
    assert (restarted.compression, restarted.averaging.compression) == ("none", "none")
    with pytest.raises(NodeError, match="compression 'none' -> 'int4'"):
        resolve_run(NodeSettings(run="r5", n_stages=2, compression="int4"))
    # Another name is another run.
    assert resolve_run(NodeSettings(run="r4", n_stages=3))[1].spec.n_stages == 3
    recorded = home / ".swarmtrain" / "runs" / f"{run}.spec.json"
    assert read_spec_file(recorded.read_text()).raw == first.raw


def test_run_create_refuses_a_different_spec_under_an_existing_name(home, capsys):
    key = home / "owner.key"
    assert main(["run", "create", "lab", "--stages", "2", "--owner-key", str(key),
                 "--out", str(home / "a.json")]) == 0  # fmt: skip
    assert main(["run", "create", "lab", "--stages", "2", "--owner-key", str(key),
                 "--out", str(home / "b.json")]) == 0  # fmt: skip
    a, b = (read_spec_file((home / f).read_text()) for f in ("a.json", "b.json"))
    assert a.raw == b.raw, "the same flags: the same spec"
    capsys.readouterr()
    assert main(["run", "create", "lab", "--stages", "3", "--owner-key", str(key),
                 "--out", str(home / "c.json")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "2 -> 3 stages" in err, err
    assert not (home / "c.json").exists()
    assert main(["run", "create", "lab", "--private", "--owner-key", str(key),
                 "--out", str(home / "c.json")]) == 2  # fmt: skip
