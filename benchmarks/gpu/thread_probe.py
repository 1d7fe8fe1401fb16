"""Quick GPU check (`run.sh --quick`): on which thread, device and stream the HF engine generates off the main thread.

The rollout's own background machinery, `rl_lightning.rollout.async_rollout.ThreadGenerator` (what the rollout
callback runs with ``async_steps: 1`` and in-flight updates, given the rank's device), drives an
`rl_lightning.engines.hf.HFEngine` on the tiny SFT model (what is probed is the threading, not speed): two rollouts
of 2 prompts x 2 completions x 8 new tokens, submitted and taken as the callback does. The probe wraps, calling
through, the engine's ``generate`` to record at each call the thread, the device it selected
(`rl_lightning.rollout.engine_thread.selected_device`), its current CUDA device and its current stream. Issue 39's
rules for a background generation (on CUDA): the thread selected the rank's device before its first engine call (a
new host thread starts on device 0 whatever the rank), and it generates on a stream of its own, not the trainer's
(default) stream. On CPU the threads and the selected device are recorded; streams are n/a. (The PPO task refuses
``async_steps`` with the HF engine, hence the generator without a fit; the GPU machine has no vLLM.)

    python benchmarks/gpu/thread_probe.py --results RESULTS.jsonl [--dry]
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

import torch
from table import record
from task_fits import TINY_SFT
from train import setup


class ThreadProbe:
    """Records the thread, selected device, current device and stream of every engine ``generate``."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []  # one per generate call
        self._lock = threading.Lock()

    def watch(self, engine: Any) -> None:
        """Record every call of `engine`'s ``generate`` (then call it)."""
        from rl_lightning.rollout.engine_thread import selected_device

        generate, probe = engine.generate, self

        def recorded_generate(*args: Any, **kwargs: Any) -> Any:
            thread = threading.current_thread()
            call = {"thread": thread.name, "main": thread is threading.main_thread(),
                    "selected": selected_device(), "device": None, "own stream": None}
            if torch.cuda.is_available():
                call["device"] = torch.cuda.current_device()
                call["own stream"] = torch.cuda.current_stream() != torch.cuda.default_stream(call["device"])
            with probe._lock:
                probe.calls.append(call)
            return generate(*args, **kwargs)

        engine.generate = recorded_generate


def rows(path: Path, probe: ThreadProbe, device: torch.device) -> None:
    """The probe's findings: the threads that generated, and the device and stream rules of the background ones."""
    background = [c for c in probe.calls if not c["main"]]
    threads = sorted({c["thread"] for c in probe.calls})
    record(path, "quick threads engine calls off the main thread", len(background), "calls", ">= 1",
           bool(background), f"{len(probe.calls)} generate calls on threads {', '.join(threads)}")
    cuda = device.type == "cuda"
    selected = bool(background) and all(c["selected"] == device and (not cuda or c["device"] == device.index)
                                         for c in background)
    record(path, "quick threads device selected before engine call", "yes" if selected else "no", "", "yes", selected,
           f"rank's device {device}; per background call (selected device, current CUDA device): "
           f"{[(str(c['selected']), c['device']) for c in background]}")
    if not cuda:
        record(path, "quick threads own stream", "n/a (cpu)", "", "", True, "CPU: no streams")
        return
    own = bool(background) and all(c["own stream"] for c in background)
    record(path, "quick threads own stream", "yes" if own else "no (the default stream, the trainer's)", "", "yes",
           own, "torch.cuda.current_stream() at each background generate call vs the device's default stream")


def generator(device: torch.device) -> Any:
    """The rollout callback's generator with the rank's device (`rl_lightning.rollout.engine_thread`)."""
    from rl_lightning.rollout.async_rollout import ThreadGenerator

    return ThreadGenerator(device=device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="JSONL file the records are appended to")
    parser.add_argument("--dry", action="store_true", help="CPU (the CI smoke run)")
    args = parser.parse_args()
    from rl_lightning.engines.hf import HFEngine
    from rl_lightning.engines.protocol import SamplingParams
    from rl_lightning.models.loading import load_causal_lm, load_tokenizer

    device = setup(args.dry, process_group=False)
    probe = ThreadProbe()
    tokenizer = load_tokenizer(str(TINY_SFT))
    engine = HFEngine(load_causal_lm(str(TINY_SFT)).to(device).eval(), tokenizer.pad_token_id, device)
    probe.watch(engine)
    prompts = [tokenizer("1 + 1 =")["input_ids"], tokenizer("2 + 3 =")["input_ids"]]
    params = SamplingParams(n=2, max_new_tokens=8, seed=0)
    threads = generator(device)
    try:
        for rollout in range(2):  # as the callback: submit rollout k+1, take it at the next batch
            threads.submit((rollout,), rollout, lambda: engine.generate(prompts, params))
            if threads.take((rollout,)) is None:
                raise RuntimeError("thread_probe: the generator dropped a rollout submitted under its own key")
    finally:
        threads.close()
    rows(args.results, probe, device)


if __name__ == "__main__":
    main()
