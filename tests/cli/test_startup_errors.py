"""Start-up errors that used to be tracebacks or misleading (issue 12): each is one line from the real CLI, with no
traceback, before any training step (a probe callback records steps) and, for the parallel layout, before Lightning
starts any process; data checks that refuse a run at setup (non-finite preference margins, context parallelism over
unpacked sequences)."""

import json
import subprocess
import sys
import types

import lightning as L
import pytest
from conftest import DEMO_DATA, TINY_MODEL

from rl_lightning.cli.main import main
from rl_lightning.cli.moved_paths import MOVED, new_path, resolves
from rl_lightning.data import SFTDataModule
from rl_lightning.data.loading import Rows
from rl_lightning.data.rows import check_preference_rows
from rl_lightning.errors import ConfigError, DataError
from rl_lightning.parallel import ParallelStrategy

PROBE = '''
import pathlib
import lightning as L

class StepProbe(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pathlib.Path("trained_a_step").touch()
'''


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])


def _fit_error(workdir, capsys, recipe, *args):
    (workdir / "step_probe.py").write_text(PROBE)
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", f"recipes/{recipe}", "--trainer.logger", "false", "--trainer.max_steps", "1",
              "--trainer.callbacks+=step_probe.StepProbe", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert not (workdir / "trained_a_step").exists()
    errors = [line for line in err.splitlines() if line.startswith("rl_lightning: error: ")]
    assert len(errors) == 1, err[-3000:]
    return errors[0].removeprefix("rl_lightning: error: ")


def test_non_utf8_data_file_names_file_line_and_fix(workdir, capsys):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 2
    data = "".join(json.dumps(r) + "\n" for r in rows).encode() + '{"messages": [{"role": "user", "content": "café"}]}'\
        .encode("latin-1")
    (workdir / "latin1.jsonl").write_bytes(data)
    error = _fit_error(workdir, capsys, "sft.yaml", "--data.path", "latin1.jsonl")
    offset = data.index(b"\xe9")
    assert error == (f"latin1.jsonl line 3: not UTF-8 text (byte 0xe9 at offset {offset}); re-save the file as UTF-8, "
                     "e.g. iconv -f latin1 -t utf-8 in.jsonl > out.jsonl")


def test_missing_local_model_folder_says_so(workdir, capsys):
    error = _fit_error(workdir, capsys, "sft.yaml", "--model.lm.name", "./models/never-downloaded")
    assert error == (f"model.lm.name './models/never-downloaded': the local folder does not exist (resolved to "
                     f"{workdir / 'models' / 'never-downloaded'}); check the path, or give a Hugging Face hub id such "
                     "as Qwen/Qwen2.5-0.5B-Instruct")


def test_message_without_role_says_the_field_is_missing(workdir, capsys):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"content": "q"}, {"role": "assistant", "content": "a"}]}]
    (workdir / "norole.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    error = _fit_error(workdir, capsys, "sft.yaml", "--data.path", "norole.jsonl")
    assert error == ("norole.jsonl line 2: messages[0] has no 'role' field (has ['content']); every message needs "
                     "'role' (one of system, user, assistant, tool) and 'content'")


def test_csv_rows_are_numbered_as_the_file_shows_them(workdir, capsys):
    good = json.dumps([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]).replace('"', '""')
    bad = json.dumps([{"role": "robot", "content": "q"}]).replace('"', '""')
    # header on line 1; a row whose quoted field spans lines 3-4; the bad row is on line 5
    (workdir / "chats.csv").write_text(f'messages,note\n"{good}",x\n"{good}","two\nlines"\n"{bad}",y\n')
    error = _fit_error(workdir, capsys, "sft.yaml", "--data.path", "chats.csv")
    assert error == ("chats.csv line 5: messages[0] has unknown role 'robot'; allowed roles: system, user, "
                     "assistant, tool")


@pytest.mark.parametrize("margin", ["0.5", None, float("nan"), True])
def test_margin_must_be_a_finite_number(margin):
    rows = Rows([{"messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b", "margin": margin}],
                "p.jsonl", [1])
    with pytest.raises(DataError, match="p.jsonl line 1: 'margin' must be a finite number"):
        check_preference_rows(rows)


def test_context_parallel_needs_packing():
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), packing=False)
    data.trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(cp_size=2))
    with pytest.raises(ConfigError, match="strategy.context_parallel_size=2 splits packed sequences; set data.packing"):
        data.setup("fit")


def test_parallel_layout_that_cannot_fit_stops_before_processes_start():
    with pytest.raises(ConfigError, match=r"= 2, but the job has 3 processes \(trainer.devices x trainer.num_nodes\)"):
        L.Trainer(accelerator="cpu", devices=3, strategy=ParallelStrategy(data_parallel_size=2), logger=False)
    # the fit that would launch processes is never reached: the Trainer itself refuses the layout


