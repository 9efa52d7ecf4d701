"""What a run hands over around its weights: the model card (support/card.py) read back as the hub reads it
(huggingface_hub.ModelCard), TensorBoard's events (support/metrics.py) read back by TensorBoard's own reader and held
to metrics.jsonl step for step, across SIGTERM, kill -9 and --resume, and the picture of a run (support/plot.py)."""
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest

import model as M
import train as T
from conftest import ROOT, WORDS, oracle, stsb_dev
from support import card, metrics, plot
from test_train import reap, run_args  # noqa: F401 (reap: a fixture)


def scores_of(out) -> dict:
    return {r["step"]: r["stsb_dev_spearman"] for r in metrics.read_metrics(out) if "stsb_dev_spearman" in r}


def model_card(folder):
    from huggingface_hub import ModelCard  # tokenizers' own dependency, and the hub's reader of cards

    return ModelCard.load(folder / "README.md")  # its metadata checked as the hub checks it (a bad one raises)


@pytest.mark.slow
def test_a_runs_cards_read_back_as_the_hub_reads_them(tmp_path, docs):
    out = tmp_path / "e"
    T.main(run_args(docs, out, "--steps", "4", "--eval-every", "2", "--eval-data", str(stsb_dev())))
    scores, records = scores_of(out), metrics.read_metrics(out)
    assert sorted(scores) == [0, 2, 4]
    final = model_card(out / "model")
    assert final.data.library_name == "sentence-transformers" and final.data.pipeline_tag == "sentence-similarity"
    assert {"declutr", "sentence-transformers", "sentence-embeddings"} <= set(final.data.tags)
    assert final.data.base_model is None and final.data.license is None  # from scratch; the licence is the user's
    [result] = final.data.eval_results
    assert (result.metric_type, result.metric_value) == ("spearman_cosine", round(scores[4] / 100, 4))
    text = final.text
    assert f"- the model the run started from: {scores[0]:.2f}\n- this model (step 4): {scores[4]:.2f}" in text
    assert "- **Steps 1-4** ran on 1 process on 1 machine: CPU" in text
    last = records[-1]
    assert f"- **Losses** at step 4: contrastive {last['contrastive']:.4f}, MLM {last['mlm']:.4f}" in text
    assert f"{sum(r['tokens'] for r in records if r['step'] > 0):,} tokens in spans" in text
    assert "| `--min-span` | **`8`** | `32` |" in text and "| `--temperature` | `0.05` | `0.05` |" in text
    best_step = max((2, 4), key=scores.get)
    best = model_card(out / "best")
    assert best.data.eval_results[0].metric_value == round(scores[best_step] / 100, 4)
    assert f"It is the run's best model by STS-B dev ({scores[best_step]:.2f}), kept at step {best_step} of 4" in \
        best.text
    assert f"- **Steps 1-{best_step}** ran on" in best.text


def test_a_resumed_runs_card_says_where_each_stretch_ran(tmp_path, docs):
    out = tmp_path / "r"
    T.main(run_args(docs, out, "--steps", "2"))
    T.main(["--out", str(out), "--resume", "--steps", "4"])
    text = model_card(out / "model").text
    assert "- **Steps 1-2** ran on 1 process" in text and "- **Steps 3-4** ran on 1 process" in text
    assert "Not evaluated during the run" in text and model_card(out / "model").data.eval_results is None


def test_a_card_names_the_hub_model_a_run_started_from(tmp_path, tiny):
    folder = tmp_path / "m" / "model"
    M.save_pretrained(*M.load_pretrained(str(tiny)), folder)
    cfg = replace(T.TrainConfig(), model="FacebookAI/roberta-base@0123456789abcdef", data=["owt/"], lr=1e-4)
    records = [{"step": s, "contrastive": 1.0 / s, "mlm": 2.0, "lr": 5e-5, "tokens": 100} for s in (1, 2, 3)]
    machines = [{"from_step": 0, "world": 8, "machines": 2, "device": "NVIDIA H100", "dtype": "bfloat16"}]
    card.write_card(folder, cfg, records, machines, documents=48, total=3)
    read = model_card(folder)
    assert read.data.base_model == "FacebookAI/roberta-base"
    assert "[`FacebookAI/roberta-base`](https://huggingface.co/FacebookAI/roberta-base) (commit `0123456789ab`)" in \
        read.text
    assert "- **Steps 1-3** ran on 8 processes on 2 machines: NVIDIA H100, bfloat16." in read.text
    assert "- **Documents**: 48 (`--data owt/`); 3 steps of 16 drew 48 documents and 300 tokens in spans." in \
        read.text
    assert "| `--lr` | **`0.0001`** | `5e-05` |" in read.text


# --- TensorBoard ----------------------------------------------------------------------------------------------


