"""embed.py as a job of many processes that keeps what it has done (support/embed_job.py): 2 ranks under torchrun,
and two torchrun "machines" on loopback, write the bytes one process writes; a rank killed (SIGKILL) or the job
terminated (SIGTERM) half way keeps its finished blocks, and --resume, on 1 or 2 processes, ends with the same bytes;
a resume that would mix two jobs' rows is refused, naming what changed; nothing the user has is overwritten."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import embed as E
from conftest import ROOT, WORDS, run_here
from support import embed_job
from support.device import cpu_has_bf16
from test_train import free_port, reap, torchrun  # noqa: F401 (reap: a fixture)

ROWS, BLOCK = 3_000, 100  # 30 blocks: a job of about 2 s on 2 CPU processes, long enough to stop half way
SMALL = 1_200  # for the tests of one process: 30 blocks of 40


def texts_and_one_process(d, tiny, rows: int, block: int):
    """Texts of 1-60 words in d/in.txt, and what one uninterrupted process writes of them, as .npy and .jsonl."""
    rng = np.random.default_rng(0)
    (d / "in.txt").write_text("".join(" ".join(rng.choice(WORDS, rng.integers(1, 61))) + "\n" for _ in range(rows)))
    (d / "block").write_text(str(block))
    for fmt in ("npy", "jsonl"):
        E.main(args(tiny, d, d / f"one.{fmt}"))
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny):
    return texts_and_one_process(tmp_path_factory.mktemp("corpus"), tiny, ROWS, BLOCK)


@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny):
    return texts_and_one_process(tmp_path_factory.mktemp("small"), tiny, SMALL, SMALL // 30)


def args(tiny, d, out, *extra):
    return ["--model", str(tiny), str(d / "in.txt"), "--output", str(out), "--block", (d / "block").read_text(),
            "--threads", "1", *extra]


def job(reap, tiny, corpus, out, *extra, ranks=2, wait=True):  # noqa: F811
    """embed.py under torchrun with `ranks` processes (or one plain process): its (exit code, output)."""
    cmd = [sys.executable, str(ROOT / "embed.py")] if ranks == 1 else \
        torchrun(f"--nproc_per_node={ranks}", "--master_port", str(free_port()), str(ROOT / "embed.py"))
    p = reap([*cmd, *args(tiny, corpus, out, *extra)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
             env={**os.environ, "DECLUTR_PROGRESS_EVERY": "1"})
    if not wait:
        return p
    text = p.communicate(timeout=200)[0]
    return p.returncode, text


def ours(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("error: ", "embedding: "))]


def blocks_kept(out) -> int:
    folder = embed_job.job_folder(out)
    return len(embed_job.recorded(folder, ROWS // BLOCK, out.suffix == ".npy")) if folder.is_dir() else 0


def wait_for_blocks(p, out, blocks: int):
    t0 = time.time()
    while blocks_kept(out) < blocks:
        assert p.poll() is None, "the job ended before it could be stopped"
        assert time.time() - t0 < 120
        time.sleep(0.005)


def rank_pids(torchrun_pid: int) -> dict[str, int]:
    ranks = {}
    for pid in subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split():
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        ranks[next(v[5:].decode() for v in env if v.startswith(b"RANK="))] = int(pid)
    return ranks


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["npy", "jsonl"])
def test_two_ranks_write_the_bytes_of_one_process(tmp_path, tiny, corpus, reap, fmt):  # noqa: F811
    out = tmp_path / f"two.{fmt}"
    code, text = job(reap, tiny, corpus, out)
    assert code == 0, text
    assert out.read_bytes() == (corpus / f"one.{fmt}").read_bytes()
    assert not embed_job.job_folder(out).exists()  # the job's folder goes once the output has its name
    lines = ours(text)
    assert lines[0].startswith(f"embedding: {ROWS:,} texts with {tiny} on the CPU in "), lines  # what runs, then
    assert lines[0].endswith(f", into {out} on 2 processes"), lines  # where it goes
    assert lines[-1].startswith(f"embedding: wrote {out}: {ROWS:,} x 64 ("), lines
    shares = [int(k) for k in lines[-1].split("blocks by rank: ")[1].rstrip(")").split(", ")]
    assert len(shares) == 2 and min(shares) > 0 and sum(shares) == ROWS // BLOCK, lines  # shared, each block once


@pytest.mark.slow
@pytest.mark.parametrize("resume_ranks", [1, 2])
def test_a_rank_killed_half_way_keeps_its_blocks_and_resume_gives_the_same_bytes(tmp_path, tiny, corpus, reap,  # noqa: F811
                                                                                resume_ranks, monkeypatch, capsys):
    """kill -9 of rank 1 (the OOM killer): torchrun stops rank 0, whose line says the rows kept and the command that
    continues; nothing of the job is left running; --resume embeds only the blocks missing."""
    out = tmp_path / "k.npy"
    p = job(reap, tiny, corpus, out, wait=False)
    wait_for_blocks(p, out, 6)
    ranks = rank_pids(p.pid)
    os.kill(ranks["1"], signal.SIGKILL)
    text = p.communicate(timeout=60)[0]
    assert p.returncode != 0 and not out.exists()
    kept = blocks_kept(out)
    assert 6 <= kept < ROWS // BLOCK, kept
    [line] = [s for s in ours(text) if s.startswith("error: ")]
    assert line.startswith("error: terminated (SIGTERM); ") and " rows kept in " in line, line
    assert line.endswith(f"(continue with: torchrun --nproc_per_node=2 {ROOT / 'embed.py'} "
                         f"{' '.join(args(tiny, corpus, out))} --resume)"), line
    assert not any(alive(pid) for pid in ranks.values())
    kept_rows = int(line.split("; ")[1].split(" of ")[0].replace(",", ""))
    assert kept_rows >= kept * BLOCK  # at least what was on disk when the test looked
    if resume_ranks == 1:  # in this process, counting the blocks it embeds: only those missing
        real, calls = E.embed_tokenized, []
        monkeypatch.setattr(E, "embed_tokenized", lambda *a, **k: calls.append(1) or real(*a, **k))
        E.main(args(tiny, corpus, out, "--resume"))
        text = capsys.readouterr().err
        assert len(calls) == ROWS // BLOCK - kept_rows // BLOCK
    else:  # the blocks by rank, with the records of the job's first processes: each block once
        code, text = job(reap, tiny, corpus, out, "--resume", ranks=resume_ranks)
        assert code == 0, text
        assert sum(int(k) for k in ours(text)[-1].split("blocks by rank: ")[1].rstrip(")").split(", ")) == 30
    assert out.read_bytes() == (corpus / "one.npy").read_bytes()
    assert f"; {kept_rows:,} kept from before, {ROWS - kept_rows:,} to go" in ours(text)[0], ours(text)
    assert not embed_job.job_folder(out).exists()


@pytest.mark.slow
def test_sigterm_half_way_keeps_the_blocks_done_and_a_second_job_is_refused_meanwhile(tmp_path, tiny, corpus,
                                                                                     reap):  # noqa: F811
    """SIGTERM to torchrun (a scheduler's notice): one line, the rows kept, the command; while the job ran a second
    job into the same output was refused, naming the holder, and changed nothing; --resume on one process finishes
    the .jsonl the same, byte for byte."""
    out = tmp_path / "t.jsonl"
    p = job(reap, tiny, corpus, out, wait=False)
    wait_for_blocks(p, out, 4)
    r = run_here(E.main, *args(tiny, corpus, out, "--resume"))  # a second job, from this process
    assert r.returncode == 1 and f"error: --output {out}: another run is using it (pid " in r.stderr, r.stderr
    wait_for_blocks(p, out, 8)
    p.send_signal(signal.SIGTERM)
    text = p.communicate(timeout=60)[0]
    [line] = [s for s in ours(text) if s.startswith("error: ")]
    assert line.startswith("error: terminated (SIGTERM); ") and f" of {ROWS:,} rows kept in " in line, line
    assert p.returncode != 0 and not out.exists() and blocks_kept(out) >= 8
    E.main(args(tiny, corpus, out, "--resume"))
    assert out.read_bytes() == (corpus / "one.jsonl").read_bytes()


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_ends_every_process_and_resume_finishes(tmp_path, tiny, corpus, reap):  # noqa: F811
    """Ctrl-C in a terminal: SIGINT to torchrun's whole process group, every rank included. Each machine's first
    process says the rows kept and the command that continues; nothing of the job is left running; --resume on 2
    processes ends with one process's bytes."""
    out = tmp_path / "c.npy"
    p = job(reap, tiny, corpus, out, wait=False)
    wait_for_blocks(p, out, 6)
    ranks = rank_pids(p.pid)
    os.killpg(p.pid, signal.SIGINT)
    text = p.communicate(timeout=60)[0]
    assert p.returncode != 0 and not out.exists(), text
    lines = [s for s in ours(text) if s.startswith("error: ")]
    [line] = lines  # one machine: its first process speaks for it
    assert line.startswith("error: interrupted; ") and " rows kept in " in line and line.endswith(" --resume)"), text
    time.sleep(0.5)
    assert not any(alive(pid) for pid in ranks.values())
    code, text = job(reap, tiny, corpus, out, "--resume")
    assert code == 0, text
    assert out.read_bytes() == (corpus / "one.npy").read_bytes()


@pytest.mark.slow
def test_two_machines_on_loopback_write_one_output(tmp_path, tiny, corpus, reap):  # noqa: F811
    """Two torchrun "machines" (one process each, c10d on loopback) sharing a folder: one output, one process's bytes;
    each machine's first process would say a machine's error, and only the first machine's says the progress."""
    port, out = free_port(), tmp_path / "m.npy"
    procs = [reap(torchrun("--nnodes=2", "--nproc_per_node=1", f"--local_addr=127.0.0.{n + 1}", "--rdzv_backend=c10d",
                           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=declutr-embed", str(ROOT / "embed.py"),
                           *args(tiny, corpus, out)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    texts = [p.communicate(timeout=200)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], texts
    assert out.read_bytes() == (corpus / "one.npy").read_bytes()
    assert sorted(len(ours(t)) > 0 for t in texts) == [False, True], texts  # one machine speaks for the job


def stopped_at_block(tiny, small, out, monkeypatch, block: int, *extra):
    """One process, Ctrl-C as its `block`-th block is embedded (what came before is kept): its exit code and line."""
    real, calls = E.embed_tokenized, []

    def dying(*a, **k):
        calls.append(1)
        if len(calls) == block:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(E, "embed_tokenized", dying)
    try:
        E.main(args(tiny, small, out, *extra))
    except SystemExit as e:
        return e.code
    finally:
        monkeypatch.setattr(E, "embed_tokenized", real)


B = SMALL // 30


def folder_bytes(out):
    return {p.name: p.read_bytes() for p in embed_job.job_folder(out).iterdir() if p.name != ".declutr.lock"}


@pytest.mark.slow
def test_one_process_writes_each_blocks_rows_in_input_order(tiny, small):
    """What the byte-for-byte tests compare against, held to something else: each block of the .npy is embed.encode
    of that block's texts with the CPU's swaps made as embed.py makes them (short rows' attention written out;
    oneDNN's layers where they pay), bit for bit (a block is batched on its own), in input order; the .jsonl holds the
    same rows, each number rounded to 7 decimals."""
    import types

    import model as M
    from support import cpu_layers
    from support.device import device_and_dtype

    encoder, tok = M.load_pretrained(str(tiny), quiet=True)
    device, dtype = device_and_dtype("cpu", "auto")
    encoder = cpu_layers.for_inference(encoder, device, dtype, types.SimpleNamespace(dtype="auto", onednn=True))[0]
    texts = (small / "in.txt").read_text().splitlines()
    block = int((small / "block").read_text())
    want = np.concatenate([E.encode(texts[i:i + block], encoder, tok, dtype=dtype)
                           for i in range(0, len(texts), block)])
    assert np.array_equal(np.load(small / "one.npy"), want)
    rows = [json.loads(line)["embedding"] for line in (small / "one.jsonl").read_text().splitlines()]
    assert rows == [[round(float(x), 7) for x in row] for row in want]


def test_resume_refuses_what_would_mix_two_jobs_rows(tmp_path, tiny, small, monkeypatch, capsys):
    out = tmp_path / "r.npy"
    assert stopped_at_block(tiny, small, out, monkeypatch, 4) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"error: interrupted; {3 * B:,} of {SMALL:,} rows kept in {embed_job.job_folder(out)} "
                    f"(continue with: python embed.py {' '.join(args(tiny, small, out))} --resume)")
    before = folder_bytes(out)

    def refused(*extra, code=2):
        with pytest.raises(SystemExit) as e:
            E.main(args(tiny, small, out, *extra))
        assert e.value.code == code and not out.exists() and folder_bytes(out) == before
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert refused(code=1) == (f"error: --output {out}: a job into it stopped with {3 * B:,} of {SMALL:,} rows "
                               f"kept in {embed_job.job_folder(out)}; pass --resume to continue it, or --overwrite to "
                               f"start afresh")
    assert refused("--resume", "--normalize") == ("error: --resume: --normalize was False when the job began, True "
                                                  "now: the rows would not be one job's; run it as it began, or pass "
                                                  "--overwrite to start afresh")
    assert "--resume: --long was 'truncate' when the job began, 'chunk' now" in refused("--resume", "--long", "chunk")
    assert "--resume: --output-dtype was 'float32' when" in refused("--resume", "--output-dtype", "float16")
    # --dtype as it resolved: auto is bf16 on a CPU with AVX512-BF16 or AMX, fp32 elsewhere; the other one is refused
    was, now = ("bfloat16", "fp32") if cpu_has_bf16() else ("float32", "bf16")
    said = {"fp32": "float32", "bf16": "bfloat16"}[now]
    assert f"--dtype was '{was}' when the job began, '{said}' now" in refused("--resume", "--dtype", now)
    with pytest.raises(SystemExit):  # --block is a flag of its own: the rows would be batched otherwise
        E.main(["--model", str(tiny), str(small / "in.txt"), "--output", str(out), "--block", "50", "--threads",
                "1", "--resume"])
    assert "--resume: --block was 40 when the job began, 50 now" in capsys.readouterr().err
    other = tmp_path / "other-model"
    import model as M
    M.save_pretrained(*M.load_pretrained(str(tiny)), other)
    with pytest.raises(SystemExit):
        E.main(["--model", str(other), *args(tiny, small, out, "--resume")[2:]])
    assert f"--resume: {other.resolve()} is not the model the job began with ({tiny.resolve()})" in \
        capsys.readouterr().err
    # an input changed since: touched (its time), or grown (its size)
    text = (small / "in.txt").read_bytes()
    stat = (small / "in.txt").stat()
    try:
        os.utime(small / "in.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        assert refused("--resume", code=1) == (f"error: --resume: {(small / 'in.txt').resolve()} changed since the "
                                               f"job into {out} began (modified since): its rows would not be one "
                                               f"input's; pass --overwrite to start afresh")
        (small / "in.txt").write_bytes(text + b"one more\n")
        assert f"({len(text):,} bytes then, {len(text) + 9:,} now)" in refused("--resume", code=1)
    finally:
        (small / "in.txt").write_bytes(text)
        os.utime(small / "in.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    E.main(args(tiny, small, out, "--resume"))  # as it began: the job ends as one uninterrupted process's
    assert out.read_bytes() == (small / "one.npy").read_bytes() and not embed_job.job_folder(out).exists()
    E.main(args(tiny, small, out, "--resume"))  # nothing left to resume: said, and the output as it was
    assert "nothing to resume" in capsys.readouterr().err and out.read_bytes() == (small / "one.npy").read_bytes()


def test_a_stop_before_any_block_leaves_nothing_and_overwrite_starts_afresh(tmp_path, tiny, small, monkeypatch,
                                                                           capsys):
    out = tmp_path / "o.jsonl"
    assert stopped_at_block(tiny, small, out, monkeypatch, 1) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: interrupted; no block was finished, and " \
                                                                "nothing is kept"
    assert not out.exists() and not embed_job.job_folder(out).exists()
    assert stopped_at_block(tiny, small, out, monkeypatch, 3) == 130
    E.main(args(tiny, small, out, "--overwrite"))  # the unfinished job replaced by a whole new one
    assert out.read_bytes() == (small / "one.jsonl").read_bytes() and not embed_job.job_folder(out).exists()


def disk_full_at(n: int, monkeypatch):
    """embed_job's os.pwrite as a disk that fills up at its n-th write; returns the real one, to put back."""
    real, calls = os.pwrite, []

    def full(fd, data, offset):
        calls.append(1)
        if len(calls) == n:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(embed_job.os, "pwrite", full)
    return real


def test_a_write_that_fails_half_way_keeps_the_blocks_before_it(tmp_path, tiny, small, monkeypatch, capsys):
    """A disk that fills up in the middle: one line naming the output, the error and the rows kept; --resume on a
    freed disk finishes the job as one process would have."""
    out, real = tmp_path / "f.npy", disk_full_at(5, monkeypatch)
    with pytest.raises(SystemExit) as e:
        E.main(args(tiny, small, out))
    assert e.value.code == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: {out}: cannot write (No space left on device); {4 * B:,} of {SMALL:,} rows "
                           f"kept in "), line
    monkeypatch.setattr(embed_job.os, "pwrite", real)
    E.main(args(tiny, small, out, "--resume"))
    assert out.read_bytes() == (small / "one.npy").read_bytes()


def test_float16_rows_are_the_float32_rows_rounded(tmp_path, tiny, small):
    E.main(args(tiny, small, tmp_path / "h.npy", "--output-dtype", "float16"))
    half, full = np.load(tmp_path / "h.npy"), np.load(small / "one.npy")
    assert half.dtype == np.float16 and np.array_equal(half, full.astype(np.float16))
    assert (tmp_path / "h.npy").stat().st_size < 0.51 * (small / "one.npy").stat().st_size


def test_claims_take_every_block_left_once_in_order(monkeypatch):
    """The blocks left, as ranges, claimed one at a time: each once, in order (the counter a store would keep)."""
    j = embed_job.Job.__new__(embed_job.Job)
    j.plan, j.proc = {"todo": embed_job.ranges([0, 1, 2, 5, 7, 8, 11])}, type("P", (), {"store": None})()
    assert j.plan["todo"] == [[0, 3], [5, 6], [7, 9], [11, 12]]
    assert list(j.claims()) == [0, 1, 2, 5, 7, 8, 11]

    class Store:  # two processes asking in turn, as torchrun's store answers them
        n = 0

        def add(self, key, k):
            Store.n += k
            return Store.n

    j.proc = type("P", (), {"store": Store()})()
    a, b = j.claims(), j.claims()
    assert [next(a), next(b), next(b), next(a)] == [0, 1, 2, 5]
    assert sorted([*a, *b]) == [7, 8, 11]


def test_blocks_read_only_the_wanted_texts(tmp_path):
    """A process passes over the rows of blocks that others embed without decoding them (a .txt) or parsing them (a
    .jsonl): a malformed line there is not its to report."""
    from support import embedding

    (tmp_path / "a.txt").write_text("".join(f"t{i}\n" for i in range(7)))
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "j0"}) + "\nnot json\n\n" + json.dumps({"text": "j2"}) + "\n")
    inputs = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    assert list(embedding.blocks(inputs, {}, 3, [0, 3])) == [(0, ["t0", "t1", "t2"]), (3, ["j2"])]
    assert list(embedding.blocks([inputs[0]], {}, 3, [1])) == [(1, ["t3", "t4", "t5"])]
    assert list(embedding.blocks([inputs[0]], {}, 3)) == [(0, ["t0", "t1", "t2"]), (1, ["t3", "t4", "t5"]),
                                                          (2, ["t6"])]


