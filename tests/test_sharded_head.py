"""The ZeRO-3 gather of the LM head around the fused call, with a stand-in DeepSpeed (DeepSpeed is not installed
here): the fused loss must see the gathered weight, inside the gather context, and give the unsharded loss."""

import contextlib
import enum
import sys
import types

import pytest
import torch

from gfpo_trainer import _compat
from gfpo_trainer.fused_head import install_fused_loss_forward
from gfpo_trainer.tiny import make_tiny_model, make_tokenizer


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2


class FakeZero3:
    """Partitions parameters to empty placeholders as ZeRO-3 does; GatheredParameters restores them for a while."""

    def __init__(self):
        self.full, self.entered, self.gathered = {}, 0, []

    def partition(self, param):
        self.full[id(param)] = param.data
        param.data = torch.empty(0, dtype=param.dtype)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE

    @contextlib.contextmanager
    def GatheredParameters(self, params):
        self.gathered.append(list(params))
        for p in params:
            p.data, p.ds_status = self.full[id(p)], ZeroParamStatus.AVAILABLE
        self.entered += 1
        try:
            yield
        finally:
            self.entered -= 1
            for p in params:
                p.data, p.ds_status = torch.empty(0, dtype=p.dtype), ZeroParamStatus.NOT_AVAILABLE


@pytest.fixture
def zero3(monkeypatch):
    fake = FakeZero3()
    deepspeed = types.ModuleType("deepspeed")
    deepspeed.zero = types.SimpleNamespace(GatheredParameters=fake.GatheredParameters)
    partition_parameters = types.ModuleType("deepspeed.runtime.zero.partition_parameters")
    partition_parameters.ZeroParamStatus = ZeroParamStatus
    for name, module in {"deepspeed": deepspeed, "deepspeed.runtime": types.ModuleType("deepspeed.runtime"),
                         "deepspeed.runtime.zero": types.ModuleType("deepspeed.runtime.zero"),
                         "deepspeed.runtime.zero.partition_parameters": partition_parameters}.items():
        monkeypatch.setitem(sys.modules, name, module)
    import transformers.integrations.deepspeed as hf_deepspeed

    monkeypatch.setattr(hf_deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    return fake


def _fused_call(model, seen, zero3):
    def loss_fn(hidden, weight, bias, logit_softcap):
        seen.append({"weight": weight.detach().clone(), "inside": zero3.entered if zero3 else None})
        return (hidden.float() @ weight.float().T).logsumexp(-1).mean(), {}

    input_ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    loss, _, _ = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), gfpo_loss_fn=loss_fn,
                    gfpo_logits_to_keep=3)
    return loss


@pytest.mark.parametrize("own_fallback", [False, True])
def test_zero3_head_gathered_for_the_fused_call(zero3, monkeypatch, own_fallback):
    if own_fallback:  # a TRL without maybe_gather_lm_head_ctx: the own gather
        monkeypatch.setattr(_compat, "lm_head_gather_context", lambda *p: _compat._gather_zero3_params(p))
        from gfpo_trainer import sharded_head

        monkeypatch.setattr(sharded_head, "lm_head_gather_context", _compat.lm_head_gather_context)
    model = make_tiny_model(make_tokenizer(), seed=0)
    head = model.get_output_embeddings().weight
    head.ds_status = ZeroParamStatus.AVAILABLE  # the full weight first (and for the probe): nothing to gather
    install_fused_loss_forward(model)
    expected_seen = []
    with torch.no_grad():
        expected = _fused_call(model, expected_seen, None)
        full = head.data.clone()
        zero3.partition(head)
        seen = []
        loss = _fused_call(model, seen, zero3)
    assert zero3.gathered[:1] == [[head]] and len(zero3.gathered) == 1  # only the partitioned call gathered
    assert seen[0]["inside"] == 1  # the fused call ran inside the gather
    torch.testing.assert_close(seen[0]["weight"], full, rtol=0, atol=0)
    torch.testing.assert_close(loss, expected)
    assert zero3.entered == 0 and head.numel() == 0  # released afterwards


def test_no_gather_when_already_available(zero3):
    param = torch.nn.Parameter(torch.ones(2))
    param.ds_status = ZeroParamStatus.AVAILABLE  # e.g. tied to embed_tokens, gathered by its own module
    with _compat._gather_zero3_params((param, None)):
        pass
    assert zero3.gathered == []


def test_plain_parameters_under_a_zero3_config_are_not_gathered(zero3):
    # a model built outside zero.Init while a ZeRO-3 config is live (is_deepspeed_zero3_enabled() is True) holds
    # plain parameters until deepspeed.initialize: the probe's fused call must read them as they are (TRL's gather
    # context read their missing ds_status and raised AttributeError)
    model = make_tiny_model(make_tokenizer(), seed=0)
    install_fused_loss_forward(model)
    seen = []
    with torch.no_grad():
        _fused_call(model, seen, zero3)
    torch.testing.assert_close(seen[0]["weight"], model.get_output_embeddings().weight, rtol=0, atol=0)
    assert zero3.gathered == [] and seen[0]["inside"] == 0
