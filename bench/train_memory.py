"""
A CPU training run's memory and speed, step by step: the README's sentence-encoder command (all-MiniLM-L6-v2 on the
shared books, --holdout-docs 0.01 --no-mlm --positive-view adjacent --max-span 128; 2 threads) as train.py runs it
(glibc's heap as glibc leaves it), beside ways of keeping that heap from growing, the arms alternating, each a
process of its own on the same batches. Per arm: the median seconds a step and its ratio to glibc's own, the pages a
step took afresh (minor faults: memory given back and taken again costs them), the share of its CPU time in the
kernel, the memory after steps and the highest a step reached (VmHWM, reset before each step), along the run.

The arms: glibc (train.py as it is); trims (glibc's malloc_trim(0) after a step whose anonymous memory grew past
TRIM_ABOVE times what a step holds, measured after the first step and after each trimmed one); preload (another
allocator LD_PRELOAD'ed, where --preload names it: tcmalloc, or jemalloc with --malloc-conf), named by its library.
On tcmalloc, also what it holds from the kernel after each step (its page heap, free or in use) and what is in use:
the rise along a run is its free spans. Its environment passes through (TCMALLOC_RELEASE_RATE, the pace at which
tcmalloc gives free spans back). docs/measurements.md says what each cost.

    python bench/train_memory.py                                  # 2 arms x 2 rounds x 60 steps: about 30 min
    python bench/train_memory.py --arms trims --steps 1000 --rounds 1     # the long run: about 2 hours
    python bench/train_memory.py --arms glibc --preload libtcmalloc_minimal.so.4 --rounds 3   # glibc and tcmalloc
    python bench/train_memory.py --preload /usr/lib/x86_64-linux-gnu/libjemalloc.so.2   # and jemalloc's arm
    python bench/train_memory.py --arms --preload libtcmalloc_minimal.so.4 --replay 1 977 1000   # steps on their own
    TCMALLOC_RELEASE_RATE=100 python bench/train_memory.py --arms --preload libtcmalloc_minimal.so.4 --rounds 1

Linux only (/proc/self/status, clear_refs).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support.cli import UserError, bench, shared_assets  # noqa: E402

# PyTorch's CPU performance tuning guide's jemalloc settings: freed pages kept (never decayed back to the kernel),
# large blocks in their own extents
JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:-1,muzzy_decay_ms:-1"
TRIM_ABOVE = 1.15  # the trims arm: a trim after a step that leaves more than this times what a step holds

# The child: train.main with each step measured from its start to the next step's start (the optimiser's step and
# the log included); the trims arm trims there, before the next step begins
CHILD = """import ctypes, json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
import sampler, train
if os.environ.get("REPLAY_FROM"):  # --replay: this process's first step is that step's batch (the sampler's draw)
    _batch, _skip = sampler.SpanBatches.__getitem__, int(os.environ["REPLAY_FROM"]) - 1
    sampler.SpanBatches.__getitem__ = lambda self, i: _batch(self, int(i) + _skip)
trim = ctypes.CDLL(None).malloc_trim if sys.argv[3] == "trims" else None
log, step, last, heap = open(sys.argv[2], "w"), train.train_step, [None, None], {"holds": 0, "fresh": True, "n": 0}
try:  # tcmalloc's own accounting, where it is this process's malloc
    tcmalloc = ctypes.CDLL(None).MallocExtension_GetNumericProperty
except AttributeError:
    tcmalloc = None

def tcmalloc_heap():  # the bytes tcmalloc holds from the kernel (in use, or free and not given back), and in use
    if tcmalloc is None:
        return 0, 0
    got = {}
    for name in ("generic.heap_size", "tcmalloc.pageheap_unmapped_bytes", "generic.current_allocated_bytes"):
        value = ctypes.c_size_t(0)
        tcmalloc(name.encode(), ctypes.byref(value))
        got[name] = value.value
    return got["generic.heap_size"] - got["tcmalloc.pageheap_unmapped_bytes"], got["generic.current_allocated_bytes"]

def after_step(anonymous):  # the trims arm's policy: what a step holds measured after a fresh start
    if heap["fresh"]:
        heap["holds"], heap["fresh"] = max(heap["holds"], anonymous), False
    elif anonymous > float(sys.argv[4]) * heap["holds"]:
        trim(0)
        heap["fresh"], heap["n"] = True, heap["n"] + 1

def status():
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) << 10 for line in f
                if line.startswith(("VmRSS", "VmHWM", "RssAnon"))}

def usage():  # pages the kernel gave this process on first touch (memory taken afresh), and its CPU seconds
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_utime, r.ru_stime

def measured(*args, **kwargs):
    now, used = time.perf_counter(), usage()
    if last[0] is not None:
        s = status()
        faults, user, system = (a - b for a, b in zip(used, last[1]))
        held, in_use = tcmalloc_heap()
        log.write(json.dumps({"s": now - last[0], "rss": s["VmRSS"], "peak": s["VmHWM"], "faults": faults,
                              "user": user, "system": system, "trims": heap["n"], "tcmalloc_held": held,
                              "tcmalloc_in_use": in_use}) + "\\n")
        log.flush()
        if trim is not None:
            after_step(s["RssAnon"])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    last[:] = time.perf_counter(), usage()
    return step(*args, **kwargs)

