"""Hub ids (`model.spec: org/name[@revision]`) through huggingface_hub's own code, offline: a cache laid out
as huggingface_hub lays it out (blobs named by git sha1 or LFS sha256, relative snapshot symlinks, refs,
the tree listing), built here from tiny random models and checked with huggingface_hub's own scanner;
a repo the cache lacks, a gated, missing or bad-revision repo answered by a loopback Hub; `models pull`."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from posttrain.models import ModelNotFoundError, list_local, load_policy, load_tokenizer, resolve
from posttrain.models.hub import HubError, HubId, hub_cache_dir, parse_hub_id, pull

REPO = "tiny-org/tiny-llama"
COMMIT_MAIN = "1" * 40
COMMIT_V1 = "2" * 40


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lay_out_repo(cache: Path, repo: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...]) -> Path:
    """Write `files` as huggingface_hub's cache holds a download of `repo` at `commit`: safetensors as LFS
    (blob named by sha256), the rest as git blobs (named by their git sha1), each snapshot file a relative
    symlink to its blob, `refs/<ref>` holding the commit, `trees/<commit>.json` the listing. Returns the
    snapshot folder."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    tree = {}
    for name, data in sorted(files.items()):
        lfs = name.endswith(".safetensors")
        etag = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        entry: dict = {"size": len(data), "blob_id": _git_blob_sha1(data)}
        if lfs:
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{etag}\nsize {len(data)}\n"
            entry = {"size": len(data), "blob_id": _git_blob_sha1(pointer.encode()), "lfs_sha256": etag}
            entry["lfs_size"] = len(data)
        tree[name] = entry
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    (storage / "trees").mkdir(exist_ok=True)
    (storage / "trees" / f"{commit}.json").write_text(
        json.dumps({"format_version": 1, "files": tree}, indent=1)
    )
    return snapshot


def _saved_files(tmp: Path, seed: int) -> dict[str, bytes]:
    model, tok = load_policy("tiny:llama", seed=seed), load_tokenizer("tiny:llama")
    folder = tmp / f"saved-{seed}"
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[int, dict[str, bytes]]:
    tmp = tmp_path_factory.mktemp("tiny")
    return {seed: _saved_files(tmp, seed) for seed in (0, 1)}


@pytest.fixture()
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty HF_HOME, offline; the hub cache is HF_HOME/hub."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


@pytest.fixture()
def cached(hf_home, tiny_files) -> Path:
    """REPO cached at two commits: main (tiny:llama seed 0) and tag v1 (seed 1)."""
    cache = hf_home / "hub"
    lay_out_repo(cache, REPO, COMMIT_MAIN, tiny_files[0], ("main",))
    lay_out_repo(cache, REPO, COMMIT_V1, tiny_files[1], ("v1",))
    return cache


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_hub_ids_parse_and_local_paths_win(tmp_path, monkeypatch):
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == HubId("Qwen/Qwen2.5-0.5B-Instruct")
    assert parse_hub_id("org/name@v1.0") == HubId("org/name", "v1.0")
    assert parse_hub_id("org/name@refs/pr/3") == HubId("org/name", "refs/pr/3")
    assert HubId("org/name", "abc").pull_command == "posttrain models pull org/name --revision abc"
    for spec in ("name", "a/b/c", "/abs/path", "./org/name", "org/../x", "tiny:llama", "org/name@"):
        assert parse_hub_id(spec) is None, spec
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    with pytest.raises(ModelNotFoundError, match="no config.json"):  # a folder of that name is a folder
        resolve("org/name")


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(cached):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    info = scan_cache_dir(cached)
    assert info.warnings == []
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (REPO, "model")
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {COMMIT_MAIN: {"main"}, COMMIT_V1: {"v1"}}
    found = try_to_load_from_cache(REPO, "config.json", cache_dir=cached, revision="v1")
    assert found == str(
        cached / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT_V1 / "config.json"
    )
    assert hub_cache_dir() == cached


def test_a_cached_hub_model_loads_offline_with_its_revision(cached):
    info = resolve(REPO)
    assert (info.kind, Path(info.location).name) == ("hub", COMMIT_MAIN)
    assert _same_weights(load_policy(REPO), load_policy("tiny:llama", seed=0))
    for rev in ("v1", COMMIT_V1):
        assert Path(resolve(f"{REPO}@{rev}").location).name == COMMIT_V1
        assert _same_weights(load_policy(f"{REPO}@{rev}"), load_policy("tiny:llama", seed=1))
    assert load_tokenizer(REPO).encode("hello world") == load_tokenizer("tiny:llama").encode("hello world")
    listed = {(m.spec, m.kind, Path(m.location).name) for m in list_local() if m.kind == "hub"}
    assert listed == {(REPO, "hub", COMMIT_MAIN), (f"{REPO}@v1", "hub", COMMIT_V1)}


