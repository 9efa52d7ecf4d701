"""
support: the machinery a reader does not need to learn DeCLUTR, one concern a module. It imports no method file
(sampler, model, loss, train, embed, evaluate_sts); what it needs of them is handed in.

    cli.py      the one-line user error, flags from config dataclasses, printing, progress lines
    files.py    atomic writes, JSON, the cache folder, the files under a folder, what a path is
    corpus.py   the user's documents read and tokenised once into a memmap
    demo.py     `python train.py` with no --data: its settings and Python's own documentation
    device.py   batches onto the device, precision, CPU threads, random state, compiled graphs
    chunks.py   a step's spans cut into chunks of similar length, each chunk's inputs on the device
    processes.py  torchrun's processes: where each is, what rank 0 makes once for all
    runs.py     train.py's run flags; the run folder, its lock and checkpoints, where a run starts, resuming
    metrics.py  a run's record of its steps: metrics.jsonl, the log lines, TensorBoard's events (--tensorboard)
    card.py     the model card (README.md) beside each model a run hands over
    plot.py     `python -m support.plot RUN`: a picture of a run from its metrics.jsonl
    stopping.py how a run stops: Ctrl-C, SIGTERM, out of memory, a rank gone, each in one line
    workers.py  DataLoader workers that can neither outlive the run nor keep it from ending
    hub.py      Hugging Face files: downloads, tokenizers, config.json, safetensors
    model_tools.py  `python model.py info | convert | scratch`, model.py's loader and saver handed in
    embedding.py  embed.py's inputs checked and read in blocks, progress, a CPU's bf16 batch shapes
    embed_job.py  embed.py's job: blocks shared out among processes, kept as they are done, --resume
    sts_files.py  the STS tasks' files in their original layouts, the STS Benchmark's download, the table
    retrieval.py  held-out span retrieval: its pairs, drawn once, its figures, word overlap's (BM25, TF-IDF)
"""
