"""draft-vocab writes where generate looks, never into the installed package; generate finds it there."""

from __future__ import annotations

import json
import os

from typer.testing import CliRunner

from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.cli import app
from glm5mtp_cli.engine.draft_vocab import COUNTS_FILE, counts_file, user_counts_path

CORPUS = "import os\nimport sys\n\ndef main():\n    return os.path.join(sys.argv[0], 'x')\n"


def test_a_profile_s_counts_go_to_the_user_cache_and_generate_finds_them(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    shipped = profile_path("glm5next-nano")  # a shipped profile: never written into
    before = sorted(p.name for p in shipped.iterdir())
    r = CliRunner().invoke(app, ["draft-vocab", "--model", "glm5next-nano", "--corpus", str(corpus)], env=env)
    assert r.exit_code == 0, r.output
    written = tmp_path / "cache" / "glm5mtp" / "draft-vocab" / "glm5next-nano" / COUNTS_FILE
    assert str(written) in r.output and json.loads(written.read_text())["tokens_counted"] > 0
    assert sorted(p.name for p in shipped.iterdir()) == before
    r = CliRunner().invoke(app, ["generate", "--model", "glm5next-nano", "--prompt", "import os", "--draft-vocab", "16",
                                 "--max-new-tokens", "4", "--device", "cpu", "--json"], env=env)
    assert r.exit_code == 0, r.output


def test_an_empty_corpus_is_refused_and_nothing_is_written(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    r = CliRunner().invoke(app, ["draft-vocab", "--corpus", str(tmp_path / "empty.txt")],
                           env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "no tokens to count" in r.output and "Traceback" not in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_the_newer_counts_win_and_only_profiles_and_hub_downloads_use_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    nano = profile_path("glm5-nano")
    user = user_counts_path(nano)
    assert user == tmp_path / "cache" / "glm5mtp" / "draft-vocab" / "glm5-nano" / COUNTS_FILE
    assert counts_file(nano) == nano / COUNTS_FILE  # the shipped counts while the user wrote none
    user.parent.mkdir(parents=True)
    user.write_text("{}")
    shipped_time = (nano / COUNTS_FILE).stat().st_mtime
    os.utime(user, (shipped_time + 10, shipped_time + 10))
    assert counts_file(nano) == user
    os.utime(user, (shipped_time - 10, shipped_time - 10))  # an upgrade shipped newer counts
    assert counts_file(nano) == nano / COUNTS_FILE
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert user_counts_path(snapshot) == tmp_path / "cache" / "glm5mtp" / "draft-vocab" / "org" / "name" / COUNTS_FILE
    assert user_counts_path(tmp_path) is None and counts_file(tmp_path) is None  # a folder of one's own