def test_a_record_line_cut_short_by_a_kill_is_not_a_block(tmp_path):
    """A process killed while writing "12\n" may leave "1": only whole lines count, and a .jsonl block only with its
    part on disk."""
    (tmp_path / "done-0-h-1").write_text("3\n0\n1")
    (tmp_path / "done-1-h-2").write_text("2\n9\n")  # 9: beyond the job's blocks
    assert embed_job.recorded(tmp_path, 5, npy=True) == {0, 2, 3}
    (tmp_path / embed_job.part_name(2)).write_text("{}\n")
    assert embed_job.recorded(tmp_path, 5, npy=False) == {2}
    assert embed_job.blocks_by_rank(tmp_path) == "2, 2"


# Two embed.py processes that meet in the job's preparation: each waits for the same instant inside it, after finding
# no job folder, and both then go to make one (a real start meets there 1 time in 4 with 100,000 lines)
SAME_INSTANT = """
import sys, time
import support.embed_job as job
fresh, at = job.Job._fresh, float(sys.argv[1])
def met(self):
    time.sleep(max(0.0, at - time.time()))
    return fresh(self)
job.Job._fresh = met
import embed
embed.main(sys.argv[2:])
"""


@pytest.mark.slow
def test_two_jobs_started_at_one_instant_one_refused_the_other_untouched(tmp_path, tiny, small, reap):  # noqa: F811
    """Two embed.py into one --output that find no job folder at the same instant, three times: exactly one is refused
    (another run is using it), and the other writes its whole output, the naive one process's rows. Before the fix
    the refused one removed the folder, the other's lock and job.json with it, and both died."""
    expected = np.load(small / "one.npy")
    for round in range(3):
        out = tmp_path / f"out{round}.npy"
        at = f"{time.time() + 4:.3f}"  # both started, their models loaded, well before
        procs = [reap([sys.executable, "-c", SAME_INSTANT, at, *args(tiny, small, out)], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
        ends = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
        codes = sorted(code for code, _ in ends)
        refused = [err for code, err in ends if code == 1]
        assert codes == [0, 1], ends
        assert "another run is using it" in refused[0].strip().splitlines()[-1], refused
        np.testing.assert_array_equal(np.load(out), expected)
        assert not embed_job.job_folder(out).exists()
