"""The manual (``docs/``) and the README say only what the code does; ``mkdocs build --strict`` checks the rest.

(a) **Every documented recipe key exists.** A *documented key* is

- an inline code span (outside fenced code blocks) whose text is a dotted path that starts with ``model.``,
  ``data.`` or ``trainer.``, alone or followed by a value as written in YAML or on a command line: `model.kl.coef`,
  `model.kl.coef: 0.05`, `data.batch_size=8`, `model.kl.coef > 0`;
- every ``--model.…``, ``--data.…`` or ``--trainer.…`` flag in an inline code span or a fenced code block
  (``--model.help``/``--data.help`` excepted).

A span that starts with anything else is not a documented key (quote error lines as they print,
``rl_lightning: error: …``), and neither is a wildcard (``model.rollout.*``). ``init_args`` levels may be written
or left out. Python attributes are written with their class, so they do not read as keys: ``Trainer.global_step``.

A key is resolved by the real LightningCLI parser (`rl_lightning.cli.main.RLLightningCLI`, ``run=False``, classes not
instantiated) on a recipe, with ``trainer.strategy`` set to `rl_lightning.parallel.ParallelStrategy` (the project's
strategy, so its ``trainer.strategy.*`` keys exist): the parsed config, flattened without ``init_args``, holds every
key of the recipe's task, DataModule and trainer, defaults included. A key resolves when it is a node of that tree;
a key below an optional group that is null in the recipe (`model.lm.lora`, `model.correction`,
`model.rollout.reward_model`) is looked up after parsing the recipe again with that group set to ``{}``. The
recipes a page's keys belong to are named in its front matter (``recipes: [recipes/dpo.yaml]``); without one, a key
must resolve in at least one task's recipe (SFT, RM, DPO, PPO).

(b) The README is at most 12,288 bytes, and every relative link in ``README.md`` and ``docs/`` points at a file
that exists.

(c) Every bundled recipe (``rl_lightning/recipes/**/*.yaml``) is named in ``docs/`` (``recipes/<name>.yaml``).
"""

from __future__ import annotations

import re
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rl_lightning"  # recipes are named by their path in it: recipes/dpo.yaml (`--config dpo`)
DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
README = REPO / "README.md"
README_LIMIT = 12 * 1024
TASK_RECIPES = ("recipes/sft.yaml", "recipes/rm.yaml", "recipes/dpo.yaml", "recipes/ppo.yaml")
STRATEGY = ["--trainer.strategy", "{class_path: rl_lightning.parallel.ParallelStrategy}"]

KEY = r"(?:model|data|trainer)(?:\.[A-Za-z_]\w*)+"
SPAN_KEY = re.compile(rf"({KEY})(?:(?::\s|=|\s).*)?", re.DOTALL)  # the whole span: a key, maybe with a value
FLAG = re.compile(rf"(?<![\w-])--({KEY})(?![\w.])")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


# ---------------------------------------------------------------- reading the pages


def front_matter(text: str) -> tuple[dict, str]:
    """A page's YAML front matter (``---`` block at the top) and the rest of the page."""
    match = re.match(r"---\n(.*?)\n---\n", text, re.DOTALL)
    if match is None:
        return {}, text
    return yaml.safe_load(match.group(1)) or {}, text[match.end():]


def split_fences(text: str) -> tuple[str, str]:
    """(prose, code): the text outside fenced code blocks (fences blanked), and the fenced blocks' contents."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            prose.append("")
        elif fenced:
            code.append(line)
        else:
            prose.append(line)
    return "\n".join(prose), "\n".join(code)


def documented_keys(text: str) -> set[str]:
    """The documented keys of a page's text (see the module docstring), ``init_args`` levels dropped."""
    prose, code = split_fences(text)
    keys = {m.group(1) for m in FLAG.finditer(code)}
    for span in INLINE_CODE.finditer(prose):
        content = " ".join(span.group(2).split())
        match = SPAN_KEY.fullmatch(content)
        if match:
            keys.add(match.group(1))
        keys.update(m.group(1) for m in FLAG.finditer(content))
    keys = {re.sub(r"\.init_args(?=\.|$)", "", key) for key in keys}
    return {key for key in keys if not key.endswith(".help")}


def strip_code(text: str) -> str:
    prose, _ = split_fences(text)
    return INLINE_CODE.sub("", prose)


# ---------------------------------------------------------------- resolving keys with the real CLI parser


