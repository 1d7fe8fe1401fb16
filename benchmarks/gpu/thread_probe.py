"""Quick GPU check (`run.sh --quick`): on which thread, device and stream the HF engine generates off the main thread.

The rollout's own background machinery, `rl_lightning.rollout.async_rollout.ThreadGenerator` (what the rollout
callback runs with ``async_steps: 1`` and in-flight updates; given the rank's device where it takes one), drives an
`rl_lightning.engines.hf.HFEngine` on the tiny SFT model (what is probed is the threading, not speed): two rollouts
of 2 prompts x 2 completions x 8 new tokens, submitted and taken as the callback does. The probe wraps, calling
through, the engine's ``generate`` and ``torch.cuda.set_device`` (and the ``torch.cuda.device`` context) to record,
per thread, the device selections made and, at each engine call, the thread's current device and stream. Issue 39's
rules for a background generation (on CUDA): the thread selected the rank's device before its first engine call (a
new host thread starts on device 0 whatever the rank), and it generates on a stream of its own, not the trainer's
(default) stream. On CPU the threads are recorded and the device rules are n/a. (The PPO task refuses
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
    """Records device selections per thread, and the thread, device and stream of every engine ``generate``."""

    def __init__(self) -> None:
        self.selected: dict[str, list[Any]] = {}  # thread name -> devices selected, in order
        self.calls: list[dict[str, Any]] = []  # one per generate: thread, main?, selected before?, device, stream
        self._lock = threading.Lock()
        self._wrap_device_selection()

    def _note_selection(self, device: Any) -> None:
        with self._lock:
            self.selected.setdefault(threading.current_thread().name, []).append(str(device))

    def _wrap_device_selection(self) -> None:
        set_device, enter = torch.cuda.set_device, torch.cuda.device.__enter__
        probe = self

        def recorded_set_device(device: Any) -> None:
            probe._note_selection(device)
            set_device(device)

        def recorded_enter(context: Any) -> Any:
            probe._note_selection(getattr(context, "idx", "?"))
            return enter(context)

        torch.cuda.set_device = recorded_set_device  # type: ignore[assignment]
        torch.cuda.device.__enter__ = recorded_enter  # type: ignore[method-assign]

    def watch(self, engine: Any) -> None:
        """Record every call of `engine`'s ``generate`` (then call it)."""
        generate, probe = engine.generate, self

        def recorded_generate(*args: Any, **kwargs: Any) -> Any:
            thread = threading.current_thread()
            call = {"thread": thread.name, "main": thread is threading.main_thread(),
                    "selected": bool(probe.selected.get(thread.name)), "device": None, "own stream": None}
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
    if not cuda:
        selections = {name: devices for name, devices in probe.selected.items()}
        for what in ("device selected before engine call", "own stream"):
            record(path, f"quick threads {what}", "n/a (cpu)", "", "", True,
                   f"device selections per thread: {selections or 'none'}")
        return
    rank = torch.cuda.current_device()
    selected = all(c["selected"] and c["device"] == rank for c in background)
    record(path, "quick threads device selected before engine call", "yes" if selected else "no", "", "yes",
           bool(background) and selected,
           f"trainer device cuda:{rank}; per background call (selected?, device): "
           f"{[(c['selected'], c['device']) for c in background]}; selections per thread: {probe.selected}")
    own = all(c["own stream"] for c in background)
    record(path, "quick threads own stream", "yes" if own else "no (the default stream, the trainer's)", "", "yes",
           bool(background) and own, "torch.cuda.current_stream() at each background generate call")


def generator(device: torch.device) -> Any:
    """The rollout callback's generator, given the rank's device where it takes one."""
    import inspect

    from rl_lightning.rollout.async_rollout import ThreadGenerator

    takes_device = "device" in inspect.signature(ThreadGenerator).parameters
    return ThreadGenerator(device=device) if takes_device else ThreadGenerator()


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
