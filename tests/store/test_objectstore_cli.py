"""The CLI's ``ls``, ``export`` and ``prune``, ``export_weights`` and ``resume(source=...)`` on
``s3://`` URLs, against a real S3 server on loopback (SeaweedFS, tests/s3server.py)."""

from __future__ import annotations

import json
from pathlib import Path

import obstore
import pytest
import torch

import pitstop
from pitstop.cli import main
from pitstop.core.naming import checkpoint_name
from pitstop.core.s3.objects import parse_url
from pitstop.shell.store.lease import torn_uploads
from pitstop.shell.store.objectstore import ObjectStorage
from tinyrun import same, train_step, trained, weights

STEPS = [checkpoint_name(s) for s in (1, 2, 3)]


def saved(url: str, steps: int = 3) -> torch.nn.Module:
    """A run that saved ``steps`` checkpoints (steps 1..steps) to ``url``; its model."""
    model, optimizer = trained()
    with pitstop.Checkpointer(url, model=model, state={"optimizer": optimizer}) as ckpt:
        progress = pitstop.Progress()
        for _ in range(steps):
            train_step(model, optimizer)
            progress = progress.advance()
            ckpt.save(progress)
    return model


def stored(url: str) -> tuple[list[str], list[str]]:
    """The committed checkpoints under ``url`` and its data objects."""
    storage = ObjectStorage(url)
    try:
        return [n for n in storage.listing()[0] if n.endswith(".pitstop")], storage.data_names()
    finally:
        storage.close()


def damage(url: str, name: str) -> None:
    """Flip one tensor byte of checkpoint ``name``'s data object: whole, but its CRC-32 not."""
    storage = ObjectStorage(url)
    try:
        key = parse_url(url).key(storage.commit(name).data)
        data = bytearray(obstore.get(storage.client, key).bytes())
        data[100] ^= 0x01
        obstore.put(storage.client, key, bytes(data))
    finally:
        storage.close()


