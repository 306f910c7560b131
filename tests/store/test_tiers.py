"""The remote tier: ``Checkpointer(local_dir, remote="s3://...")`` against a real S3 server on
loopback (SeaweedFS, tests/s3server.py).

Every checkpoint is published locally first, then uploaded in the background; ``finish()``
waits for the uploads; the remote tier holds byte-for-byte copies, listed by pitstop's own
reader, and retires them by its own policy; a run whose local directory is gone resumes exactly
from the remote tier in a fresh process; a damaged local checkpoint falls back to its remote
copy; a remote that refuses the run loses no local checkpoint and its error is raised by the
next call.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

import pitstop
from pitstop.core.naming import checkpoint_name
from pitstop.errors import ConfigError, SaveError
from pitstop.shell.format.untrusted import open_untrusted
from pitstop.shell.store.objectstore import ObjectStorage
from s3server import remote_steps, run_python
from tinyrun import same, train_step, trained, weights

CHILD = Path(__file__).with_name("s3child.py")


def remote_bytes(url: str, step: int) -> bytes:
    """The bytes of the remote checkpoint of ``step``, downloaded."""
    storage = ObjectStorage(url)
    try:
        with storage.fetched(checkpoint_name(step)) as path, open_untrusted(path) as file:
            return file.read()
    finally:
        storage.close()


def tiered_run(
    local: Path, url: str, steps: int, **options: object
) -> tuple[pitstop.Checkpointer, list[dict[str, object]]]:
    """A tiered Checkpointer that saved steps 1..``steps`` and finished (not closed), and the
    model's weights at each step."""
    model, optimizer = trained()
    ckpt = pitstop.Checkpointer(
        local, model=model, state={"optimizer": optimizer}, remote=url, **options
    )
    progress, history = pitstop.Progress(), []
    for _ in range(steps):
        train_step(model, optimizer)
        progress = progress.advance()
        record = ckpt.save(progress)
        assert record.tiers == ("local",)  # published locally; the upload comes after
        history.append(weights(model))
    ckpt.finish(progress)
    return ckpt, history


@pytest.mark.parametrize("async_save", [False, True])
def test_every_checkpoint_is_uploaded_and_finish_waits_for_it(
    local_tmp: Path, s3_url: str, async_save: bool
) -> None:
    policy = pitstop.Policy(keep_last=None)
    ckpt, _ = tiered_run(local_tmp, s3_url, 3, policy=policy, async_save=async_save)
    try:
        assert remote_steps(s3_url) == [1, 2, 3]  # finish() returned: every upload is done
        for step in (1, 2, 3):  # byte for byte the local file
            assert remote_bytes(s3_url, step) == (local_tmp / checkpoint_name(step)).read_bytes()
        assert [c.tiers for c in ckpt.checkpoints()] == [("local", "remote")] * 3
    finally:
        ckpt.close()
    pitstop.verify(s3_url)  # its last pointer names the newest, and it verifies
    assert pitstop.info(s3_url).step == 3
    # nothing of the upload is left in the local directory
    assert sorted(p.name for p in local_tmp.iterdir() if p.name.startswith(".tmp")) == []


def test_a_run_whose_local_directory_is_gone_resumes_exactly_from_the_remote_tier(
    local_tmp: Path, s3_url: str, s3_env: dict[str, str]
) -> None:
    def child(*args: str) -> str:
        return run_python([str(CHILD), str(local_tmp / "ckpt"), *args, s3_url], s3_env)

    saving = child("save", "3")
    shutil.rmtree(local_tmp / "ckpt")  # the node lost its disk
    resumed = child("resume", "3")
    assert saving.startswith("step 6 ")
    assert resumed == saving  # bitwise: the same weights and optimizer state after 3 more steps
    # the checkpoint resumed from is local again, and the next save follows it in both tiers
    assert (local_tmp / "ckpt" / checkpoint_name(3)).is_file()
    model, optimizer = trained(seed=7)
    with pitstop.Checkpointer(
        local_tmp / "ckpt", model=model, state={"optimizer": optimizer}, remote=s3_url
    ) as ckpt:
        progress = ckpt.resume()
        assert progress.step == 3
        # the same checkpoint in both tiers: the local copy kept the remote one's seq
        assert [(c.step, c.seq, c.tiers) for c in ckpt.checkpoints()] == [
            (1, 1, ("remote",)),
            (2, 2, ("remote",)),
            (3, 3, ("local", "remote")),
        ]
        ckpt.finish(progress.advance())
    assert pitstop.info(s3_url).step == 4  # the remote's last: the new one, not step 3
    assert pitstop.info(local_tmp / "ckpt").step == 4