train.train_step = measured
train.main(sys.argv[5:])
"""


def run_arm(a, arm: str, folder: Path, log: Path, replay: int = 0) -> list[dict]:
    shared = Path(a.shared)
    args = ["--model", str(shared / "models" / "all-MiniLM-L6-v2"), "--data", str(shared / "data/corpus/gutenberg"),
            "--holdout-docs", "0.01", "--no-mlm", "--positive-view", "adjacent", "--max-span", "128",
            "--threads", str(a.threads), "--workers", "0" if replay else "2",
            "--steps", str(a.steps + 1), "--ckpt-every", "1000000", "--out", str(folder / arm), "--overwrite",
            "--cache-dir", str(folder / "cache"), "--log-every", "100"]
    env = dict(os.environ, REPLAY_FROM=str(replay or ""))
    if arm not in ("glibc", "trims"):  # the preloaded allocator's
        env["LD_PRELOAD"], env["MALLOC_CONF"] = a.preload, a.malloc_conf
    subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(log), arm, str(TRIM_ABOVE), *args], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in log.read_text().splitlines()]


def along(rows: list[dict], key: str) -> str:
    marks = sorted({1, 10, *range(50, len(rows) + 1, 50 if len(rows) <= 300 else 250), len(rows)})
    return ", ".join(f"{k}: {rows[k - 1][key] / 1e9:.2f}" for k in marks if k <= len(rows))


def replay(a, arms: list[str]):
    """--replay: the step's own highest, its batch the first a fresh process trains on."""
    with tempfile.TemporaryDirectory() as d:
        for arm in arms:
            for step in a.replay:
                a.steps = 1
                rows = run_arm(a, arm, Path(d), Path(d) / f"{arm}-{step}.jsonl", replay=step)
                print(f"{arm}: step {step} on its own: {rows[0]['peak'] / 1e9:.2f} GB at its highest", flush=True)


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default=shared_assets(ROOT))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", nargs="*", default=["glibc", "trims"], choices=["glibc", "trims"])
    ap.add_argument("--preload", default="", help="another allocator's library (tcmalloc's, jemalloc's): an arm "
                    "more, named by it, LD_PRELOAD'ed into glibc's")
    ap.add_argument("--malloc-conf", default=JEMALLOC_CONF, help="jemalloc's arm's MALLOC_CONF (tcmalloc ignores "
                    "it)")
    ap.add_argument("--replay", nargs="*", type=int, default=[], help="instead: each of these steps' batch as the "
                    "first step of a fresh process (what that step needs on its own), in each arm")
    ap.add_argument("--json", default="", help="also write every arm's steps here")
    ap.add_argument("--logs", default="", help="a folder to keep each arm's steps in as they run (a long run's, "
                    "read while it runs); a temporary one otherwise")
    a = ap.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        raise UserError("bench/train_memory.py reads Linux's /proc/self/status and clear_refs: Linux only")
    if not (Path(a.shared) / "models" / "all-MiniLM-L6-v2").is_dir():
        raise UserError(f"{a.shared}: no models/all-MiniLM-L6-v2 (--shared, or DECLUTR_SHARED)")
    preloaded = next((n for n in ("tcmalloc", "jemalloc") if n in Path(a.preload).name), "preload")
    arms = a.arms + ([preloaded] if a.preload else [])
    runs = {arm: [] for arm in arms}
    if a.replay:
        return replay(a, arms)
    with tempfile.TemporaryDirectory() as d:
        logs = Path(a.logs or d)
        logs.mkdir(parents=True, exist_ok=True)
        for r in range(a.rounds):
            for arm in arms:
                rows = run_arm(a, arm, Path(d), logs / f"{arm}-{r}.jsonl")
                runs[arm].append(rows)
                print(f"round {r + 1}, {arm}: {statistics.median(x['s'] for x in rows[1:]):.2f} s a step", flush=True)
    base = "glibc" if "glibc" in runs else arms[0]
    median = {arm: statistics.median(x["s"] for rows in rr for x in rows[1:]) for arm, rr in runs.items()}
    print(f"\n{a.steps} steps, {a.rounds} round(s); seconds a step from the second on (median over rounds)")
    for arm, rr in runs.items():
        spread = [statistics.median(x["s"] for x in rows[1:]) for rows in rr]
        steps = [x for rows in rr for x in rows[1:]]
        faults = statistics.median(x["faults"] for x in steps)
        kernel = sum(x["system"] for x in steps) / sum(x["user"] + x["system"] for x in steps)
        print(f"{arm}: {median[arm]:.2f} s a step (rounds {', '.join(f'{s:.2f}' for s in spread)}), "
              f"x {median[arm] / median[base]:.3f} of {base}'s; {faults:,.0f} pages taken afresh a step (median), "
              f"{100 * kernel:.1f}% of its CPU time in the kernel; {rr[0][-1]['trims']} trims in round 1")
        print(f"  GB after the step: {along(rr[0], 'rss')}")
        print(f"  GB at the step's highest: {along(rr[0], 'peak')}")
        if rr[0][-1].get("tcmalloc_held"):  # what the rise is: tcmalloc's page heap, in use or free between steps
            print(f"  GB tcmalloc holds after the step: {along(rr[0], 'tcmalloc_held')}; in use: "
                  f"{along(rr[0], 'tcmalloc_in_use')}")
    if a.json:
        Path(a.json).write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