def test_parallel_layout_error_is_printed_once_by_the_real_cli(workdir):
    result = subprocess.run(
        [sys.executable, "-m", "rl_lightning", "fit", "--config", "recipes/sft.yaml", "--trainer.logger", "false",
         "--trainer.devices", "3", "--trainer.strategy", "rl_lightning.parallel.ParallelStrategy",
         "--trainer.strategy.data_parallel_size", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("rl_lightning: error:")]
    assert errors == ["rl_lightning: error: strategy sizes data_parallel_size=2 x context_parallel_size=1 x "
                      "tensor_parallel_size=1 = 2, but the job has 3 processes (trainer.devices x trainer.num_nodes); "
                      "make the product equal the world size"], result.stderr[-3000:]


# --- dotted paths from before the packages (issue 24): one line naming the key and the new path -------------------

MOVED_IN_YAML = {
    "callback": ("trainer:\n  callbacks:\n    - class_path: rl_lightning.export.HFExport\n",
                 "trainer.callbacks[0].class_path: rl_lightning.export.HFExport moved to "
                 "rl_lightning.tracking.export.HFExport"),
    "model-init-arg": ("model:\n  init_args:\n    lm:\n      lora:\n        class_path: rl_lightning.lora.LoRAConfig\n"
                       "        init_args:\n          r: 4\n",
                       "model.lm.lora.class_path: rl_lightning.lora.LoRAConfig moved to "
                       "rl_lightning.models.lora.LoRAConfig"),
    "second-callback": ("trainer:\n  callbacks:\n    - class_path: rl_lightning.cli.progress.RunProgress\n"
                        "    - class_path: rl_lightning.tracking.MLflowTracking\n",
                        "trainer.callbacks[1].class_path: rl_lightning.tracking.MLflowTracking moved to "
                        "rl_lightning.tracking.mlflow_run.MLflowTracking"),
}


@pytest.mark.parametrize("case", list(MOVED_IN_YAML))
def test_moved_path_in_a_config_names_the_key_and_the_new_path(case, workdir, capsys):
    content, expected = MOVED_IN_YAML[case]
    (workdir / "old.yaml").write_text(content)
    error = _fit_error(workdir, capsys, "sft.yaml", "--config", "old.yaml")
    assert error == f"{expected}; change it in your config (old.yaml)"


def test_moved_path_on_the_command_line(workdir, capsys):
    error = _fit_error(workdir, capsys, "sft.yaml", "--trainer.callbacks+=rl_lightning.outputs.RunOutputs")
    assert error == ("trainer.callbacks: rl_lightning.outputs.RunOutputs moved to rl_lightning.cli.outputs.RunOutputs; "
                     "change it on your command line")


def test_moved_path_from_a_real_process(workdir):
    (workdir / "old.yaml").write_text(MOVED_IN_YAML["callback"][0])
    result = subprocess.run([sys.executable, "-m", "rl_lightning", "fit", "--config", "recipes/sft.yaml", "--config",
                             "old.yaml"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "rl_lightning: error: trainer.callbacks[0].class_path: rl_lightning.export.HFExport moved to "
        "rl_lightning.tracking.export.HFExport; change it in your config (old.yaml)"]


@pytest.mark.parametrize(("old", "new"), [
    ("rl_lightning.export.HFExport", "rl_lightning.tracking.export.HFExport"),
    ("rl_lightning.tracking.MLflowTracking", "rl_lightning.tracking.mlflow_run.MLflowTracking"),
    ("rl_lightning.outputs.RunOutputs", "rl_lightning.cli.outputs.RunOutputs"),
    ("rl_lightning.progress.RunProgress", "rl_lightning.cli.progress.RunProgress"),
    ("rl_lightning.tune.Pruning", "rl_lightning.cli.tune.Pruning"),
    ("rl_lightning.lora.LoRAConfig", "rl_lightning.models.lora.LoRAConfig"),
    ("rl_lightning.optim.OptimConfig", "rl_lightning.models.optim.OptimConfig"),
    ("rl_lightning.models.load_causal_lm", "rl_lightning.models.loading.load_causal_lm"),
    ("rl_lightning.cli.RLLightningCLI", "rl_lightning.cli.main.RLLightningCLI"),
    ("rl_lightning.attention.packed_sdpa", "rl_lightning.attention.packed.packed_sdpa"),
    ("rl_lightning.attention.merge_partials", "rl_lightning.attention.kernels.merge_partials"),  # the block kernels
])
def test_new_path_of_each_moved_name(old, new):
    assert new_path(old) == new and resolves(new) and not resolves(old)


@pytest.mark.parametrize("path", ["rl_lightning.tracking.export.HFExport", "rl_lightning.models.loading.load_causal_lm",
                                  "rl_lightning.cli.main.main", "rl_lightning.tasks.SFT", "rl_lightning.tasks.ppo.PPO",
                                  "lightning.pytorch.callbacks.ModelCheckpoint", "rl_lightning.export"])
def test_current_paths_did_not_move(path):
    assert new_path(path) is None


def test_every_moved_module_is_gone_and_every_new_one_imports():
    import importlib
    import importlib.util

    for old, news in MOVED.items():
        spec = importlib.util.find_spec(old)
        assert spec is None or spec.submodule_search_locations is not None, old  # gone, or a package now
        for new in news:
            importlib.import_module(new)
