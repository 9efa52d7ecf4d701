"""However a run is stopped, it ends and can be resumed: Ctrl-C as a terminal sends it (SIGINT to the whole process
group), kill -9 as the out-of-memory killer sends it (to one process), a rank killed under torchrun; DataLoader
workers included (the demo's batches, about 85 KB each, fill the workers' pipe, where a worker that is not ended
properly hangs). After each, no process of the run is left. Also: a run's CPU thread count is part of it."""
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import train as T
from conftest import ROOT
from support import runs, threads
from test_train import assert_same_weights, default_sigint, free_port, run_args, torchrun, trace


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The demo's documents, collected once for the module."""
    from support.demo import demo_corpus

    folder = tmp_path_factory.mktemp("cache")
    demo_corpus(str(folder))
    return folder


def start(cmd, **kw):
    """A run in a session of its own (its process group is its pid, as a terminal's job), SIGINT at its default."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=default_sigint, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, **kw)


def session(sid: int) -> list[int]:
    """The live processes of a session (zombies, which hold nothing, left out), from /proc."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{name}/stat").read()
        except (OSError, ValueError):
            continue
        state, _, _, session_id = stat.rsplit(")", 1)[1].split()[:4]
        if name.isdigit() and int(session_id) == sid and state != "Z":
            pids.append(int(name))
    return pids


def gone_within(sid: int, seconds: float) -> list[int]:
    """The session's processes still alive after waiting up to `seconds` for them to end."""
    t0 = time.time()
    while session(sid) and time.time() - t0 < seconds:
        time.sleep(0.05)
    return session(sid)


@pytest.fixture
def sessions():
    """Every session a test starts is killed at its end, whatever is left in it."""
    sids = []
    yield sids.append
    for sid in sids:
        for pid in session(sid):
            os.kill(pid, signal.SIGKILL)


def wait_for_steps(p, out, steps: int, limit: float = 120):
    """Wait until out/metrics.jsonl holds `steps` steps; fail, saying so, if the run ends or the limit passes first."""
    metrics, t0 = out / "metrics.jsonl", time.time()
    while time.time() - t0 < limit:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        if p.poll() is not None:
            pytest.fail(f"the run ended (exit {p.returncode}) before step {steps}: nothing was signalled")
        time.sleep(0.01)
    pytest.fail(f"no step {steps} in {out / 'metrics.jsonl'} after {limit:.0f} s: nothing was signalled")


def demo(out, cache, *extra):
    return [sys.executable, str(ROOT / "train.py"), "--out", str(out), "--cache-dir", str(cache), *extra]


class Lines:
    """A process's output read as it comes, each line with the seconds since `t0` at which it came."""

    def __init__(self, stream):
        self.lines, self.t0 = [], time.time()
        self.thread = threading.Thread(target=lambda: self.lines.extend((time.time(), s) for s in stream))
        self.thread.start()

    def ours(self) -> list[tuple[float, str]]:
        self.thread.join(30)
        return [(t - self.t0, s.rstrip()) for t, s in self.lines if s.startswith("error: ")]


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["2", "0"])
def test_ctrl_c_to_the_process_group_ends_the_run_at_once(tmp_path, cache, sessions, workers):
    """A terminal's Ctrl-C (SIGINT to the whole group: the run and its DataLoader workers, the default 2 or none):
    one line, exit 130, within 10 s, and nothing of the run left."""
    p = start(demo(tmp_path / "r", cache, "--steps", "1000", "--workers", workers), stdout=subprocess.DEVNULL,
              stderr=subprocess.PIPE)
    sessions(p.pid)
    wait_for_steps(p, tmp_path / "r", 5)
    os.killpg(p.pid, signal.SIGINT)
    err = p.communicate(timeout=10)[1]
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.count("error: ") == 1, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("error: interrupted after step ")
    assert gone_within(p.pid, 10) == []


