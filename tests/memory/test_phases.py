"""Per-phase memory (issue 26, item 0): each phase's own host peak (the kernel's high-water mark reset at its start),
nesting, threads; malloc_trim giving glibc's retained heap back; the MemoryProfile callback on SFT and GRPO fits."""

import ctypes
import sys
import threading

import pytest
import torch

from rl_lightning.memory.phases import PhaseProfiler, phase, release_host_memory, rss_mib
from rl_lightning.models.config import LMConfig

MIB = 1 << 20
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs and glibc are Linux's")


def _touch(mib: int) -> torch.Tensor:
    return torch.ones(mib * MIB // 4)  # float32, every page written


def _fresh(fn):
    """`fn()` in a new process: resident-memory deltas of a long test session depend on what earlier tests left in
    the allocators (a freed heap reused without new pages), so each measurement starts from a clean process."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn).result(timeout=300)


def _own_peaks():
    with PhaseProfiler() as profiler:
        with phase("big"):
            big = _touch(300)
            del big
        with phase("small"):
            small = _touch(20)
            del small
    return profiler.records


def _nested_peaks():
    with PhaseProfiler() as profiler:
        with phase("outer"):
            with phase("inner"):
                tensor = _touch(200)
                del tensor
            after = _touch(10)
            del after
    return profiler.records, profiler.summary()


def _measurements():
    return {"own": _own_peaks(), "nested": _nested_peaks(), "spike": _peak_after_spike()}


@pytest.fixture(scope="module")
def fresh():
    """The three measurements, in one new process."""
    return _fresh(_measurements)


@linux
def test_a_phase_peak_is_its_own_not_the_process_maximum(fresh):
    big, small = fresh["own"]
    assert (big.name, small.name) == ("big", "small") and big.exact and small.exact
    assert big.peak_rss_mib - big.start_rss_mib >= 290  # the 300 MiB tensor, though freed before the phase ended
    assert small.peak_rss_mib - small.start_rss_mib < 100  # not the earlier phase's 300 MiB
    assert abs(big.end_rss_mib - big.start_rss_mib) < 50  # freed (torch returns large blocks to the system)


@linux
def test_inner_peaks_count_for_the_phases_around_them(fresh):
    (inner, outer), summary = fresh["nested"]
    assert (inner.name, outer.name) == ("inner", "outer")
    assert outer.peak_rss_mib >= inner.peak_rss_mib >= inner.start_rss_mib + 190
    assert summary["outer"]["count"] == summary["inner"]["count"] == 1
    assert summary["outer"]["peak_rss_mib"] == outer.peak_rss_mib


def test_phases_are_free_without_a_profiler_and_ignored_on_other_threads():
    with phase("nobody listens"):
        pass
    with PhaseProfiler() as profiler:
        worker = threading.Thread(target=lambda: phase("background").__enter__())
        worker.start()
        worker.join()
        with phase("main"):
            pass
    assert [r.name for r in profiler.records] == ["main"]


def test_a_phase_closed_out_of_order_is_an_error():
    profiler = PhaseProfiler()
    profiler.enter("a")
    profiler.enter("b")
    with pytest.raises(RuntimeError, match="memory phase 'a' ended while 'b' was open"):
        profiler.exit("a")


def _heap_kept_and_released():
    """250 MiB of 64 KiB heap blocks freed under a pin: what glibc keeps resident, then what malloc_trim returns.
    Runs in a fresh process: M_MMAP_THRESHOLD is process-wide, and a long session's heap has free chunks of its own."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 64 KiB blocks come from the heap, as glibc's dynamic threshold makes
    blocks = []  # 4000 x 64 KiB = 250 MiB of heap, every page touched
    for _ in range(4000):
        block = libc.malloc(64 << 10)
        ctypes.memset(block, 1, 64 << 10)
        blocks.append(block)
    pin = libc.malloc(200 << 10)  # larger than any free chunk: carved from the top, so the heap cannot shrink there
    pinned_above = pin > max(blocks)
    before = rss_mib()
    for block in blocks:
        libc.free(block)
    kept = rss_mib()
    trimmed = release_host_memory()
    released = kept - rss_mib()
    libc.free(pin)
    return {"pinned_above": pinned_above, "freed_but_kept": before - kept, "trimmed": trimmed, "released": released}


@linux
def test_malloc_trim_returns_the_heap_glibc_keeps():
    heap = _fresh(_heap_kept_and_released)
    assert heap["pinned_above"]
    assert heap["freed_but_kept"] < 50, heap  # glibc kept the freed 250 MiB resident for reuse
    assert heap["trimmed"] and heap["released"] > 150, heap  # malloc_trim gives most of it back to the system


@pytest.fixture(scope="module")
def grpo_profile(tmp_path_factory):
    from helpers import run_ppo

    from rl_lightning.callbacks.memory_profile import MemoryProfile

    out = tmp_path_factory.mktemp("profile")
    profile = MemoryProfile(dirpath=str(out))
    model, trainer = run_ppo(rollouts=2, callbacks=[profile])
    return model, trainer, out


def test_grpo_fit_profiles_every_phase_of_a_step(grpo_profile):
    _, trainer, out = grpo_profile
    table = (out / "memory_phases.md").read_text()
    expected = ["rollout/weight_sync", "rollout/generate", "rollout/score", "train/score", "train/forward",
                "train/backward", "train/optimizer_step"]
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in table.splitlines()[2:]}
    assert set(expected) <= set(rows), table
    assert rows["rollout/generate"].split(" | ")[1] == "2"  # one generation per rollout (single turn)
    assert rows["train/optimizer_step"].split(" | ")[1] == "2"  # one minibatch per rollout
    metrics = trainer.callback_metrics
    for name in expected:
        assert float(metrics[f"memory/phase/{name}/peak_rss_mib"]) > 100  # a real process's resident memory


def test_sft_fit_profiles_lightning_hooks_checkpoint_and_export(tmp_path):
    import lightning as L
    from conftest import DEMO_DATA, TINY_MODEL
    from helpers import fit

    from rl_lightning.callbacks.memory_profile import MemoryProfile
    from rl_lightning.data import SFTDataModule
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.tasks import SFT
    from rl_lightning.tracking.export import HFExport

    L.seed_everything(0)
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4, max_length=96,
                         max_length_per_device=256)
    model = SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant")))
    fit(model, data, 2, [MemoryProfile(dirpath=str(tmp_path)), HFExport(str(tmp_path / "export"), log_model=False)])
    table = (tmp_path / "memory_phases.md").read_text()
    counts = {line.split(" | ")[0].removeprefix("| "): int(line.split(" | ")[1]) for line in table.splitlines()[2:]}
    assert counts == {"train/forward": 2, "train/backward": 2, "train/optimizer_step": 2, "export": 1}, table  # one micro-batch a step


def _peak_after_spike():
    from rl_lightning.memory.phases import host_peak_mib, process_peak_mib

    start = rss_mib()
    spike = _touch(400)
    del spike
    with PhaseProfiler():
        with phase("after the spike"):
            pass
    return start, host_peak_mib(), process_peak_mib()


@linux
def test_the_process_peak_survives_the_phase_resets(fresh):
    start, kernel_mark, process_peak = fresh["spike"]
    assert kernel_mark < start + 200  # the kernel's mark was reset by the phase
    assert process_peak >= start + 390  # the spike is still the process's peak
