"""The README and docs/*.md stay true to the code: every relative link and #anchor resolves, every repository path
named in backticks exists, every Python example runs, every YAML training config runs through the CLI, every shell
command names scripts, modules, subcommands, flags and files that exist, and the API contract (docs/design.md)
names functions, parameters and config fields the package has.

Markers, an HTML comment on the line before a code block (invisible on GitHub):
- `<!-- docs-test: max_steps=N -->`: the Python block runs with every `max_steps=<number>` replaced by N (a training
  example that takes minutes as written runs N steps here);
- `<!-- docs-test: no-run REASON -->`: the Python block is compiled, not run (needs a GPU, several processes, ...);
- `<!-- docs-test: vllm -->`: the Python block runs where vLLM is installed (scripts/test_vllm_cpu.sh runs it in
  .venv-vllm), and is compiled only elsewhere;
- `<!-- docs-test: recipe -->`: a YAML training config of docs/gpu-recipe.md, which names Hub models and GPU settings:
  tests/test_gpu_recipe.py builds and runs it shrunk, not the generic config test here;
- `<!-- docs-test: study -->`: a YAML study config (python -m gfpo_study run): parsed and checked here.
Shell blocks never run here (they install, train for minutes or need GPUs): their commands are checked statically.
The Hub model of a YAML config is replaced by a tiny local model (no downloads) and training gets a one-step limit.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import importlib.util
import inspect
import json
import re
import shutil
import shlex
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CONTRIBUTING.md"]
HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
FENCE = re.compile(r"^(?P<marker><!-- docs-test: (?P<directive>[^>]*?) -->\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)^```",
                   re.S | re.M)


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@dataclasses.dataclass
class Block:
    page: Path
    lang: str
    code: str
    directive: str | None
    line: int

    def __str__(self):
        return f"{page_id(self.page)}:{self.line} ({self.lang or 'no language'})"


def code_blocks(page: Path, *langs: str) -> list[Block]:
    text = page.read_text()
    blocks = [Block(page, m["lang"], textwrap.dedent(m["code"]), m["directive"], text[: m.start("code")].count("\n"))
              for m in FENCE.finditer(text)]
    return [b for b in blocks if not langs or b.lang in langs]


def prose(page: Path) -> str:
    """The page without its fenced code blocks (links, headings and inline code live here)."""
    return FENCE.sub("", page.read_text())


def all_blocks(*langs: str) -> list[Block]:
    return [b for page in PAGES for b in code_blocks(page, *langs)]


# --- links and anchors -----------------------------------------------------------------------------------------

def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (backticks included), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(page), flags=re.M):
        slug = github_anchor(heading)
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def relative_links(page: Path) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", prose(page))
    return [t for t in targets if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto: are not checked here


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.name} (has {sorted(anchors(file))})")
    assert not broken, f"{page_id(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "history.md"], ids=page_id)
def test_elr_is_spelt_out_at_its_first_use(page):
    """A reader meets "ELR" with its meaning beside it, on whichever page they start."""
    text = " ".join(page.read_text().split())
    first = re.search(r"\bELR\b", text)
    if first is not None:
        near = text[max(0, first.start() - 200):first.end() + 200].lower()
        assert "excess length reduction" in near, f"{page_id(page)}: ELR first used without its meaning: {near}"


def test_every_docs_page_is_linked():
    """A page nobody links to is a page nobody reads: each docs/*.md is linked from the README or another page."""
    linked = {(page.parent / t.partition("#")[0]).resolve() for page in PAGES for t in relative_links(page)
              if t.partition("#")[0]}
    orphans = [page_id(p) for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages linked from nowhere: {orphans}"


TOP_LEVEL = {p.name for p in ROOT.iterdir()} - {".venv", ".git"}


def expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [x for alt in match[1].split(",") for x in expand_braces(path[: match.start()] + alt + path[match.end():])]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_repository_paths_named_in_backticks_exist(page):
    """`bench/results/....md`, `gfpo_trainer/rows.py`, `tests/test_trainer*.py`: the files a claim rests on exist;
    so does every page named in passing outside code ("see DESIGN.md")."""
    missing = []
    for span in re.findall(r"`([^`\s]+)`", prose(page)):
        path = span.rstrip(".,;:")
        if "/" not in path or path.split("/")[0] not in TOP_LEVEL or "<" in path:
            continue
        for candidate in expand_braces(path):
            if not glob.glob(str(ROOT / candidate)):
                missing.append(candidate)
    outside_code = re.sub(r"`[^`]*`", "", prose(page))  # `STEM-model.md` is a file name pattern, not a page
    for name in set(re.findall(r"\b[\w-]+\.md\b", outside_code)):  # a page named in passing ("see DESIGN.md")
        if not any(p.name == name for p in [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("*/*/*.md")]):
            missing.append(name)
    assert not missing, f"{page_id(page)} names files that do not exist: {missing}"


# --- Python examples -------------------------------------------------------------------------------------------

def runnable(block: Block) -> str:
    code = block.code
    if block.directive and block.directive.startswith("max_steps="):
        steps = int(block.directive.split("=", 1)[1])
        assert re.search(r"max_steps=\d+", code), f"{block}: marker max_steps= but no max_steps in the code"
        code = re.sub(r"max_steps=\d+", f"max_steps={steps}", code)
    elif block.directive:
        assert block.directive.startswith("no-run ") or block.directive == "vllm", \
            f"{block}: unknown marker {block.directive!r}"
    return code


PYTHON_BLOCKS = all_blocks("python")


README_TRAINING = next(b for b in code_blocks(PAGES[0], "python") if "GFPOTrainer(" in b.code)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=str)
def test_python_example_runs(block, tmp_path, monkeypatch):
    code = compile(runnable(block), str(block), "exec")
    if block.directive and block.directive.startswith("no-run "):
        return  # compiled above: a syntax error still fails
    if "gfpo_trainer" in block.code:
        pytest.importorskip("trl")
    if block.directive == "vllm":
        pytest.importorskip("vllm")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs_example__"}
    exec(code, namespace)
    if block == README_TRAINING:  # the README says the reward rises from about 0.2 to above 0.9 in its 60 steps
        rewards = [log["reward"] for log in namespace["trainer"].state.log_history if "reward" in log]
        assert len(rewards) == 6 and rewards[0] < 0.4 and rewards[-1] > 0.85, rewards


def test_readme_training_example_is_offline_with_a_one_line_switch():
    """The README's first training run builds its model in code (it runs as written in CI, offline, in seconds); the
    real model is the one commented line to uncomment."""
    assert README_TRAINING.directive is None, "it runs as written"
    assert re.search(r"^# model, tokenizer, learning_rate = \"[\w./-]+\", None, [\d.e-]+ ", README_TRAINING.code,
                     re.M), "the one line to uncomment for a real model"
    assert "make_tiny_model(" in README_TRAINING.code and "from_pretrained" not in README_TRAINING.code


def test_readme_training_example_prints_no_warning(tmp_path):
    """docs/first-run.md: run as a script, the README's example prints a progress bar and the metrics, and no
    warning (neither transformers' deprecations of TRL's defaults nor torch's pin_memory notice)."""
    pytest.importorskip("trl")
    import subprocess
    import sys

    from gfpo_test_utils import subprocess_env

    (tmp_path / "first_run.py").write_text(re.sub(r"max_steps=\d+", "max_steps=2", README_TRAINING.code))
    done = subprocess.run([sys.executable, "first_run.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=subprocess_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    assert "2/2 [" in done.stderr and "warn" not in done.stderr.lower(), done.stderr


# --- YAML training configs through the CLI ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from gfpo_test_utils import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("docs-model"))


def readme_reward_function() -> str:
    return re.search(r"^def digit_share\(.*?\n\n", README_TRAINING.code, flags=re.S | re.M).group(0)


TRAINING_CONFIGS = [b for b in all_blocks("yaml")
                    if "model" in (yaml.safe_load(b.code) or {}) and b.directive not in ("recipe", "study")]
STUDY_CONFIGS = [b for b in all_blocks("yaml") if b.directive == "study"]
RECIPE_CONFIGS = [b for b in all_blocks("yaml") if b.directive == "recipe"]


GSM8K_CORRECTNESS = """
def correctness(completions, answer, **kwargs):
    return [float(a.split("####")[-1].strip() in c[-1]["content"]) for c, a in zip(completions, answer)]
"""


@pytest.mark.parametrize("block", TRAINING_CONFIGS, ids=str)
def test_yaml_training_config_runs_with_the_cli(block, tmp_path, monkeypatch, tiny_model_dir):
    pytest.importorskip("trl")
    from gfpo_trainer.cli import main

    config = yaml.safe_load(block.code)
    assert config["model"] == HUB_MODEL, "the example names the Hub model that the test replaces"
    config["model"] = tiny_model_dir
    config["args"].update(max_steps=1, max_completion_length=4, report_to="none")
    monkeypatch.chdir(tmp_path)
    # "my_rewards.py holding the function above"; and GSM8K's correctness, for a config that builds chat prompts
    (tmp_path / "my_rewards.py").write_text(readme_reward_function() + GSM8K_CORRECTNESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = Path(config["dataset"])
    data.parent.mkdir(parents=True, exist_ok=True)
    if "prompt" in config:  # a GSM8K-like data set (question, answer) and a model with a chat template
        data.write_text("".join(json.dumps({"question": "what is 6*7?", "answer": "6*7=42\n#### 42"}) + "\n"
                                for _ in range(16)))
        config["model"] = str(tmp_path / "tiny-chat")
        shutil.copytree(tiny_model_dir, config["model"])
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config["model"])
        tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} ; {% endfor %}"
                                   "{% if add_generation_prompt %}assistant: {% endif %}")
        tokenizer.save_pretrained(config["model"])
    else:
        data.write_text("".join('{"prompt": "6*7="}\n' for _ in range(16)))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "--config", "run.yaml"]) == 0
    assert (tmp_path / config["args"]["output_dir"] / "config.json").exists()


@pytest.mark.parametrize("block", STUDY_CONFIGS, ids=str)
def test_yaml_study_config_parses(block, tmp_path):
    """A study config of the docs (`<!-- docs-test: study -->`) is one `python -m gfpo_study run` takes: every key,
    arm and seed checked (tests/test_study_command.py runs such configs)."""
    pytest.importorskip("trl")
    from gfpo_study.config import parse_study_config

    config = yaml.safe_load(block.code)
    for spec in config["reward_funcs"] + [config["eval"]["correct"]]:
        module, _, name = spec.partition(":")
        with open(tmp_path / f"{module}.py", "a") as f:
            f.write(f"def {name}(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    for data in (config["dataset"], config["eval"]["dataset"]):  # the data files it names, one row each
        (tmp_path / data).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / data).write_text('{"prompt": "1+1=", "answer": 2}\n')
    parsed = parse_study_config(config, str(tmp_path))
    assert parsed.seeds and parsed.arms and parsed.steps >= 1


# --- shell commands --------------------------------------------------------------------------------------------

def shell_commands(block: Block) -> list[list[str]]:
    commands = []
    for line in re.sub(r"\\\n", " ", block.code).splitlines():
        for part in line.split(" && "):
            words = shlex.split(part, comments=True)
            if words:
                commands.append(words)
    return commands


def package_sources(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"no module {module}"
    origin = Path(spec.origin)
    files = origin.parent.glob("*.py") if origin.name in ("__init__.py", "__main__.py") else [origin]
    return "\n".join(f.read_text() for f in files)


def check_arguments(arguments: list[str], source: str, where: str) -> None:
    """Every --flag is a string in the program's source; the first plain word is a subcommand of it there. `python -m
    gfpo_trainer train --config F --field value ...`: the overrides after the config are applied by the CLI's own
    apply_overrides, and each names a top-level key or a GFPOConfig field."""
    if arguments[:2] == ["train", "--config"] and len(arguments) > 3:
        check_train_overrides(arguments[3:], where)
        arguments = arguments[:3]
    for word in arguments:
        if word.startswith("--"):
            assert f'"{word.split("=")[0]}"' in source, f"{where}: {word} is no option of it"
    positional = [w for w in arguments if not w.startswith("-")]
    if positional and not re.search(r"\.\w+$", positional[0]):  # a file argument (run.yaml) is left alone
        assert f'"{positional[0]}"' in source, f"{where}: {positional[0]!r} is no subcommand of it"


def check_train_overrides(overrides: list[str], where: str) -> None:
    pytest.importorskip("trl")
    import dataclasses

    from gfpo_trainer import GFPOConfig
    from gfpo_trainer.cli import _TOP_LEVEL_KEYS, apply_overrides

    config = apply_overrides({}, overrides, _TOP_LEVEL_KEYS)
    fields = {field.name for field in dataclasses.fields(GFPOConfig)}
    assert set(config.get("args", {})) <= fields, f"{where}: no GFPOConfig field {set(config['args']) - fields}"


def check_pip(arguments: list[str], where: str) -> None:
    """pip's own parser checks the command and its options (--no-build-isolation, -e, ...)."""
    from pip._internal.commands import commands_dict, create_command

    assert arguments and arguments[0] in commands_dict, f"{where}: no pip command {arguments[:1]}"
    parser = create_command(arguments[0]).parser
    try:
        parser.parse_args(arguments[1:])
    except SystemExit:
        pytest.fail(f"{where}: pip rejects the options of: pip {' '.join(arguments)}")
    # optparse also takes unambiguous abbreviations (--no-build-isol): the text must spell options out
    options = {name for option in parser._get_all_options() for name in option._long_opts + option._short_opts}
    for word in arguments[1:]:
        assert not word.startswith("-") or word.split("=")[0] in options, f"{where}: {word} is no pip option"


# commands a page may use as they are: they name no script, module or option of the project's (".": sourcing the
# venv's activate script, which scripts/setup.sh makes)
STANDARD_TOOLS = ("rm", "mkdir", "tar", "git", ".")


def check_trl_command(arguments: list[str], where: str) -> None:
    """`trl vllm-serve ...`: TRL's own parser of that command reads every flag (TRL passes flags it does not know
    on to `vllm serve`, which needs vLLM to check: a page uses TRL's flags only; tests/test_gpu_recipe.py checks the
    `vllm serve` command TRL makes against vLLM's parser where vLLM is installed)."""
    pytest.importorskip("trl")
    from trl.scripts.vllm_serve import make_parser

    assert arguments[:1] == ["vllm-serve"], f"{where}: trl {' '.join(arguments[:1])} is not a command this test knows"
    _, rest = make_parser().parse_args_and_config(args=arguments[1:], return_remaining_strings=True)
    assert not rest, f"{where}: trl vllm-serve does not know {rest} (it would pass them on to vllm serve)"


def check_accelerate_launch(arguments: list[str], where: str) -> None:
    """`accelerate launch [options] -m module ...`: accelerate's own parser reads the options, and the config file
    exists with a distributed type GFPO runs under."""
    assert arguments[0] == "launch" and "--config_file" in arguments and "-m" in arguments, where
    config = yaml.safe_load((ROOT / arguments[arguments.index("--config_file") + 1]).read_text())
    assert config["distributed_type"] in ("MULTI_GPU", "DEEPSPEED", "FSDP"), where
    try:
        from accelerate.commands.launch import launch_command_parser
    except ImportError:  # checked where accelerate is installed (with the trainer extra)
        return
    module_at = arguments.index("-m")
    try:
        launch_command_parser().parse_args(arguments[1:module_at + 2])
    except SystemExit:
        pytest.fail(f"{where}: accelerate launch rejects {' '.join(arguments[1:module_at])}")


def check_command(words: list[str], where: str) -> None:
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value: a variable the project reads
        name = words.pop(0).split("=")[0]
        readers = [*ROOT.glob("scripts/*"), *ROOT.glob("bench/*.sh"), *ROOT.glob("gfpo_*/*.py"), ROOT / "setup.py"]
        assert any(name in p.read_text() for p in readers if p.is_file()), f"{where}: nothing in the project reads {name}"
    program, *arguments = words
    if program in ("pip", ".venv/bin/pip") or (program in (".venv/bin/python", "python") and arguments[:2] == ["-m", "pip"]):
        check_pip(arguments if program.endswith("pip") else arguments[2:], where)
    elif program == "bash":
        assert (ROOT / arguments[0]).is_file(), f"{where}: no script {arguments[0]}"
    elif program in (".venv/bin/python", "python"):
        if arguments[0] == "-m":
            module, rest = arguments[1], arguments[2:]
            if module == "pytest":
                test_script = (ROOT / "scripts" / "test.sh").read_text()
                assert " ".join(words) in test_script, f"{where}: not the test command of scripts/test.sh (CI's)"
                return
            check_arguments(rest, package_sources(module), f"{where}: python -m {module}")
        else:
            script = ROOT / arguments[0]
            assert script.is_file(), f"{where}: no script {arguments[0]}"
            check_arguments(arguments[1:], script.read_text(), f"{where}: {arguments[0]}")
    elif program in STANDARD_TOOLS:
        return  # names nothing of the project's
    elif program == "accelerate":
        check_accelerate_launch(arguments, where)
        check_command(["python", *arguments[arguments.index("-m"):]], where)
    elif program == "trl":
        check_trl_command(arguments, where)
    else:
        pytest.fail(f"{where}: a command this test does not know how to check: {' '.join(words)}")


