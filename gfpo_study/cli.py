"""`python -m gfpo_study`: the length study's command line.

    python -m gfpo_study run --config study.yaml [--seeds 0-2] [--arms grpo,shortest-8of16] [--key value ...]
    python -m gfpo_study merge PIECE_DIR ... --output-dir DIR
    python -m gfpo_study demo [--quick | --smoke] [--seeds 0-4] ...

`run` trains and evaluates every (arm, seed) of the config not finished yet in its output folder, then writes the
report when every run of the config is there; `--seeds` and `--arms` run a piece (another machine, a job array's
task), `merge` joins the pieces' folders. The config's keys: gfpo_study/config.py and docs/study.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from gfpo_trainer import cli as train_cli
from gfpo_trainer.cli import _did_you_mean, _one_line, parse_seeds

# gfpo_study.sums_task.TASKS, written out: --help imports no torch
SUMS_TASKS = ("sums", "easy-hard-sums", "small-large-sums")


def _selection(options):
    """`run`'s --seeds and --arms: a selection of the config's (a bare number is one seed: no count to mistake it
    for here, the config holds the seeds)."""
    text = options.seeds
    seeds = None if text is None else [int(text)] if text.strip().isdigit() else parse_seeds(text)
    arms = None
    if options.arms is not None:
        arms = [a.strip() for a in options.arms.split(",") if a.strip()]
    return seeds, arms


def _not_installed(name: str) -> int:
    """The one line for a package of the trainer extra that is not installed; the exit status 2."""
    print(f"error: {name.partition('.')[0]!r} is not installed: the study needs gfpo's trainer dependencies; from the "
          'checkout, pip install --no-build-isolation ".[trainer]" (docs/install.md)', file=sys.stderr)
    return 2


def _run(options, overrides) -> int:
    from .config import ConfigError, load_study_config

    try:
        config = load_study_config(options.config, overrides)
        try:  # torch, TRL: seconds to import, after the config's own checks
            from .study import run_study
        except ModuleNotFoundError as error:  # a dependency of theirs
            return _not_installed(error.name or str(error))
        if options.output_dir is not None:
            config = dataclasses.replace(config, output_dir=os.path.abspath(options.output_dir))
        seeds, arms = _selection(options)
        run_study(config, seeds=seeds, arms=arms, verbose=options.verbose)
    except (ConfigError, ValueError) as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 2
    return 0


def _merge(options) -> int:
    from .config import ConfigError
    from .study import merge_studies

    try:
        merge_studies(options.pieces, output_dir=options.output_dir)
    except ConfigError as error:
        print(f"error: merge: {_one_line(error)}", file=sys.stderr)
        return 2
    return 0


def _demo(options) -> int:
    from .config import ConfigError
    from .demo import run_demo
    from .study import ARMS, DEMO_ARMS, STUDY_ARMS, DemoSettings, run_study, study_config, sums_config

    if options.arms == "list":
        for name, arm in ARMS.items():
            print(f"{name}: {arm.definition()}")
        return 0
    arms = DEMO_ARMS if options.seeds is None else STUDY_ARMS
    if options.arms is not None:
        arms = tuple(a.strip() for a in options.arms.split(",") if a.strip())
        unknown = [a for a in arms if a not in ARMS]
        if unknown or not arms:
            hint = _did_you_mean(unknown[0], ARMS) if unknown else ""
            print(f"error: --arms={options.arms!r}: unknown arm {', '.join(map(repr, unknown)) or '(none given)'}"
                  f"{hint}; choices: {', '.join(ARMS)}", file=sys.stderr)
            return 2
    try:
        seeds = None if options.seeds is None else parse_seeds(options.seeds)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    settings = DemoSettings.smoke() if options.smoke else DemoSettings.quick() if options.quick else DemoSettings()
    if options.task is not None:
        from .sums_task import TASKS

        settings = dataclasses.replace(settings, task=TASKS[options.task])
    if options.rl_steps is not None:
        if options.rl_steps < 1:
            print(f"error: --rl-steps={options.rl_steps}: give at least 1 RL step", file=sys.stderr)
            return 2
        settings = dataclasses.replace(settings, rl_steps=options.rl_steps)
    try:
        if seeds is None:
            run_demo(settings, output_dir=options.output_dir or "gfpo_demo_output", use_kernels=not options.no_kernels,
                     verbose=options.verbose, arms=arms)
        else:
            config = sums_config(settings, seeds=seeds, arms=arms, use_kernels=not options.no_kernels,
                                 output_dir=os.path.abspath(options.output_dir or "gfpo_study_output"))
            run_study(study_config(config), verbose=options.verbose)
    except ConfigError as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gfpo_study",
        description="The length study: does GFPO shorten a model's answers at GRPO's accuracy? Arms x seeds from the "
        "same start, evaluated on held-out prompts, with intervals over seeds (docs/study.md).",
        epilog="Each command's --help says what it does and what it takes.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run", allow_abbrev=False, help="run a study config's arms x seeds (those not finished yet), then its report",
        description="Runs every (arm, seed) of a study config not finished in its output folder, one after another, "
        "each written when it finishes (a rerun skips them; one killed part-way is trained again, from its latest "
        "checkpoint where the config set checkpoint_every, now or before), then, with every "
        "run there and 2 seeds or more, writes study.json, study.md and study.png. Further --key value pairs set "
        "config fields: --model DIR, --steps 20, --eval.samples 4, --learning_rate 1e-6 (a bare GFPOConfig field "
        "goes under args). Under accelerate launch only the main process writes.")
    run.add_argument("--config", required=True, help="the study's YAML file (docs/study.md)")
    run.add_argument("--seeds", default=None, help="run only these of the config's seeds (a piece): 3, 0-2 or 0,3")
    run.add_argument("--arms", default=None, help="run only these of the config's arms (a piece), comma-separated")
    run.add_argument("--output-dir", default=None,
                     help="where the runs and the report go (default: the config's output_dir, else "
                     "gfpo_study_output in the working folder)")
    run.add_argument("--verbose", action="store_true", help="print TRL's metrics at every step, not a progress bar")
    merge = commands.add_parser(
        "merge", help="join the output folders of a study's pieces into one study and its report",
        description="Joins the output folders of pieces of one study config (run with --seeds / --arms, on other "
        "machines) into --output-dir: their run files (the models stay in the pieces), study.json, study.md and "
        "study.png. Pieces of different configs are refused, naming the field that differs.")
    merge.add_argument("pieces", nargs="+", metavar="PIECE_DIR", help="the pieces' output folders")
    merge.add_argument("--output-dir", required=True, help="where the merged study goes")
    demo = commands.add_parser("demo", help="GRPO vs GFPO on a task where RL lengthens answers, with a tiny model "
                               "(no downloads): the sums study on one seed, or on --seeds")
    sizes = demo.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="fewer warm-up and RL steps (docs/demo.md: times)")
    sizes.add_argument("--smoke", action="store_true",
                       help="every stage at toy sizes, in seconds; the figures mean nothing (for tests)")
    demo.add_argument("--seeds", default=None, metavar="SEEDS",
                      help="the study: every arm of --arms on these seeds, a range or a list (0-4, 0,2,5), with 95%% "
                      "intervals over seeds (configs/sums.yaml with `run` is the same study)")
    demo.add_argument("--task", default=None, choices=SUMS_TASKS,
                      help="the task (gfpo_study/sums_task.py, TASKS; default sums)")
    demo.add_argument("--rl-steps", type=int, default=None, metavar="N",
                      help="RL steps per arm (default: the preset's, 300, or 200 with --quick)")
    demo.add_argument("--arms", default=None,
                      help="comma-separated arms (default: grpo, shortest-8of16; with --seeds every arm but the "
                      "paper's objective); `--arms list` prints them")
    demo.add_argument("--output-dir", default=None,
                      help="where the plot, results and models go (default gfpo_demo_output, gfpo_study_output)")
    demo.add_argument("--no-kernels", action="store_true", help="run with use_gfpo_kernels=False")
    demo.add_argument("--verbose", action="store_true", help="print TRL's metrics at every step, not a progress bar")
    for command in commands._choices_actions:
        parser_of = commands.choices[command.dest]
        if parser_of.description is None:
            parser_of.description = command.help[:1].upper() + command.help[1:] + "."
    options, rest = parser.parse_known_args(argv)
    if rest and options.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # the commands need the trainer extra (TRL, transformers, datasets): a missing package is found by name (find_spec
    # imports nothing), so that `run` checks its config before the seconds of importing them
    missing = next((name for name in train_cli.TRAIN_MODULES if train_cli._not_installed(name)), None)
    if missing is not None:
        return _not_installed(missing)
    if options.command == "run":
        return _run(options, rest)
    try:
        from gfpo_trainer.trainer import GFPOTrainer  # noqa: F401
    except ModuleNotFoundError as error:  # a dependency of theirs
        return _not_installed(error.name or str(error))
    if options.command == "merge":
        return _merge(options)
    return _demo(options)
