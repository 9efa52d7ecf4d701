"""Downloads through huggingface_hub, against a hub served from 127.0.0.1 (HF_ENDPOINT) that answers as huggingface.co
does: a public repo, a private one that needs HF_TOKEN, a gated one, two revisions, a download cut half-way, files
whose bytes differ from their hash, offline with and without a cache, an unreachable hub, a full disk."""
import hashlib
import http.server
import json
import os
import re
import resource
import subprocess
import sys
import threading
import urllib.parse

import pytest
import torch

import model as M
from conftest import ROOT, oracle
from support import hub as H
from support.cli import UserError

transformers = oracle("transformers")

OLD, NEW = "a" * 40, "b" * 40  # two commits of org/tiny: NEW is main


class Hub(http.server.BaseHTTPRequestHandler):
    """/{repo}/resolve/{revision}/{file}: HEAD gives the commit, the etag (git blob id, or sha256 for weights, as
    LFS files have) and the size; GET gives the bytes, or those after a Range's start (206). Errors carry the
    X-Error-Code headers huggingface_hub turns into its exceptions."""
    repos: dict = {}  # repo -> {"refs": {branch: commit}, "commits": {commit: {file: bytes}}, "access": ...}
    token = "hf_test_token"
    cut: set = set()  # files whose next GET stops half-way
    lie = None  # "sha": bytes that do not match the etag
    seen: list = []  # (method, file, Range header)

    def log_message(self, *a):
        pass

    def fail(self, status, code, message="", head=False):
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        if message:
            self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def route(self, head: bool):
        m = re.fullmatch(r"/([\w.-]+/[\w.-]+)/resolve/([\w.-]+)/(.+)", urllib.parse.urlparse(self.path).path)
        if not m:
            return self.fail(404, "RepoNotFound")
        repo, revision, name = m[1], m[2], urllib.parse.unquote(m[3])
        r = self.repos.get(repo)
        authorized = self.headers.get("Authorization") == f"Bearer {self.token}"
        if r is None or (r.get("access") == "private" and not authorized):
            return self.fail(401, "RepoNotFound", "Invalid username or password.")
        if r.get("access") == "gated" and not authorized:
            return self.fail(403, "GatedRepo", "Access to model is restricted.")
        commit = r["refs"].get(revision, revision)
        if commit not in r["commits"]:
            return self.fail(404, "RevisionNotFound", "Invalid rev id")
        data = r["commits"][commit].get(name)
        if data is None:
            return self.fail(404, "EntryNotFound", "Entry not found")
        self.seen.append((self.command, name, self.headers.get("Range")))
        self.send_response(200 if head or not self.headers.get("Range") else 206)
        self.send_header("X-Repo-Commit", commit)
        if name.endswith(".safetensors"):
            self.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Linked-Size", str(len(data)))
        else:
            self.send_header("ETag", '"%s"' % hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
        start = int(re.fullmatch(r"bytes=(\d+)-", self.headers["Range"])[1]) if self.headers.get("Range") else 0
        body = bytes(len(data)) if self.lie == "sha" else data
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if head:
            return
        if name in self.cut and not start:  # the connection drops half-way through
            self.cut.discard(name)
            self.wfile.write(body[:len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body[start:])

    def do_HEAD(self):
        self.route(True)

    def do_GET(self):
        self.route(False)


def checkpoint_files(tmp_path, name: str, seed: int) -> dict:
    from test_model import hf_tiny, save_with_tokenizer

    d = save_with_tokenizer(hf_tiny("roberta", seed=seed), tmp_path / name)
    return {f.name: f.read_bytes() for f in d.iterdir() if f.is_file()}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The hub at 127.0.0.1: org/tiny (public; OLD and NEW differ in their weights), org/private (needs the token),
    org/gated; HF_HOME in tmp_path, online, no token."""
    old, new = checkpoint_files(tmp_path, "old", 0), checkpoint_files(tmp_path, "new", 1)
    Hub.repos = {"org/tiny": {"refs": {"main": NEW}, "commits": {OLD: old, NEW: new}},
                 "org/private": {"refs": {"main": NEW}, "commits": {NEW: new}, "access": "private"},
                 "org/gated": {"refs": {"main": NEW}, "commits": {NEW: new}, "access": "gated"}}
    Hub.cut, Hub.lie, Hub.seen = set(), None, []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no `hf auth login`
    yield {"old": old, "new": new}
    srv.shutdown()
    srv.server_close()


def weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def local_weights(files: dict, tmp_path, name: str) -> dict:
    d = tmp_path / f"local-{name}"
    d.mkdir()
    for f, data in files.items():
        (d / f).write_bytes(data)
    return weights(M.load_pretrained(str(d), quiet=True)[0])


def test_public_repo_downloads_then_loads_offline(hub, tmp_path, monkeypatch):
    ours, _ = M.load_pretrained("org/tiny", quiet=True)
    assert same(weights(ours), local_weights(hub["new"], tmp_path, "new"))
    snapshot = tmp_path / "home" / "hub" / "models--org--tiny" / "snapshots" / NEW  # huggingface_hub's own layout
    assert ours.source == snapshot and (snapshot / "model.safetensors").read_bytes() == hub["new"]["model.safetensors"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    Hub.repos = {}  # nothing served any more: the cache alone must do
    assert same(weights(M.load_pretrained("org/tiny", quiet=True)[0]), weights(ours))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    with pytest.raises(UserError, match=r"^org/tiny: not in the cache .* HF_HUB_OFFLINE is set; download it once"):
        M.load_pretrained("org/tiny")


def test_private_repo_loads_only_with_the_token(hub, tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"^org/private: no such repo on http://127.0.0.1:\d+, or a private one: "
                                        r"set HF_TOKEN or run `hf auth login`$"):
        M.load_pretrained("org/private")
    with pytest.raises(UserError, match=r"^org/gated: a gated repo; accept its terms on the hub, then set HF_TOKEN"):
        M.load_pretrained("org/gated")
    monkeypatch.setenv("HF_TOKEN", Hub.token)
    ours, _ = M.load_pretrained("org/private", quiet=True)
    assert same(weights(ours), local_weights(hub["new"], tmp_path, "new"))
    assert any(name == "model.safetensors" for _, name, _ in Hub.seen)


@pytest.mark.slow
def test_a_download_cut_half_way_resumes(hub, tmp_path, monkeypatch):
    """The connection drops half-way through the weights: the download goes on from the bytes it has (a Range
    request), not from the start. huggingface_hub writes 10 MB at a time; 4 KB here, for a file of 120 KB."""
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 4096)
    Hub.cut = {"model.safetensors"}
    ours, _ = M.load_pretrained("org/tiny", quiet=True)
    size = len(hub["new"]["model.safetensors"])
    ranges = [r for method, name, r in Hub.seen if method == "GET" and name == "model.safetensors"]
    assert len(ranges) == 2 and ranges[0] is None  # the whole file asked once, then only what was missing
    assert 0 < int(re.fullmatch(r"bytes=(\d+)-", ranges[1])[1]) <= size // 2
    assert same(weights(ours), local_weights(hub["new"], tmp_path, "new"))


def test_a_hub_ids_window_is_what_sentence_transformers_reads_before_any_weights(hub):
    """evaluate_sts.py --docs draws its spans before any model loads, up to what each model embeds whole: for a hub
    id on a cold cache that is its sentence_bert_config.json's max_seq_length (16 here, below config.json's 64
    positions), fetched without the weights (issue 82)."""
    from support.retrieval import model_window

    files = dict(hub["new"], **{"sentence_bert_config.json": b'{"max_seq_length": 16}'})
    Hub.repos["org/st"] = {"refs": {"main": NEW}, "commits": {NEW: files}}
    assert M.load_config_and_tokenizer("org/st")[0].max_tokens > 16  # the config alone would say more
    assert model_window("org/st", M.load_config_and_tokenizer) == 16
    assert not any(name.endswith(".safetensors") for _, name, _ in Hub.seen)


def test_sentence_transformers_6s_layout_says_its_window_and_normalize_as_the_older_one(hub, tmp_path):
    """sentence-transformers 6 saves max_seq_length as tokenizer_config.json's model_max_length, its settings file
    without it, and new module type names: read the same as the older layout (16 tokens, Normalize), fetched before
    any weights; transformers' "none set" (1e30) and a plain model's tokenizer file (no modules.json) set no window."""
    from support.hub import read_sentence_transformers
    from support.retrieval import model_window

    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "2_Normalize",
                "type": "sentence_transformers.base.modules.normalize.Normalize"}]
    files = dict(hub["new"], **{"modules.json": json.dumps(modules).encode(),
                                "sentence_bert_config.json": b'{"transformer_task": "feature-extraction"}',
                                "tokenizer_config.json": b'{"model_max_length": 16}'})
    Hub.repos["org/st6"] = {"refs": {"main": NEW}, "commits": {NEW: files}}
    assert model_window("org/st6", M.load_config_and_tokenizer) == 16
    assert not any(name.endswith(".safetensors") for _, name, _ in Hub.seen)
    assert M.load_pretrained("org/st6", quiet=True)[0].sentence_transformers == {"max_seq_length": 16,
                                                                                 "normalize": True}
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": int(1e30)}))
    assert read_sentence_transformers(tmp_path) == {"normalize": True}
    (tmp_path / "modules.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 16}))
    assert read_sentence_transformers(tmp_path) == {}


def test_a_revision_pins_what_loads(hub, tmp_path, capsys, docs):
    import train

    old, _ = M.load_pretrained(f"org/tiny@{OLD}", quiet=True)
    new, _ = M.load_pretrained("org/tiny", quiet=True)
    assert same(weights(old), local_weights(hub["old"], tmp_path, "old"))
    assert same(weights(new), local_weights(hub["new"], tmp_path, "new")) and not same(weights(old), weights(new))
    with pytest.raises(UserError, match=r"^org/tiny: no revision 'v9' \(a branch, tag or commit of the repo\)$"):
        M.load_pretrained("org/tiny@v9")
    train.main(["--model", "org/tiny", "--data", str(docs), "--out", str(tmp_path / "run"), "--steps", "2",
                "--docs-per-step", "4", "--min-span", "4", "--max-span", "16", "--workers", "0",
                "--cache-dir", str(tmp_path / "cache")])
    from support.runs import read_train_state

    stored = read_train_state(tmp_path / "run" / "checkpoints" / "step-00000002")["config"]
    assert stored["model"] == f"org/tiny@{NEW}"  # the commit the run started from, not "main"


def test_bytes_that_differ_from_their_hash_never_land(hub, tmp_path):
    Hub.lie = "sha"
    with pytest.raises(UserError, match=r"^org/tiny: config.json differs from the hub's hash [0-9a-f]{40}; removed"):
        H.hub_download("org/tiny")
    cache = tmp_path / "home" / "hub" / "models--org--tiny"
    assert not [p for p in (cache / "blobs").iterdir()] and not list((cache / "snapshots").rglob("config.json"))


def test_unreachable_hub_and_missing_repo(hub, monkeypatch):
    with pytest.raises(UserError, match="^org/other: no such repo"):
        M.load_pretrained("org/other")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)  # its 5 retries, without the 23 s
    with pytest.raises(UserError, match=r"^org/tiny: cannot reach http://127.0.0.1:9 and it is not in the cache; "
                                        r"pass a local directory"):
        M.load_pretrained("org/tiny")


def test_unwritable_hf_home_says_so(hub, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "a-file" / "hf"))  # a folder that cannot be made
    with pytest.raises(UserError, match=r"cannot download into .*a-file/hf/hub .*; free space there or set HF_HOME"):
        M.load_pretrained("org/tiny")


@pytest.mark.slow
def test_a_full_disk_is_one_line_from_a_real_process(hub, tmp_path):
    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # the weights are ~80 KB

    r = subprocess.run([sys.executable, str(ROOT / "model.py"), "info", "org/tiny"], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120, preexec_fn=small_files)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("error: ") == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: org/tiny: model.safetensors: cannot download into") and "File too large" in last


@pytest.mark.slow
def test_offline_hub_id_is_one_line_from_a_real_process(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, str(ROOT / "model.py"), "info", "distilroberta-base"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "HF_HUB_OFFLINE" in r.stderr and "local folder" in r.stderr