def board(out) -> dict:
    """Every scalar in out/tensorboard as TensorBoard shows it: (step, value) by tag, steps a restart dropped gone."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(out / metrics.BOARD), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def from_metrics(out) -> dict:
    """metrics.jsonl's numbers by TensorBoard's tag, as TensorBoard keeps them (float32)."""
    curves = {}
    for r in metrics.read_metrics(out):
        for key, tag in metrics.TAGS.items():
            if r.get(key) is not None:
                curves.setdefault(tag, []).append((r["step"], float(np.float32(r[key]))))
    return curves


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_tensorboard_holds_metrics_jsonl_across_a_stop_and_resume(tmp_path, docs, reap, sig):  # noqa: F811
    """SIGTERM (the step under way checkpointed) or kill -9 (two steps after a checkpoint, whose events are on disk
    and are trained again): after --resume TensorBoard shows each step once, with metrics.jsonl's values."""
    oracle("tensorboard")
    out, dev = tmp_path / "b", str(tmp_path / "sts")  # a few pairs: what is logged, not what it scores, is tested
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "sts-dev.csv").write_text("".join(f"g\tf\t2012\t{k}\t{k % 5}\t{' '.join(WORDS[k % 5:])}\t"
                                             f"{' '.join(WORDS[:k % 7 + 2])}\n" for k in range(12)))
    cmd = [sys.executable, str(ROOT / "train.py"), *run_args(docs, out, "--steps", "12", "--ckpt-every", "4",
                                                            "--tensorboard", "--eval-data", dev, "--eval-every", "3")]
    p = reap(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while p.poll() is None and time.time() - t0 < 120:
        if len(metrics.read_metrics(out)) >= 7:  # step 0 (the start's score), then steps 1-6
            p.send_signal(sig)
            break
        time.sleep(0.01)
    err = p.communicate(timeout=60)[1]
    assert p.returncode == (143 if sig == signal.SIGTERM else -9), err[-2000:]
    stopped_at = max(r["step"] for r in metrics.read_metrics(out))
    if sig == signal.SIGKILL:  # steps past the checkpoint that the resumed run trains again
        assert stopped_at > 4 and max(s for s, _ in board(out)["train/contrastive"]) > 4
    T.main(["--out", str(out), "--resume"])
    seen, want = board(out), from_metrics(out)
    assert [s for s, _ in seen["train/contrastive"]] == list(range(1, 13))  # each step once
    assert [s for s, _ in seen["eval/stsb_dev"]] == [0, 3, 6, 9, 12]
    assert seen == want


def test_a_resumed_runs_events_sort_after_the_earlier_ones(tmp_path):
    """TensorBoard reads a folder's event files in name order, which begins with the second each was made; a resumed
    run's file made within the second of the last one (a quick restart) sorts after it all the same, so that its
    purge of the steps run again comes after them (a test's in-process resume once put it first)."""
    oracle("tensorboard")
    folder = tmp_path / metrics.BOARD
    folder.mkdir()
    last = folder / f"events.out.tfevents.{int(time.time())}.~"  # this second, named to sort after any host's name
    last.write_bytes(b"")
    metrics.Board.open(tmp_path, 4).close()
    assert sorted(folder.glob("events.out.tfevents.*"))[0] == last


def test_tensorboard_turned_on_at_resume_has_the_steps_before_and_without_the_package_the_run_goes_on(
        tmp_path, docs, capsys, monkeypatch):
    oracle("tensorboard")
    out = tmp_path / "t"
    T.main(run_args(docs, out, "--steps", "2"))
    T.main(["--out", str(out), "--resume", "--steps", "4", "--tensorboard"])
    assert board(out) == from_metrics(out) and len(board(out)["train/mlm"]) == 4
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as where the package is not installed
    T.main(run_args(docs, tmp_path / "n", "--steps", "2", "--tensorboard"))
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "--tensorboard" in line] == [
        "warning: --tensorboard: the tensorboard package is not installed (pip install tensorboard); the run goes "
        f"on, its numbers in {tmp_path / 'n' / 'metrics.jsonl'}"]
    assert len(metrics.read_metrics(tmp_path / "n")) == 2 and (tmp_path / "n" / "model").is_dir()


def test_overwrite_clears_the_earlier_runs_curves(tmp_path, docs):
    oracle("tensorboard")
    out = tmp_path / "o"
    T.main(run_args(docs, out, "--steps", "3", "--tensorboard"))
    T.main(run_args(docs, out, "--steps", "2", "--tensorboard", "--overwrite", "--lr", "1e-3"))
    assert board(out) == from_metrics(out) and len(board(out)["train/mlm"]) == 2


# --- the plot ---------------------------------------------------------------------------------------------------


def test_moving_mean_is_the_mean_of_each_value_and_those_before_it():
    values = [4.0, 2.0, 6.0, 0.0, 8.0]
    assert plot.moving_mean(values, 2) == [4.0, 3.0, 4.0, 3.0, 4.0]
    assert plot.moving_mean(values, 3) == [4.0, 3.0, 4.0, 8 / 3, 14 / 3]
    assert plot.moving_mean(values, 1) == values


@pytest.mark.slow
def test_the_plot_of_a_run_and_its_one_line_errors(tmp_path, docs, capsys, monkeypatch):
    oracle("matplotlib")
    out = tmp_path / "p"
    T.main(run_args(docs, out, "--steps", "3"))
    plot.main([str(out)])
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot.main([str(out), str(out), "--output", str(tmp_path / "two.png")])
    assert (tmp_path / "two.png").stat().st_size > 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"wrote {tmp_path / 'two.png'}"

    def one_line(argv):
        with pytest.raises(SystemExit) as e:
            plot.main(argv)
        [line] = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 1
        return line

    assert one_line([str(tmp_path)]) == \
        f"error: {tmp_path}: no metrics.jsonl here; name a run folder (train.py's --out)"
    assert one_line([str(out), "--output", str(tmp_path / "no" / "x.png")]).startswith("error: --output ")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert one_line([str(out)]) == ("error: the plot is drawn with matplotlib, which is not installed: pip install "
                                    "matplotlib")