def flatten(node: object, prefix: str, out: dict[str, object]) -> dict[str, object]:
    """Every node of a parsed config, ``{"model.kl.coef": 0.0, "model.kl": <group>, ...}``, without ``init_args``."""
    if isinstance(node, dict):
        if prefix:
            out[prefix] = dict
        for key, value in node.items():
            flatten(value, prefix if key == "init_args" else f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = node
    return out


@cache
def parsed_keys(recipe: str, *extra: str) -> dict[str, object] | None:
    """The keys of `recipe`'s config as the real CLI parses it (with `extra` arguments), or None if it refuses."""
    from lightning.pytorch import LightningDataModule, LightningModule

    from rl_lightning.cli.main import RLLightningCLI

    class ParseOnly(RLLightningCLI):
        def instantiate_classes(self) -> None:  # the config is what we check; nothing is built
            pass

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["rl_lightning"])
        try:
            cli = ParseOnly(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                            save_config_callback=None, run=False,
                            parser_kwargs={"parser_mode": "omegaconf+", "exit_on_error": False},
                            args=["--config", str(PACKAGE / recipe), *STRATEGY, *extra])
        except (Exception, SystemExit):  # noqa: BLE001 - jsonargparse refusing the arguments is the answer
            return None
    return flatten(cli.config.as_dict(), "", {})


def resolves(key: str, recipe: str) -> bool:
    """Whether `key` is an option of `recipe`'s task, DataModule or trainer (see the module docstring)."""
    keys = parsed_keys(recipe)
    assert keys is not None, f"{recipe} does not parse"
    if key in keys:
        return True
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        group = ".".join(parts[:end])
        if group in keys:  # the deepest node the recipe has: below a null group, parse with its defaults
            if keys[group] is not None:
                return False
            with_defaults = parsed_keys(recipe, f"--{group}", "{}")
            return with_defaults is not None and key in with_defaults
    return False


def page_recipes(meta: dict) -> list[str]:
    return list(meta.get("recipes") or TASK_RECIPES)


# ---------------------------------------------------------------- (a) documented keys exist


def test_the_resolver_rejects_made_up_keys():
    assert resolves("model.kl.coef", "recipes/ppo.yaml")
    assert resolves("model.rollout.engine", "recipes/ppo.yaml")
    assert resolves("model.lm.lora.target_modules", "recipes/ppo.yaml")  # below a null group
    assert resolves("trainer.strategy.context_parallel_size", "recipes/sft.yaml")
    assert resolves("trainer.logger.experiment_name", "recipes/sft.yaml")  # init_args left out
    assert resolves("data.max_length_per_device", "recipes/dpo.yaml")
    assert not resolves("model.kl.coeff", "recipes/ppo.yaml")
    assert not resolves("model.lm.lora.rank", "recipes/ppo.yaml")
    assert not resolves("model.ref_model_name.path", "recipes/dpo.yaml")  # a null value, not a group
    assert not resolves("data.max_lenght", "recipes/sft.yaml")
    assert not resolves("trainer.strategy.data_parallel_sizes", "recipes/sft.yaml")
    assert not resolves("model.beta", "recipes/ppo.yaml") and resolves("model.beta", "recipes/dpo.yaml")  # per task


def test_key_extraction_follows_the_convention():
    text = ("`model.kl.coef` and `model.kl.coef: 0.05`, `data.batch_size=8`, `--model.rollout.engine hf "
            "--trainer.max_steps 5`, `model.rollout.*`, `rl_lightning: error: model.lm.optim.lrr: not an option`, "
            "`--model.help PPO`, `model.lm.lora.init_args.r`, `trainer.strategy.init_args`, `Trainer.global_step`\n"
            "```bash\nfit --data.path x.jsonl --data.help X\n```\n")
    assert documented_keys(text) == {"model.kl.coef", "data.batch_size", "model.rollout.engine",
                                     "trainer.max_steps", "model.lm.lora.r", "trainer.strategy", "data.path"}


def test_documented_keys_exist():
    unresolved, checked = [], 0
    for page in [*PAGES, README]:
        meta, text = front_matter(page.read_text())
        recipes = page_recipes(meta)
        for recipe in recipes:
            assert (PACKAGE / recipe).is_file(), f"{page.relative_to(REPO)}: front matter names a missing {recipe}"
        for key in sorted(documented_keys(text)):
            checked += 1
            if not any(resolves(key, recipe) for recipe in recipes):
                unresolved.append(f"{page.relative_to(REPO)}: `{key}` is not an option of {', '.join(recipes)}")
    assert not unresolved, "\n".join(unresolved)
    assert checked > 250, checked  # the pages document about 320 keys: far fewer means a broken extraction