def listed(url: str, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, list[dict]]:
    code = main(["ls", url, "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def test_ls_lists_an_s3_prefix(s3_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    saved(s3_url)
    code, rows = listed(s3_url, capsys)
    assert code == 0
    assert [r["name"] for r in rows] == STEPS
    assert [r["path"] for r in rows] == [f"{s3_url}/{n}" for n in STEPS]
    assert rows[-1]["pointers"] == ["last"]
    assert all(r["size"] > 0 and r["kept_because"] for r in rows)
    assert main(["ls", s3_url]) == 0
    table = capsys.readouterr().out
    assert s3_url in table
    assert "last" in table


def test_ls_check_on_s3_finds_a_damaged_checkpoint_and_the_resume_point(
    s3_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    saved(s3_url)
    code, rows = listed(s3_url, capsys, "--check")
    assert code == 0
    assert [r["check"] for r in rows] == ["ok", "ok", "ok"]
    assert [r["resume_from_last"] for r in rows] == [False, False, True]
    damage(s3_url, STEPS[2])
    code, rows = listed(s3_url, capsys, "--check")
    assert code == 1
    assert [r["check"] for r in rows] == ["ok", "ok", "corrupt"]
    assert [r["resume_from_last"] for r in rows] == [False, True, False]
    assert main(["ls", s3_url, "--check"]) == 1
    out = capsys.readouterr().out
    assert f"would use {STEPS[1]}" in out
    assert f"after skipping {STEPS[2]}" in out


def test_ls_of_an_empty_prefix_says_so(s3_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", s3_url, "--check"]) == 0
    out = capsys.readouterr().out
    assert "no checkpoints" in out
    assert "start fresh" in out


def test_export_writes_an_s3_checkpoints_weights_to_a_local_file(
    s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = saved(s3_url)
    out = tmp_path / "weights.pt"
    assert main(["export", s3_url, str(out)]) == 0
    assert same(weights(model), torch.load(out, weights_only=True))
    assert str(out) in capsys.readouterr().out
    # the API: an older checkpoint by its URL
    older = pitstop.export_weights(f"{s3_url}/{STEPS[0]}", tmp_path / "older.pt")
    step1 = pitstop.load(f"{s3_url}/{STEPS[0]}")["weights"]["raw"]
    assert same(dict(step1), torch.load(older, weights_only=True))


def test_prune_on_s3_deletes_commits_and_data(
    s3_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    saved(s3_url)
    assert main(["prune", s3_url, "--keep-last", "1", "--dry-run"]) == 0
    assert "would delete 2 of 3" in capsys.readouterr().out
    assert stored(s3_url)[0] == STEPS
    assert main(["prune", s3_url, "--keep-last", "1"]) == 0
    assert "deleted 2 of 3" in capsys.readouterr().out
    commits, data = stored(s3_url)
    assert commits == [STEPS[2]]
    assert [d.rsplit("/", 1)[-1] for d in data] == [STEPS[2]]


def test_prune_on_s3_never_races_a_writer(s3_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    saved(s3_url)
    model, _ = trained()
    with pitstop.Checkpointer(s3_url, model=model):
        assert main(["prune", s3_url, "--keep-last", "1"]) == 1
    assert f"{s3_url} is locked by run" in capsys.readouterr().out
    assert stored(s3_url)[0] == STEPS


def test_a_local_run_resumes_from_an_s3_checkpoint(s3_url: str, tmp_path: Path) -> None:
    model = saved(s3_url)
    other, optimizer = trained(seed=9)
    with pitstop.Checkpointer(tmp_path, model=other, state={"optimizer": optimizer}) as ckpt:
        assert ckpt.resume(source=s3_url).step == 3
        assert same(weights(model), weights(other))
        train_step(other, optimizer)
        ckpt.save(pitstop.Progress(step=4))
    assert pitstop.info(tmp_path).step == 4
    assert stored(s3_url)[0] == STEPS  # the source is only read


def test_an_aws_profile_reaches_the_server(
    s3_url: str,
    s3_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Keys in ~/.aws/credentials, endpoint and region in ~/.aws/config, named by AWS_PROFILE, as
    # the AWS CLI reads them; nothing in the environment but the profile's name and the files.
    model = saved(s3_url, steps=1)
    credentials, config = tmp_path / "credentials", tmp_path / "config"
    credentials.write_text(
        f"[lab]\naws_access_key_id = {s3_env['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {s3_env['AWS_SECRET_ACCESS_KEY']}\n"
        "[stale]\naws_access_key_id = someone-else\naws_secret_access_key = wrong\n"
    )
    config.write_text(
        f"[profile lab]\nregion = {s3_env['AWS_REGION']}\n"
        f"endpoint_url = {s3_env['AWS_ENDPOINT_URL']}\n"
        f"[profile stale]\nendpoint_url = {s3_env['AWS_ENDPOINT_URL']}\n"
    )
    for name in s3_env:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "lab")
    code, rows = listed(s3_url, capsys)
    assert code == 0
    assert [r["name"] for r in rows] == STEPS[:1]
    other, _ = trained(seed=1)
    pitstop.load_weights(other, f"{s3_url}/last")
    assert same(weights(other), weights(model))
    # The requests pitstop signs itself (multipart uploads) take the profile's keys too.
    assert torn_uploads(parse_url(s3_url), None, "no-such-prefix/") == []
    monkeypatch.setenv("AWS_PROFILE", "stale")  # the profile's keys are refused: said so
    assert main(["ls", s3_url]) != 0
    assert "credentials were refused" in capsys.readouterr().out
    monkeypatch.setenv("AWS_PROFILE", "labb")  # no such profile: one error naming it
    assert main(["ls", s3_url]) != 0
    said = " ".join(capsys.readouterr().out.split())
    assert "'labb' is in neither" in said
    assert "profiles there: lab, stale" in said
