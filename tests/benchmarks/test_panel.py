"""`benchmarks/panel_units.py`: the panel sweep's resume/skip logic and its table, on a small fake results file (pure
functions, no model)."""

import json
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from panel_tasks import PANEL, SUMS, data_path, short_name  # noqa: E402
from panel_units import append_result, load_results, pending, plot, sweep_units, table  # noqa: E402

SUMS_BASE = {"task": "sums", "seed": 0, "setting": "base", "greedy": 0.25}
RUNS = [{"task": "sums", "seed": 0, "setting": "demo", "greedy": 0.5},
        {"task": "sums", "seed": 1, "setting": "demo", "greedy": 0.3},
        {"task": "products", "seed": 0, "setting": "base", "greedy": 0.2},
        {"task": "products", "seed": 0, "setting": "demo", "greedy": 0.1}]


def test_a_killed_sweep_resumes_with_the_units_not_yet_written(tmp_path):
    results = tmp_path / "panel" / "results.jsonl"
    assert load_results(results) == []
    units = sweep_units(["sums", "products"], [0, 1], ["demo"])
    assert units == [("sums", 0, "base"), ("sums", 0, "demo"), ("sums", 1, "demo"),
                     ("products", 0, "base"), ("products", 0, "demo"), ("products", 1, "demo")]
    append_result(results, SUMS_BASE)
    append_result(results, RUNS[0])
    with results.open("a") as f:  # killed while writing the third unit
        f.write('{"task": "sums", "seed": 1, "set')
    records = load_results(results)
    assert records == [SUMS_BASE, RUNS[0]]
    assert pending(units, records) == units[2:]
    append_result(results, RUNS[1])  # the cut line stays a line of its own, skipped
    assert load_results(results) == [SUMS_BASE, RUNS[0], RUNS[1]]
    assert pending(units, load_results(results)) == units[3:]
    assert pending(units + units[:4], []) == units  # each unit once


def test_table_has_base_mean_spread_and_worst_seed_change():
    text = table([SUMS_BASE, *RUNS]).splitlines()
    assert text[0] == "| task | base | noise (points) | demo: after | demo: min Δ (points) |"
    # mean 0.4, sample std, 0.3 - 0.25; noise 2 sqrt(0.25 * 0.75 / 256) = 5.4 points
    assert text[2] == "| `sums` | 0.250 | 5.4 | 0.400 ± 0.141 (2 seeds) | +5.0 |"
    assert text[3] == "| `products` | 0.200 | 5.0 | 0.100 (1 seed) | -10.0 ✗ |"  # below minus the noise: a loss
    assert table([RUNS[0], {**RUNS[0], "greedy": 0.2}], settings=["demo"]).splitlines()[2] == \
        "| `sums` |  |  | 0.200 (1 seed) |  |"  # a unit's later record wins; no base yet: no change


def test_table_by_seed_lists_each_seed_and_names_the_seeds_when_not_0_1_2():
    text = table([SUMS_BASE, *RUNS], settings=["demo"], per_seed=True).splitlines()
    assert text[0] == "| task | base | noise (points) | demo: after, by seed | demo: min Δ (points) |"
    assert text[2] == "| `sums` | 0.250 | 5.4 | 0.500, 0.300 | +5.0 |"
    seed_3 = {**RUNS[1], "seed": 3, "greedy": 0.125}
    assert table([SUMS_BASE, RUNS[0], seed_3], per_seed=True).splitlines()[2] == \
        "| `sums` | 0.250 | 5.4 | 0.500 (seed 0), 0.125 (seed 3) | -12.5 ✗ |"


def test_train_and_held_out_paths_share_the_sizes_and_data_seed():
    assert PANEL[0] == SUMS
    assert data_path(SUMS, "test") == (SUMS + "&train_size=1000&test_size=256&seed=0&split=test")
    assert data_path("reasoning_gym:count_bits", "train") == \
        "reasoning_gym:count_bits?train_size=1000&test_size=256&seed=0&split=train"
    assert short_name(SUMS) == "chain_sum_min_terms2_max_terms2_max_digits2"
    assert json.loads(json.dumps(PANEL)) == list(PANEL)