@pytest.mark.parametrize("block", all_blocks("bash"), ids=str)
def test_shell_commands_name_what_exists(block):
    for words in shell_commands(block):
        check_command(words, str(block))


@pytest.mark.parametrize("block", all_blocks("json"), ids=str)
def test_device_commands_name_what_exists(block):
    """A JSON block is a call of the GPU machine's run tool (docs/performance.md): it parses, and its command names
    scripts and variables that exist, as a shell block's would."""
    import json

    call = json.loads(block.code)
    assert set(call) <= {"command", "carry", "timeout_s", "kind"} and "command" in call, f"{block}: {sorted(call)}"
    assert 0 < call.get("timeout_s", 600) <= 600, f"{block}: a device command runs at most 600 s"
    for part in call["command"].replace("<", "").replace(">", "").split(" && "):
        check_command(shlex.split(part), str(block))


def test_readme_commands_are_what_ci_runs():
    """The README's first commands are the one-command demo and tests; CI (.ci/run) runs the test one on its fresh
    clone (which sets .venv up), so a newcomer's first commands are tested."""
    ci = (ROOT / ".ci" / "run").read_text()
    first_block = code_blocks(PAGES[0], "bash")[0]
    assert [" ".join(c) for c in shell_commands(first_block)] == ["bash scripts/demo.sh --quick", "bash scripts/test.sh"]
    assert re.search(r"^(step )?bash scripts/test\.sh$", ci, re.M)  # (step: prints the step's wall time)
    for script in ("demo.sh", "test.sh"):
        assert "bash scripts/setup.sh --if-stale" in (ROOT / "scripts" / script).read_text()


