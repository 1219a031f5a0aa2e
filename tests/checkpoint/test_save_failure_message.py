"""A failed save on a full filesystem says so even when torch's writer loses the errno (a short write
shows up as "unexpected pos …"), and the half-written directory goes."""

import shutil
from collections import namedtuple

from backends.common.checkpoint import resume

Usage = namedtuple("Usage", "total used free")


def test_short_write_on_a_full_filesystem_is_named(tmp_path, monkeypatch):
    tmp = tmp_path / ".step_6.tmp"
    tmp.mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 20, 10 << 20, 4096))
    err = resume._save_failed(tmp_path, 6, tmp, ["RuntimeError: unexpected pos 704 vs 598"])
    assert "No space left on device" in str(err) and "free space on that filesystem" in str(err)
    assert not tmp.exists()


def test_other_failures_keep_their_advice(tmp_path, monkeypatch):
    tmp = tmp_path / ".step_6.tmp"
    tmp.mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, 1 << 30, 9 << 30))
    err = resume._save_failed(tmp_path, 6, tmp, ["PermissionError: [Errno 13] Permission denied"])
    assert "No space left" not in str(err) and "writable on every node" in str(err)