# ---------------------------------------------------------------- (b) README size, links


def test_readme_is_the_front_door():
    size = README.stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes; keep it <= {README_LIMIT} and move detail to docs/"
    text = README.read_text()
    assert "make test" in text and "make demo" in text  # CI runs the test command the README names


def relative_links(text: str) -> list[str]:
    prose = strip_code(text)
    targets = [m.group(1) for m in LINK.finditer(prose)] + REFERENCE.findall(prose)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_relative_links_point_at_files():
    broken, count = [], 0
    for page in [README, *PAGES]:
        for target in relative_links(page.read_text()):
            count += 1
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)
    assert count > 50, count


def test_link_finder_sees_links_but_not_code():
    text = "[a](docs/x.md#y) ![i](img.png) [w](https://e.org) [t](#top) `[c](not.md)`\n[r]: ref.md\n"
    assert relative_links(text) == ["docs/x.md#y", "img.png", "ref.md"]


# ---------------------------------------------------------------- (c) recipes are documented


def test_every_recipe_is_documented():
    recipes = sorted(p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "recipes").rglob("*.yaml"))
    assert len(recipes) >= 9, recipes  # recursive: recipes/real/ too
    docs = "\n".join(page.read_text() for page in PAGES)
    missing = [recipe for recipe in recipes if recipe not in docs]
    assert not missing, f"recipes no docs page names: {missing}"


def test_every_module_has_an_api_page():
    """Every module of the package (its callbacks too) is rendered by a ``:::`` line on a page of docs/api/; the
    example environments in ``rl_lightning/recipes/envs/`` are files a recipe loads by path, not modules."""
    rendered = {line[4:].strip() for page in (DOCS / "api").glob("*.md") for line in page.read_text().splitlines()
                if line.startswith("::: ")}
    modules = set()
    for path in (REPO / "rl_lightning").rglob("*.py"):
        if not path.is_relative_to(REPO / "rl_lightning" / "recipes"):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    missing = sorted(modules - rendered - {"rl_lightning", "rl_lightning.__main__"})
    assert missing == [], f"add a ::: line to a page of docs/api/ for {missing}"


def _readme_block(language: str, marker: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_the_readme_environment_works_as_written(tmp_path):
    """The README's reward environment, loaded as a run loads it: components scored, the tool answers, then stops."""
    from rl_lightning.envs.environment import load_environment

    path = tmp_path / "my_env.py"
    path.write_text(_readme_block("python", "def reward_fn"))
    env = load_environment(str(path), weights={"correct": 1.0, "short": 0.2})
    reward, components = env.score([{"role": "assistant", "content": "The answer is 12."}], "12", where="row 0")
    assert components == {"correct": 1.0, "short": 1.0} and reward == pytest.approx(1.2)
    _, components = env.score([{"role": "assistant", "content": "The answer is 13, " + "x" * 40}], "12", where="row 1")
    assert components == {"correct": 0.0, "short": 0.0}
    assert env.interact([{"role": "assistant", "content": "<calc> 6 * -7 </calc>"}]) == [
        {"role": "tool", "content": "-42"}]
    assert env.interact([{"role": "assistant", "content": "42"}]) == []


def test_the_readme_callback_prints_the_longest_completion(capsys):
    """The README's callback, run on a rollout-shaped batch: it prints the longest completion every `every` rollouts."""
    from types import SimpleNamespace

    namespace: dict = {}
    exec(_readme_block("python", "class LongestCompletion"), namespace)
    callback = namespace["LongestCompletion"](every=5)
    short = SimpleNamespace(completion_length=2, reward=0.0, messages=[{"content": "no"}])
    long = SimpleNamespace(completion_length=9, reward=1.0, messages=[{"content": "yes, 42"}])
    batch = {"rollout": SimpleNamespace(trajectories=[short, long])}
    trainer = SimpleNamespace(is_global_zero=True)
    callback.on_train_batch_end(trainer, SimpleNamespace(rollouts=10), None, batch, 0)
    callback.on_train_batch_end(trainer, SimpleNamespace(rollouts=11), None, batch, 0)
    assert capsys.readouterr().out == "rollout 10: 1.00 'yes, 42'\n"