def test_a_damaged_newest_local_checkpoint_falls_back_to_its_remote_copy(
    local_tmp: Path, s3_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, history = tiered_run(local_tmp, s3_url, 3)
    ckpt.close()
    newest = local_tmp / checkpoint_name(3)
    data = bytearray(newest.read_bytes())
    data[100] ^= 0x01  # a tensor byte: the file is whole, its CRC-32 is not
    newest.write_bytes(bytes(data))
    model, optimizer = trained(seed=7)
    caplog.set_level(logging.INFO, logger="pitstop")
    with pitstop.Checkpointer(
        local_tmp, model=model, state={"optimizer": optimizer}, remote=s3_url
    ) as resumed:
        assert resumed.resume().step == 3  # the remote copy of step 3, not the local step 2
        assert same(weights(model), history[2])
    messages = [r.getMessage() for r in caplog.records]
    assert any("skips" in m and checkpoint_name(3) in m for m in messages)
    assert any("from the remote tier" in m and checkpoint_name(3) in m for m in messages)
    pitstop.verify(newest)  # and the local copy was put right


def test_the_remote_tier_retires_checkpoints_by_its_own_policy(
    local_tmp: Path, s3_url: str
) -> None:
    ckpt, _ = tiered_run(
        local_tmp,
        s3_url,
        5,
        policy=pitstop.Policy(keep_last=2),
        remote_policy=pitstop.Policy(keep_last=1, keep_every=2),
    )
    try:
        assert remote_steps(s3_url) == [2, 4, 5]
        assert [c.step for c in ckpt.checkpoints()] == [2, 4, 5]
        assert [c.tiers for c in ckpt.checkpoints()] == [
            ("remote",),  # retired locally, kept remotely (keep_every)
            ("local", "remote"),
            ("local", "remote"),
        ]
    finally:
        ckpt.close()
    assert sorted(p.name for p in local_tmp.glob("step_*")) == [
        checkpoint_name(4),
        checkpoint_name(5),
    ]


@pytest.mark.parametrize("broken", ["credentials", "endpoint"])
def test_a_failed_upload_keeps_the_local_checkpoint_and_is_raised_at_the_next_call(
    local_tmp: Path, s3_url: str, broken: str
) -> None:
    options: dict[str, object] = (
        {"secret_access_key": "not-the-secret"}
        if broken == "credentials"
        else {"endpoint": "http://127.0.0.1:9", "retry_config": {"max_retries": 0}}
    )
    model, optimizer = trained()
    ckpt = pitstop.Checkpointer(
        local_tmp,
        model=model,
        state={"optimizer": optimizer},
        remote=s3_url,
        storage_options=options,
    )
    try:
        ckpt.save(pitstop.Progress(step=1))  # published locally, whatever the remote does
        with pytest.raises(SaveError, match=rf"step 1 .*{s3_url}.*local checkpoint is kept"):
            ckpt.wait()  # the next call waits for the upload (as finish() does) and raises
        ckpt.wait()  # raised once
        assert [c.tiers for c in ckpt.checkpoints()] == [("local",)]
    finally:
        ckpt.close()
    pitstop.verify(local_tmp / checkpoint_name(1))
    assert remote_steps(s3_url) == []


def test_a_remote_tier_is_checked_at_construction(local_tmp: Path, s3_url: str) -> None:
    model, _ = trained()
    with pytest.raises(ConfigError, match="remote must be an object-store URL"):
        pitstop.Checkpointer(local_tmp, model=model, remote=str(local_tmp / "other"))
    with pytest.raises(ConfigError, match="must be a local directory"):
        pitstop.Checkpointer(s3_url, model=model, remote=s3_url + "-2")
    with pytest.raises(ConfigError, match=r"remote_policy must be a pitstop\.Policy"):
        pitstop.Checkpointer(local_tmp, model=model, remote=s3_url, remote_policy={"keep_last": 1})
    assert not any(local_tmp.iterdir())