def test_readme_is_a_short_page_that_says_what_to_choose_before_the_commands():
    """The README is the product page (at most 130 lines; CONTRIBUTING.md), and before its first commands it says
    which torch to install and how many threads to run on a shared CPU, so a newcomer chooses before setup runs."""
    text = PAGES[0].read_text()
    assert len(text.splitlines()) <= 130, f"README.md has {len(text.splitlines())} lines"
    before_commands = text[: text.index("```bash")]
    for variable in ("GFPO_TORCH_INDEX_URL=", "OMP_NUM_THREADS=1"):  # the second is torch's (OpenMP's)
        assert variable in before_commands, f"README.md names {variable} only after its first commands"
    check_command(["GFPO_TORCH_INDEX_URL=x", "bash", "scripts/setup.sh"], "README.md")  # the project reads it


def test_every_code_block_is_checked():
    """A code block in a language this test does not check would drift unseen ("text": recorded output)."""
    unchecked = [str(b) for b in all_blocks() if b.lang not in ("python", "bash", "yaml", "json", "text")]
    assert not unchecked, f"code blocks in no checked language: {unchecked}"
    for block in all_blocks("yaml"):
        assert block in TRAINING_CONFIGS or (block in RECIPE_CONFIGS and block.page.name == "gpu-recipe.md") or (
            block in STUDY_CONFIGS), f"{block}: a YAML block that is not a training config"


