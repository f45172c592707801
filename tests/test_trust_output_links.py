"""Where a folder output lands: -o a link (to a folder, dangling) is refused in memory and streamed alike, a link
is never followed when an old output is replaced, and a folder written gets the mode mkdir would give."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("stream", [False, True])
def test_overwrite_onto_a_link_to_a_folder_is_refused(cli, hf_folders, tmp_path, stream):
    """-o a symbolic link to a folder, with --overwrite: refused in one line in memory and streamed alike (the stream
    exchanged the link for its folder, exit 0, and left the link behind as a .normconv-tmp); the folder it points to
    and the link stay as they were."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(other)
    code, _, err = cli("swap", hf_folders["gpt2"], "--to", "rmsnorm", *(["--stream"] if stream else []), "-o", link,
                       "--overwrite")
    assert code == 2 and "symbolic link" in err and err.count("\n") == 1
    assert link.is_symlink() and (other / "keep.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "other"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_folder_written_gets_the_mode_mkdir_would_give(cli, hf_folders, tmp_path, stream):
    """0777 minus the umask, streamed or not (the stream published mkdtemp's 0700 folder)."""
    import os
    import stat

    out = tmp_path / "out"
    code, _, err = cli("swap", hf_folders["gpt2"], "--to", "rmsnorm", *(["--stream"] if stream else []), "-o", out)
    assert code == 0, err
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask


def test_replacing_a_link_removes_the_link_never_what_it_points_to(tmp_path):
    """io.write.replace over a path that is a link to a folder (should one get past the checks): the new folder takes
    its place, the link itself is removed (it was left behind: rmtree does not remove a link), the folder it pointed to
    is untouched."""
    from normconv.io.write import replace

    other, new, link = tmp_path / "other", tmp_path / "new", tmp_path / "link"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    new.mkdir()
    (new / "config.json").write_text("{}")
    link.symlink_to(other)
    replace(new, link)
    assert not link.is_symlink() and (link / "config.json").is_file() and (other / "keep.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "other"]


def test_a_dangling_link_as_the_stream_s_output_is_refused_before_any_work(cli, hf_folders, tmp_path):
    """-o a link to nothing: --stream ran the whole job, then failed to publish (NotADirectoryError, exit 2)."""
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    code, out, err = cli("swap", hf_folders["gpt2"], "--to", "rmsnorm", "--stream", "-o", link)
    assert code == 2 and "symbolic link" in err and "NotADirectoryError" not in err
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["dangling"]