@pytest.mark.slow
def test_sigkill_leaves_nothing_running_and_resume_gives_the_uninterrupted_run(tmp_path, cache, sessions):
    """kill -9 of the training process while its workers run: within 10 s no process of it is left (none holds the
    run folder's lock), --resume is accepted at once, and its trace and weights equal a run never stopped, trained
    with the thread count the killed run stored (the resumed one takes it from the checkpoint)."""
    p = start(demo(tmp_path / "b", cache, "--steps", "16", "--ckpt-every", "4"), stdout=subprocess.DEVNULL,
              stderr=subprocess.DEVNULL)
    sessions(p.pid)
    wait_for_steps(p, tmp_path / "b", 6)
    p.kill()
    p.wait()
    assert gone_within(p.pid, 10) == []
    threads = runs.read_train_state(runs.checkpoints(tmp_path / "b")[-1])["config"]["threads"]
    assert threads >= 1
    T.main(["--out", str(tmp_path / "b"), "--resume"])
    T.main(demo(tmp_path / "a", cache, "--steps", "16", "--ckpt-every", "4", "--threads", str(threads))[2:])
    assert trace(tmp_path / "b") == trace(tmp_path / "a")
    assert_same_weights(tmp_path / "a" / "model", tmp_path / "b" / "model")


def torchrun_demo(out, cache, *extra):
    return torchrun("--nproc_per_node=2", "--master_port", str(free_port()), *demo(out, cache, *extra)[1:])


def ranks_of(torchrun_pid: int) -> dict[str, int]:
    """{RANK: pid} of torchrun's workers (each in a session of its own), from their environments."""
    ranks = {}
    for pid in subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split():
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        ranks[next(v[5:].decode() for v in env if v.startswith(b"RANK="))] = int(pid)
    return ranks


def torchrun_at_step_5(tmp_path, cache, sessions, *extra):
    """(torchrun, {RANK: pid}, its output from now on) of the demo on 2 ranks, once it has logged 5 steps."""
    p = start(torchrun_demo(tmp_path / "t", cache, "--steps", "1000", *extra), stdout=subprocess.PIPE,
              stderr=subprocess.STDOUT)
    sessions(p.pid)
    wait_for_steps(p, tmp_path / "t", 5)
    ranks = ranks_of(p.pid)
    for pid in ranks.values():
        sessions(pid)
    return p, ranks, Lines(p.stdout)


@pytest.mark.slow
def test_ctrl_c_under_torchrun_ends_every_rank_at_once(tmp_path, cache, sessions):
    """Ctrl-C in torchrun's terminal: torchrun passes SIGINT on to each rank's group (workers too); each machine's
    one line, and torchrun and every rank gone within 10 s (torchrun would SIGKILL a rank after 30)."""
    p, ranks, out = torchrun_at_step_5(tmp_path, cache, sessions, "--workers", "2")
    os.killpg(p.pid, signal.SIGINT)
    p.wait(timeout=10)
    ours = out.ours()
    assert [s for _, s in ours if s.startswith("error: interrupted after step ")] == [s for _, s in ours], ours
    assert len(ours) == 1, ours
    assert all(gone_within(pid, 5) == [] for pid in ranks.values())


@pytest.mark.slow
def test_a_rank_killed_under_torchrun_stops_the_others_at_once(tmp_path, cache, sessions):
    """kill -9 of rank 1 (what the OOM killer does) with its DataLoader workers running: its workers die with it, so
    its connections reset the moment it dies, and rank 0 says the documented line well before --ddp-timeout 20 and
    torchrun's own 30 s; nothing of rank 1 is left."""
    p, ranks, out = torchrun_at_step_5(tmp_path, cache, sessions, "--ddp-timeout", "20")
    os.kill(ranks["1"], signal.SIGKILL)
    p.wait(timeout=60)
    ours = out.ours()
    assert len(ours) == 1, ours
    seconds, line = ours[0]
    assert line.startswith("error: rank 0: another rank stopped after step ") and "Connection" in line, line
    assert seconds < 10, f"{seconds:.1f} s: {line}"  # the reset, not the 20 s timeout
    assert gone_within(ranks["1"], 5) == [] and gone_within(ranks["0"], 5) == []


