"""The `dataset` domain on a Hub dataset (`hub: org/name`) through `datasets`, offline: its cache built here
by datasets' own Parquet builder from a small table, where `load_dataset("org/name")` keeps a download
(`HF_HOME/datasets/org___name/<config>/<version>/<commit>/`); a dataset the cache lacks, a gated and a
missing one (a loopback Hub) get errors that name them. Runs `posttrain` in a subprocess: `datasets` and
huggingface_hub read HF_HOME and HF_HUB_OFFLINE when they are imported."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from posttrain.envs import get_domain

HUB = "tiny-org/tiny_table"
COMMIT = "3" * 40
ROWS = [{"question": f"What is {i} times 3?", "answer": str(3 * i)} for i in range(30)]


def _build_cache(hf_home: Path, tmp: Path) -> Path:
    """datasets' cache of HUB as its download leaves it: the Parquet builder prepares the splits under the
    name `load_dataset` gives a Hub dataset, `<namespace>___<name>` (with no repo_id the builder writes
    `<name>`, and a repo_id would make it fetch the files from the Hub)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {}
    for split, rows in (("train", ROWS), ("test", ROWS[:5])):
        files[split] = [str(tmp / f"{split}-00000-of-00001.parquet")]
        pq.write_table(pa.Table.from_pylist(rows), files[split][0])
    cache = hf_home / "datasets"
    builder = Parquet(
        cache_dir=str(cache),
        dataset_name=HUB.split("/")[1],
        config_name="default",
        config_id="default",
        hash=COMMIT,
        data_files=DataFilesDict.from_patterns(files),
    )
    builder.download_and_prepare()
    (cache / HUB.split("/")[1]).rename(cache / HUB.replace("/", "___"))
    return cache


def _env(hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, "HF_HOME": str(hf_home), **extra}


def _sample(env: dict[str, str], *options: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "posttrain", "tasks", "sample", "dataset", "--n", "3", "--json"]
    for opt in options:
        args += ["--option", opt]
    return subprocess.run(args, capture_output=True, text=True, timeout=180, env=env)


def test_a_cached_hub_dataset_is_read_offline(tmp_path):
    hf_home = tmp_path / "hf"
    cache = _build_cache(hf_home, tmp_path)
    assert sorted(
        p.name for p in (cache / "tiny-org___tiny_table" / "default" / "0.0.0" / COMMIT).iterdir()
    ) == [
        "dataset_info.json",
        "tiny_table-test.arrow",
        "tiny_table-train.arrow",
    ]
    out = _sample(_env(hf_home, HF_HUB_OFFLINE="1"), f"hub={HUB}", "prompt_key=question")
    assert out.returncode == 0, out.stderr
    tasks = json.loads(out.stdout.strip().splitlines()[-1])
    by_question = {r["question"]: r["answer"] for r in ROWS}
    for t in tasks:
        row = t["task"]["meta"]["row"]
        assert by_question[row["question"]] == row["answer"] == t["task"]["meta"]["answer"]
        assert t["reference"] == [f"<answer>{row['answer']}</answer>"]
    test_split = _sample(_env(hf_home, HF_HUB_OFFLINE="1"), f"hub={HUB}", "split=test", "prompt_key=question")
    assert test_split.returncode == 0, test_split.stderr
    rows = {
        t["task"]["meta"]["row"]["question"] for t in json.loads(test_split.stdout.strip().splitlines()[-1])
    }
    assert rows <= {r["question"] for r in ROWS[:5]}
    bad_split = _sample(_env(hf_home, HF_HUB_OFFLINE="1"), f"hub={HUB}", "split=validation")
    assert bad_split.returncode == 2 and "Hub dataset 'tiny-org/tiny_table'" in bad_split.stderr
    assert "validation" in bad_split.stderr


def test_a_hub_dataset_the_cache_lacks_says_how_to_fetch_it(tmp_path):
    out = _sample(_env(tmp_path / "hf", HF_HUB_OFFLINE="1"), "hub=tiny-org/absent", "split=train")
    assert out.returncode == 2
    err = " ".join(out.stderr.split())
    assert "Hub dataset 'tiny-org/absent' is not in the cache" in err
    assert "`posttrain tasks sample dataset --option hub=tiny-org/absent --option split=train`" in err


class _HubErrors(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        status, code = (403, "GatedRepo") if "gated" in self.path else (404, "RepoNotFound")
        body = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args) -> None:
        return None


def test_gated_and_missing_hub_datasets_are_named(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubErrors)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = _env(tmp_path / "hf", HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}")
        gated = _sample(env, "hub=tiny-org/gated_table")
        missing = _sample(env, "hub=tiny-org/absent")
    finally:
        server.shutdown()
        server.server_close()
    assert gated.returncode == 2, gated.stderr
    err = " ".join(gated.stderr.split())
    assert (
        "Hub dataset 'tiny-org/gated_table': Dataset 'tiny-org/gated_table' is a gated dataset on the Hub"
        in err
    )
    assert missing.returncode == 2
    assert "Dataset 'tiny-org/absent' doesn't exist on the Hub" in " ".join(missing.stderr.split())


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {},
            "give options.path (a local file) or options.hub (a Hub dataset id ORG/NAME), exactly one; got neither",
        ),
        ({"path": "x.jsonl", "hub": "a/b"}, "exactly one; got both"),
        (
            {"path": "x.jsonl", "split": "train"},
            "options.split and options.config choose a Hub dataset's rows",
        ),
        (
            {"hub": "no-slash"},
            "options.hub must be a Hub dataset id ORG/NAME or ORG/NAME@REVISION, got 'no-slash'",
        ),
        ({"hub": "a/b@"}, "got 'a/b@'"),
    ],
)
def test_bad_hub_options_are_named(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        get_domain("dataset", **options)