def test_a_model_the_cache_lacks_names_the_repo_and_the_pull_command(hf_home, cached):
    with pytest.raises(HubError) as err:
        resolve("tiny-org/absent")
    assert str(err.value) == (
        f"model 'tiny-org/absent' is not in the Hugging Face cache {hf_home / 'hub'} and HF_HUB_OFFLINE is set: "
        "run `posttrain models pull tiny-org/absent` on a machine that reaches the Hub, with the same HF_HOME or "
        "HF_HUB_CACHE (or copy that cache here), or give a local folder"
    )
    with pytest.raises(HubError, match=rf"posttrain models pull {REPO} --revision v2`"):
        resolve(f"{REPO}@v2")  # the repo is cached, that revision is not
    (cached / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT_MAIN / "model.safetensors").unlink()
    with pytest.raises(HubError, match=r"\(its cached snapshot is incomplete\)"):  # the tree listing says so
        resolve(REPO)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_falls_back_to_the_cache_or_says_how_to_pull(cached, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    assert Path(resolve(REPO).location).name == COMMIT_MAIN
    with pytest.raises(
        HubError, match="and the Hub could not be reached: run `posttrain models pull tiny-org/absent`"
    ):
        resolve("tiny-org/absent")


class _HubErrors(http.server.BaseHTTPRequestHandler):
    """A loopback Hub whose every answer is the error the real Hub gives for the repo in the path."""

    def _answer(self) -> None:
        status, code = (403, "GatedRepo") if "gated" in self.path else (404, "RepoNotFound")
        if "revision/nope" in self.path:
            status, code = 404, "RevisionNotFound"
        body = json.dumps({"error": f"{code} for {self.path}"}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args) -> None:
        return None


@pytest.fixture()
def error_hub(hf_home, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubErrors)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield server
    server.shutdown()
    server.server_close()


def test_gated_missing_and_bad_revision_repos_are_named(error_hub):
    with pytest.raises(
        HubError,
        match=r"^'tiny-org/gated-model' is a gated repository on the Hub: .*"
        r"then run `posttrain models pull tiny-org/gated-model`$",
    ):
        resolve("tiny-org/gated-model")
    with pytest.raises(HubError, match=r"^no repository 'tiny-org/absent' on the Hub"):
        resolve("tiny-org/absent")
    with pytest.raises(HubError, match=r"^'tiny-org/some-model' has no revision 'nope' on the Hub"):
        resolve("tiny-org/some-model@nope")


def test_pull_refuses_offline_and_returns_the_cached_snapshot_when_the_hub_is_down(cached, monkeypatch):
    with pytest.raises(HubError, match="cannot pull 'tiny-org/x': HF_HUB_OFFLINE is set"):
        pull(HubId("tiny-org/x"))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_free_port()}")
    assert pull(HubId(REPO, "v1")).name == COMMIT_V1


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_models_pull_cli(error_hub, hf_home):
    env = dict(os.environ)
    gated = _cli("models", "pull", "tiny-org/gated-model", env=env)
    assert gated.returncode == 1 and "'tiny-org/gated-model' is a gated repository" in gated.stderr
    both = _cli("models", "pull", "tiny-org/x@a", "--revision", "b", env=env)
    assert both.returncode == 2 and "two revisions" in both.stderr
    bad = _cli("models", "pull", "not-a-repo", env=env)
    assert bad.returncode == 2 and "not a Hub model id" in bad.stderr
    offline = _cli("models", "pull", "tiny-org/x", "--revision", "v3", env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 1 and "cannot pull 'tiny-org/x@v3': HF_HUB_OFFLINE is set" in offline.stderr


def test_a_vision_model_by_hub_id_loads_through_the_vision_loader(hf_home, tmp_path):
    from posttrain.models.vision import image_inputs, save_vision_folder, tiny_llava

    model, tok = tiny_llava(seed=0)
    folder = save_vision_folder(model, tok, tmp_path / "llava")
    files = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    lay_out_repo(hf_home / "hub", "tiny-org/tiny-llava", COMMIT_MAIN, files, ("main",))
    loaded = load_policy("tiny-org/tiny-llava")
    assert type(loaded) is type(model) and _same_weights(loaded, model)
    hub_inputs, inputs = image_inputs(load_tokenizer("tiny-org/tiny-llava")), image_inputs(tok)
    assert (hub_inputs.image_token_id, hub_inputs.run_length) == (inputs.image_token_id, inputs.run_length)