# --- the API contract (docs/design.md) --------------------------------------------------------------------------

DESIGN = ROOT / "docs" / "design.md"


def signatures(text: str, prefix: str) -> list[tuple[str, str]]:
    """(name, parameter list) of every `prefix...name(...)` in the text, parentheses balanced."""
    found = []
    for match in re.finditer(prefix, text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        found.append((match[1] if match.groups() else "", text[match.end() : end]))
    return found


def check_signature(func, listed: str, where: str) -> None:
    """The contract's parameter list (`a, b, *, c=1`): the same names, kinds (positional / keyword-only) and, where
    it gives one, the same default as the code's signature."""
    args = ast.parse(f"def f({listed.replace(chr(10), ' ')}): pass").body[0].args
    code = [p for p in inspect.signature(func).parameters.values() if p.name != "self"]
    P = inspect.Parameter

    def names(*kinds):
        return [p.name for p in code if p.kind in kinds]

    assert [a.arg for a in args.args] == names(P.POSITIONAL_OR_KEYWORD, P.POSITIONAL_ONLY), (
        f"{where}: positional parameters differ from the code's {inspect.signature(func)}")
    assert [a.arg for a in args.kwonlyargs] == names(P.KEYWORD_ONLY), (
        f"{where}: keyword-only parameters differ from the code's {inspect.signature(func)}")
    assert (args.kwarg is not None) == any(p.kind == P.VAR_KEYWORD for p in code), f"{where}: **kwargs"
    listed_defaults = dict(zip([a.arg for a in args.args][::-1], args.defaults[::-1]))
    listed_defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    for param in code:
        if param.name in listed_defaults:
            value = ast.literal_eval(listed_defaults[param.name])
            assert param.default == value, f"{where}: {param.name} defaults to {param.default!r}, not {value!r}"


def test_design_contract_names_exist_with_their_parameters():
    import gfpo_kernels

    text = prose(DESIGN)
    listed = signatures(text, r"`((?:gfpo_kernels|gfpo_trainer)\.\w+)\(")
    assert len(listed) >= 6
    for name, params in listed:
        if name == "gfpo_trainer.GFPOConfig":
            continue  # `GFPOConfig(GRPOConfig)` names its base class; its fields: the test below
        if name.startswith("gfpo_trainer"):
            pytest.importorskip("trl")
        module, _, attr = name.rpartition(".")
        check_signature(getattr(importlib.import_module(module), attr), params, f"docs/design.md: {name}")
    ((_, forward),) = signatures(text, r"forward\(")
    check_signature(gfpo_kernels.FusedLinearGRPOLoss.forward, forward, "docs/design.md: FusedLinearGRPOLoss.forward")
    for name in ("group_topk_mask", "group_advantages", "gfpo_filter_advantages", "fused_linear_grpo_loss"):
        assert callable(getattr(gfpo_kernels.reference, name)), f"gfpo_kernels.reference.{name}"


def gfpo_config_fields() -> set[str]:
    from trl import GRPOConfig

    from gfpo_trainer import GFPOConfig

    return {f.name for f in dataclasses.fields(GFPOConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}


def test_design_contract_and_trainer_docs_name_every_gfpo_config_field():
    """docs/design.md names GFPOConfig fields that exist; docs/trainer.md's options table lists exactly the fields
    GFPOConfig adds to TRL's GRPOConfig (a new field gets a line there)."""
    pytest.importorskip("trl")
    from gfpo_trainer import GROUP_FILTERS

    fields = gfpo_config_fields()
    config_paragraph = re.search(r"`gfpo_trainer\.GFPOConfig\(GRPOConfig\)`(.*?)\n`gfpo_trainer\.GFPOTrainer",
                                 prose(DESIGN), re.S).group(1)
    named = set(re.findall(r"`([a-z_]+)`", config_paragraph)) - set(GROUP_FILTERS)
    assert named and named <= fields, f"docs/design.md names fields GFPOConfig lacks: {named - fields}"
    table = set(re.findall(r"^\| `(\w+)` \|", prose(ROOT / "docs" / "trainer.md"), re.M))
    assert table == fields, f"docs/trainer.md options table: missing {fields - table}, not fields {table - fields}"


def test_documented_metrics_are_logged_by_the_trainer():
    """Every `gfpo/...` metric the docs name is a metric the trainer's code logs."""
    source = "\n".join(p.read_text() for p in (ROOT / "gfpo_trainer").glob("*.py"))
    named = {m for page in PAGES for m in re.findall(r"`(gfpo/[\w{}.]+)`", prose(page))}
    assert named
    for metric in named:
        stem = metric.split("{")[0]
        assert re.search(re.escape(stem) + (r"" if "{" in metric else r"[\"']"), source), f"{metric} is not logged"