def test_a_resumed_run_keeps_its_thread_count(tmp_path, docs, monkeypatch, capsys):
    """The default --threads 0 takes the cores free at the start: the count is stored, and a resume under another
    free-core count trains with the stored one, bit-identical to the run never stopped. A count given with --resume
    that differs goes on with it, in one line that says so. (And the count matters: 1 thread gives other weights.)"""
    def free(n):
        monkeypatch.setattr(threads, "default_threads", lambda: n)

    common = ["--steps", "8", "--ckpt-every", "4"]
    free(2)
    T.main(run_args(docs, tmp_path / "a", *common))
    assert runs.read_train_state(runs.checkpoints(tmp_path / "a")[-1])["config"]["threads"] == 2
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for name in ("model", "checkpoints/step-00000008"):
        shutil.rmtree(tmp_path / "b" / name)
    free(1)
    capsys.readouterr()
    T.main(["--out", str(tmp_path / "b"), "--resume"])
    assert "--threads" not in capsys.readouterr().err
    assert trace(tmp_path / "b") == trace(tmp_path / "a")
    assert_same_weights(tmp_path / "a" / "model", tmp_path / "b" / "model")
    T.main(run_args(docs, tmp_path / "one", *common))  # 1 free core, a new run: 1 thread, other weights
    assert runs.read_train_state(runs.checkpoints(tmp_path / "one")[-1])["config"]["threads"] == 1
    with pytest.raises(AssertionError):
        assert_same_weights(tmp_path / "a" / "model", tmp_path / "one" / "model")
    shutil.rmtree(tmp_path / "b" / "model")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000008")
    T.main(["--out", str(tmp_path / "b"), "--resume", "--threads", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert [e for e in err if "--threads" in e] == [
        "warning: --threads 1: the run trained with 2 CPU thread(s) per rank, and its steps from here differ from the "
        "run's own in the last digits (sums in another order); pass --threads 2 to continue it exactly"]


@pytest.mark.slow
def test_a_rank_killed_during_set_up_ends_the_other_in_seconds(tmp_path, docs, sessions, monkeypatch):
    """kill -9 of rank 1 before the process group is up (tests/die_at.py's "setup"): rank 0 waits inside the set-up's
    C call, where a Python handler cannot run, and torchrun's SIGTERM would go unheard until its SIGKILL 30 s later.
    Rank 0 says its one line within seconds of torchrun's SIGTERM, and nothing is left running."""
    monkeypatch.setenv("DIE_AT", "setup")
    p = start(torchrun("--nproc_per_node=2", "--master_port", str(free_port()), str(ROOT / "tests" / "die_at.py"),
                       *run_args(docs, tmp_path / "r", "--steps", "4")), stdout=subprocess.PIPE,
              stderr=subprocess.STDOUT)
    sessions(p.pid)
    lines = Lines(p.stdout)
    p.wait(timeout=60)
    ours = lines.ours()
    sampler = next(t for t, s in lines.lines if s.startswith("sampler:")) - lines.t0  # just before the set-up waits
    assert p.returncode != 0 and [s for _, s in ours] == ["error: terminated (SIGTERM) before training began"], ours
    assert ours[0][0] - sampler < 15, (sampler, ours)  # torchrun alone would take 30 s and more
    assert gone_within(p.pid, 10) == []


@pytest.mark.slow
@pytest.mark.parametrize("point", ["step", "agreement", "checkpoint", "evaluation", "end"])
def test_a_rank_killed_in_any_collective_is_one_line_from_the_other(tmp_path, docs, sessions, point, monkeypatch):
    """kill -9 of rank 1 under torchrun, wherever rank 0 then waits for it (tests/die_at.py): in the step's
    all-reduces, the SIGTERM agreement, the barrier after a checkpoint, after an evaluation, the last barrier. Rank 0
    says one line of ours, "another rank stopped", no traceback of ours; torchrun exits non-zero; nothing is left
    running; the checkpoint written before is whole."""
    sts = tmp_path / "sts"
    sts.mkdir()
    words = "the cat sat on a mat while dogs ran in parks".split()
    (sts / "sts-dev.csv").write_text("".join(f"g\tf\t2012\t{k}\t{k % 5}\t{' '.join(words[k % 5:])}\t"
                                             f"{' '.join(words[:k % 7 + 2])}\n" for k in range(12)))
    args = run_args(docs, tmp_path / "r", "--steps", "4", "--ckpt-every", "2" if point == "checkpoint" else "100",
                    *(["--eval-data", str(sts), "--eval-every", "2"] if point == "evaluation" else []))
    monkeypatch.setenv("DIE_AT", point)
    p = start(torchrun("--nproc_per_node=2", "--master_port", str(free_port()), str(ROOT / "tests" / "die_at.py"),
                       *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    sessions(p.pid)
    out = p.communicate(timeout=180)[0]
    ours = [line for line in out.splitlines() if line.startswith("error: ")]
    assert p.returncode != 0 and len(ours) == 1, out[-4000:]
    assert ours[0].startswith("error: rank 0: another rank stopped") and "last checkpoint: " in ours[0], ours
    assert not re.search(rf'File "{ROOT}/((support|tests)/)?\w+\.py"', out), out[-4000:]  # no frame of ours
    assert gone_within(p.pid, 30) == []
    if point == "checkpoint":
        [ckpt] = runs.checkpoints(tmp_path / "r")
        assert runs.read_train_state(ckpt)["step"] == 2 and ckpt.name in ours[0]


@pytest.mark.slow
def test_sigterm_inside_an_evaluation_ends_the_run_at_once(tmp_path, docs):
    """SIGTERM to torchrun while its 2 ranks evaluate the start (held-out spans, made 30 s slow): the run stops where
    it is, within 3 s of grace and the processes' own exit, trains no step and writes no checkpoint, saying so (it
    trained two more steps and took 10 s). Then, one process, a SIGTERM inside a later evaluation (step 2's): the run
    ends at once, its last checkpoint the one before (step 1's)."""
    def launch(cmd, **env):
        return subprocess.Popen(cmd, start_new_session=True, preexec_fn=default_sigint, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env})

    slow = str(ROOT / "tests" / "slow_eval.py")
    p = launch(torchrun("--nproc_per_node=2", "--master_port", str(free_port()), slow,
                        *run_args(docs, tmp_path / "two", "--holdout-docs", "0.25", "--steps", "4")),
               SLOW_EVAL_SECONDS="30")
    out = wait_for(p, "evaluation 0", 120)
    time.sleep(1)  # every rank inside it
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    out += p.communicate(timeout=60)[0]
    took = time.time() - t0
    assert p.returncode != 0 and took < 6, (took, out[-3000:])
    assert "terminated (SIGTERM) after step 0; last checkpoint: none" in out, out[-3000:]
    assert not list((tmp_path / "two").glob("checkpoints/step-*")) and gone_within(p.pid, 10) == []
    p = launch([sys.executable, slow, *run_args(docs, tmp_path / "one", "--holdout-docs", "0.25", "--steps", "4",
                                               "--eval-every", "2", "--ckpt-every", "1")],
               SLOW_EVAL_SECONDS="30", SLOW_EVAL_FROM="1")  # the start's evaluation quick, step 2's slow
    out = wait_for(p, "evaluation 1", 120)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    out += p.communicate(timeout=60)[0]
    assert p.returncode == 143 and time.time() - t0 < 3, out[-3000:]
    assert "terminated (SIGTERM) after step 2; last checkpoint:" in out and "step-00000001" in out, out[-3000:]
    assert [c.name for c in runs.checkpoints(tmp_path / "one")] == ["step-00000001"]


def wait_for(p, text: str, seconds: float) -> str:
    """A process's output until it says `text` (or ends, or `seconds` pass)."""
    out, t0 = "", time.time()
    while text not in out and p.poll() is None and time.time() - t0 < seconds:
        out += p.stdout.readline()
    assert text in out, out[-3000:]
    return out
