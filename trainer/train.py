"""``freescale train``: N ranks train an HSTU-style model on balanced microbatches from the loader.

One path for the data: the launching process (or torchrun's rank 0) writes the leave-last-out split once,
item ids already table rows (``trainer.data``); the ranks (``trainer.launch``: spawned locally, or one per
process under torchrun) are given only the config and the split's paths and sizes, and read it through
``loader.SequenceLoader``. Each rank runs the step loop (``trainer.loop``: the sharded table through the
overlap scheduler, M microbatches per step, dense gradients all-reduced, Adam and row-wise Adagrad); at the
end the ranks all-gather the table and rank 0 evaluates leave-last-out HR@10 / NDCG@10 over all items next
to the most-popular-items baseline (``trainer.evaluate``).

Instrumentation (``trainer.instrument``): per rank and step, compute / exposed communication / wait
seconds to ``metrics_out`` as JSONL, and a summary with the measured bubble fraction.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from trainer.config import TrainConfig
from trainer.instrument import summarize, write_jsonl
from trainer.launch import RankResult, spawn_local_ranks, torchrun_rank, under_torchrun

__all__ = ["TrainConfig", "report", "train"]


def train(cfg: TrainConfig) -> dict:
    """Run ``cfg.nproc`` local ranks (spawned, gloo/nccl on 127.0.0.1), or, under torchrun, this process
    as one rank of the launcher's world; the summary (``{"rank": r}`` on torchrun's other ranks), per-rank
    records in ``cfg.metrics_out`` (JSONL, written by rank 0) when set."""
    if not under_torchrun():
        return report(cfg, spawn_local_ranks(cfg))
    results = torchrun_rank(cfg)
    if results is None:
        return {"rank": int(os.environ["RANK"])}
    return report(cfg, results)


def report(cfg: TrainConfig, results: dict[int, RankResult]) -> dict:
    """The run's summary from every rank's result: losses per step, samples/s, the measured bubbles, rank 0's
    evaluation; written next to ``cfg.metrics_out`` with the JSONL records when set."""
    records = [r for rank in sorted(results) for r in results[rank]["records"]]
    if cfg.metrics_out:
        write_jsonl(cfg.metrics_out, records)
    per_step = {}
    for r in records:
        per_step.setdefault(r.step, []).append(r)
    losses = [sum(x.loss for x in per_step[s]) for s in sorted(per_step)]  # each rank's share of the global loss
    seconds = sum(max(x.step_s for x in per_step[s]) for s in per_step)
    samples = sum(x.samples for x in records)
    summary = {"config": asdict(cfg), "losses": losses,
               "samples_per_s": samples / seconds if seconds else 0.0, **summarize(records),
               **(results[0]["eval"] or {})}
    if cfg.metrics_out:
        Path(cfg.metrics_out).with_suffix(".summary.json").write_text(json.dumps(summary, indent=1))
    summary["_results"] = results
    return summary
