"""pytest plugin: run TRL's own tests/test_grpo_trainer.py against GFPOTrainer.

Loaded with `-p tests.trl_suite.gfpo_trl_plugin` before TRL's test module is imported, it
1. replaces `trl.GRPOTrainer` / `trl.GRPOConfig` (the names TRL's test module imports) by GFPOTrainer and a
   GFPOConfig that turns the length filter on, in the mode named by GFPO_TRL_SUITE_MODE:
   - "trl": no replacement (TRL's own trainer on the same local stand-ins: the baseline that tells a TRL-version
     or stand-in failure from a GFPO one),
   - "gfpo": GFPOTrainer, group_filter="length", use_gfpo_kernels=False,
   - "gfpo-kernels": the same with use_gfpo_kernels=True;
2. resolves the Hub ids TRL's tests load (a tiny Qwen2 causal LM, a tiny Qwen2 reward model, the "zen" prompt
   data set) to stand-ins built here in code; any other Hub model or data set skips the test, naming it;
3. writes one JSON line per test (outcome, reason, seconds, and whether a failure is a GFPO refusal: a ValueError
   raised at one of REFUSAL_SITES) to GFPO_TRL_SUITE_REPORT, for scripts/trl_grpo_suite.py's table.
"""

from __future__ import annotations

import functools
import json
import os
import string
import tempfile
from pathlib import Path

import pytest
import torch

MODE = os.environ.get("GFPO_TRL_SUITE_MODE", "gfpo")
MODES = ("trl", "gfpo", "gfpo-kernels")
if MODE not in MODES:
    raise ValueError(f"GFPO_TRL_SUITE_MODE must be one of {MODES}, got GFPO_TRL_SUITE_MODE={MODE!r}")

HUB_CAUSAL_LM = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"
HUB_REWARD_MODEL = "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5"
HUB_PROMPTS = "trl-internal-testing/zen"
HUB_PREFIX = "trl-internal-testing/"
GFPO_PACKAGE_DIR = str(Path(__file__).resolve().parents[2] / "gfpo_trainer")