def test_trls_gated_shaping_matches_ours_on_trls_group_order():
    """`real_grpo.gated`: a TRL reward function counted only in groups (consecutive completions, TRL's order) with a
    correct completion, by our `gated_shaping`; TRL logs it under the wrapped function's name."""
    import real_grpo

    def overlong(completions, **_):
        return [-0.5, -1.0, 0.0, -0.25]

    def correct(completions, answer, **_):
        return [0.0, 0.0, 1.0, 0.0]

    wrapped = real_grpo.gated(overlong, correct, group=2)
    assert wrapped(completions=["a", "b", "c", "d"], answer=["1"] * 4) == [0.0, 0.0, 0.0, -0.25]
    assert wrapped.__name__ == "overlong"


def test_plot_draws_one_curve_per_seed_of_each_setting(tmp_path):
    curves = {"curves": {"train/reward/correct": [0.1, 0.2, 0.3]}}
    records = [SUMS_BASE, *({**r, **curves} for r in RUNS)]
    path = tmp_path / "curves.png"
    assert plot(records, ["sums", "products"], ["demo"], path) == 3  # sums seeds 0 and 1, products seed 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot(records, ["sums"], ["ungated"], tmp_path / "none.png") == 0  # no run of that setting


def test_trl_flags_are_the_recipes_and_the_demos_settings():
    """The `trl` units run TRL with the default's settings: the flags agree with recipes/real/grpo.yaml and the demo
    overlay (a recipe change that forgets TRL fails here), each TRL setting changes only flags TRL's run has, and
    `trl_gated` is `gated`'s punishment."""
    import yaml
    from panel import SETTINGS, TRL_FLAGS, TRL_SETTINGS

    recipe = yaml.safe_load((REPO / "rl_lightning" / "recipes" / "real" / "grpo.yaml").read_text())
    demo = yaml.safe_load((REPO / "rl_lightning" / "cli" / "demo.yaml").read_text())
    model, overlay = recipe["model"]["init_args"], demo["model"]["init_args"]
    rollout = {**model["rollout"], **overlay.get("rollout", {})}
    optim = {**model["lm"]["optim"], **overlay["lm"]["optim"]}
    expected = {"rollouts": overlay["max_rollouts"], "prompts": demo["data"]["init_args"]["batch_size"],
                "group": rollout["responses_per_prompt"], "max_new_tokens": rollout["max_new_tokens"],
                "temperature": rollout["temperature"], "lr": optim["lr"], "warmup": optim["warmup_steps"],
                "format_weight": rollout["reward_weights"]["format"],
                "overlong_cache": (model.get("dapo") or {}).get("overlong_cache_length") or 0,
                "gate_shaping": rollout["gate_shaping"]}
    assert TRL_FLAGS == expected
    assert set(TRL_SETTINGS) <= set(SETTINGS) and all(set(c) <= set(TRL_FLAGS) for c in TRL_SETTINGS.values())
    assert TRL_SETTINGS["trl_gated"]["overlong_cache"] == SETTINGS["gated"]["model"]["init_args"]["dapo"][
        "overlong_cache_length"]
    # the 8 x 4 settings (the default of stops 46-48) keep that size in both libraries
    for ours, trl in (("prompts8", "trl_prompts8"), ("gated", "trl_gated")):
        assert TRL_SETTINGS[trl]["prompts"] == SETTINGS[ours]["data"]["init_args"]["batch_size"] == 8


def test_results_page_splits_the_default_and_trl_from_the_rest_and_drops_an_empty_table(tmp_path):
    import panel
    from panel_tasks import SKIPPED

    skipped = next(iter(SKIPPED))
    sums = [{**SUMS_BASE, "task": SUMS}, {**RUNS[0], "task": SUMS, "fit_s": 1}, {**RUNS[1], "task": SUMS, "fit_s": 1}]
    page = panel.report([*sums, {**SUMS_BASE, "task": skipped}], tmp_path / "r.jsonl")
    assert "| `" + SUMS + "` | 0.250 | 5.4 | 0.500, 0.300 | +5.0 |" in page
    assert "Every other setting" not in page and skipped not in page.split("Panel:")[0]  # no empty table, no row
    page = panel.report([*sums, {**sums[1], "setting": "t0.5", "greedy": 0.2},
                         {**sums[1], "task": skipped, "setting": "t0.5", "greedy": 0.1}], tmp_path / "r.jsonl")
    rest = page.split("Every other setting")[1]
    assert "| `" + SUMS + "` | 0.250 | 5.4 | 0.200 (1 seed) | -5.0 |" in rest
    assert "| `" + skipped + "` |  |  | 0.100 (1 seed) |  |" in rest  # a passed-over task's run still shows
    assert "t0.5" not in page.split("Every other setting")[0].split("```")[-1]  # not in the first table