# A plain role-tagged chat template: TRL's tests only need the tokenizer to have one
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Short prompts of our own (the Hub's "zen" set is not reachable): what matters to the tests is the shape. 8 train
# prompts (zen has 17): TRL's tests train 3 epochs of one prompt a step, and a CPU run should stay short
PROMPT_TEXTS = [
    "The sky is", "Water boils at", "A cat likes to", "Two plus two is", "The sun rises in the",
    "Bread is made from", "A week has", "Snow is", "The moon orbits the", "Fish live in",
]
NUM_TEST_PROMPTS = 2


def _build_local_models(root: Path) -> dict[str, str]:
    """Saves the stand-ins of the two Hub models TRL's GRPO tests use most; returns Hub id -> local path."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    from gfpo_trainer.tiny import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer(string.ascii_letters + string.digits + string.punctuation + " \n")
    tokenizer.chat_template = CHAT_TEMPLATE
    causal = make_tiny_model(tokenizer)
    torch.manual_seed(1)
    one_label = {"id2label": {0: "LABEL_0"}, "label2id": {"LABEL_0": 0}}  # a reward model has one output
    reward_config = causal.config.__class__(**{**causal.config.to_dict(), **one_label})
    reward = Qwen2ForSequenceClassification(reward_config)
    paths = {}
    for hub_id, model in ((HUB_CAUSAL_LM, causal), (HUB_REWARD_MODEL, reward)):
        path = root / hub_id.split("/")[-1]
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[hub_id] = str(path)
    return paths


LOCAL_MODELS = _build_local_models(Path(tempfile.mkdtemp(prefix="gfpo-trl-suite-models-")))


def local_path(name):
    """The local stand-in of a Hub id TRL's tests load; skips the test for a Hub id with none."""
    if isinstance(name, str) and name.startswith(HUB_PREFIX):
        if name not in LOCAL_MODELS:
            pytest.skip(f"Hub model {name} has no local stand-in (no network)")
        return LOCAL_MODELS[name]
    return name


def _redirect_from_pretrained(cls) -> None:
    raw = cls.__dict__["from_pretrained"]
    if isinstance(raw, classmethod):
        func = raw.__func__

        @functools.wraps(func)
        def wrapper(klass, name, *args, **kwargs):
            return func(klass, local_path(name), *args, **kwargs)

        cls.from_pretrained = classmethod(wrapper)
    else:  # a staticmethod or a plain function
        func = raw.__func__ if isinstance(raw, staticmethod) else raw

        @functools.wraps(func)
        def wrapper(name, *args, **kwargs):
            return func(local_path(name), *args, **kwargs)

        cls.from_pretrained = staticmethod(wrapper)


def _install_model_stand_ins() -> None:
    import transformers
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.models.auto.auto_factory import _BaseAutoModelClass
    from transformers.processing_utils import ProcessorMixin
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    for cls in (
        transformers.PreTrainedModel, _BaseAutoModelClass, PreTrainedConfig, transformers.AutoConfig,
        transformers.AutoTokenizer, transformers.AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin,
    ):
        if "from_pretrained" in cls.__dict__:
            _redirect_from_pretrained(cls)


def _prompt_datasets(config_name: str):
    from datasets import Dataset, DatasetDict

    if config_name == "standard_prompt_only":
        prompts = list(PROMPT_TEXTS)
    elif config_name == "conversational_prompt_only":
        prompts = [[{"role": "user", "content": text}] for text in PROMPT_TEXTS]
    else:
        pytest.skip(f"Hub data set {HUB_PROMPTS!r} config {config_name!r} has no local stand-in (no network)")
    split = len(prompts) - NUM_TEST_PROMPTS
    return DatasetDict(
        train=Dataset.from_dict({"prompt": prompts[:split]}), test=Dataset.from_dict({"prompt": prompts[split:]})
    )


def _install_dataset_stand_ins() -> None:
    import datasets

    original = datasets.load_dataset

    @functools.wraps(original)
    def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
        if not (isinstance(path, str) and path.startswith(HUB_PREFIX)):
            return original(path, name, *args, split=split, streaming=streaming, **kwargs)
        if path != HUB_PROMPTS:
            pytest.skip(f"Hub data set {path!r} has no local stand-in (no network)")
        data = _prompt_datasets(name)
        if streaming:
            data = datasets.IterableDatasetDict({key: value.to_iterable_dataset() for key, value in data.items()})
        return data if split is None else data[split]

    datasets.load_dataset = load_dataset


def suite_filter(num_generations: int) -> dict:
    """The GFPO fields the suite sets for a test's num_generations G: the length filter keeping k = max(2, G // 2)
    completions where 2 <= k < G allows (G >= 3); G = 2 admits no filter (k = 1 would zero every advantage), so
    such a test runs GFPOTrainer unfiltered."""
    if num_generations is None or num_generations < 3:
        return {}
    return {"group_filter": "length", "num_remains_in_group": max(2, num_generations // 2)}


def _install_gfpo() -> None:
    import trl

    import gfpo_trainer.trainer
    from gfpo_trainer import GFPOTrainer

    trl.GRPOTrainer = GFPOTrainer
    trl.GRPOConfig = SuiteGFPOConfig
    gfpo_trainer.trainer.GFPOConfig = SuiteGFPOConfig  # the config GFPOTrainer builds when a test passes args=None


def _install_missing_availability_checks() -> None:
    """TRL's testing_utils of a release other than the installed one may import an `is_X_available` the installed
    trl.import_utils lacks: report X as unavailable, so the tests needing it skip instead of the module failing."""
    import importlib

    import_utils = importlib.import_module("trl.import_utils")

    for name in TESTING_UTILS_AVAILABILITY_CHECKS:
        if not hasattr(import_utils, name):
            setattr(import_utils, name, lambda: False)


# the trl.import_utils checks TRL's tests/testing_utils.py imports across the releases seen
TESTING_UTILS_AVAILABILITY_CHECKS = (
    "is_harbor_available", "is_jmespath_available", "is_joblib_available", "is_liger_kernel_available",
    "is_math_verify_available", "is_mergekit_available", "is_openreward_available", "is_vllm_available",
)

# the stand-in models are tiny: one thread each runs them fastest, and keeps parallel runs on a small CI machine
# from oversubscribing its cores (measured: 8.5 s -> 1 s a training step with another job on the 2 cores)
torch.set_num_threads(1)
_install_missing_availability_checks()
_install_model_stand_ins()
_install_dataset_stand_ins()
if MODE != "trl":
    from gfpo_trainer import GFPOConfig

    class SuiteGFPOConfig(GFPOConfig):
        """GFPOConfig with the suite's defaults: the length filter on (where G allows), kernels per mode. Defined at
        module level: the trainer pickles its config into checkpoints."""

        def __post_init__(self):
            if self.num_remains_in_group is None and self.group_filter is None:
                for name, value in suite_filter(self.num_generations).items():
                    setattr(self, name, value)
            self.use_gfpo_kernels = MODE == "gfpo-kernels"
            super().__post_init__()

    _install_gfpo()


# Where GFPO refuses an option with a ValueError naming it (docs/trl-compatibility.md, "Refusals"):
# the config's checks, the trainer's construction checks, the fused loss's option and model checks
REFUSAL_SITES = {
    ("config.py", "__post_init__"),
    ("trainer.py", "__init__"),
    ("fused_head.py", "check_fused_loss_supported"),
    ("fused_head.py", "_check_plain_linear_head"),  # an adapter on the LM head
    ("fused_head.py", "fused_compute_loss"),  # a multimodal batch
    ("fused_head.py", "_probe"),
}


def _is_gfpo_refusal(excinfo) -> bool:
    """A ValueError raised at one of GFPO's refusal sites: GFPO declining an option, not a crash."""
    if not excinfo.errisinstance(ValueError):
        return False
    raised_at = excinfo.traceback[-1]
    path = Path(str(raised_at.path))
    return str(path.parent) == GFPO_PACKAGE_DIR and (path.name, raised_at.name) in REFUSAL_SITES


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    # liger-kernel imports here but its Triton kernels need a GPU; a failed liger run also leaves its patches on
    # the model classes, failing the tests after it in the same process
    no_gpu = pytest.mark.skip(reason="use_liger_kernel=True: liger-kernel's Triton kernels need a GPU")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("use_liger_kernel") is True or "liger" in item.name and (
            item.name.startswith("test_train") or "liger_grpo_kernel" in item.name
        ):
            item.add_marker(no_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get("GFPO_TRL_SUITE_REPORT")
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return
    record = {"nodeid": item.nodeid.split("::", 1)[-1], "outcome": report.outcome, "reason": "", "refusal": False,
              "seconds": round(report.duration, 2)}
    if report.skipped:
        record["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed and call.excinfo is not None:
        message = str(call.excinfo.value).strip().splitlines()
        record["reason"] = f"{call.excinfo.typename}: {message[0] if message else ''}"[:300]
        record["refusal"] = _is_gfpo_refusal(call.excinfo)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
