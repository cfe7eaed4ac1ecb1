"""`model.vocab_multiple` in one process: the padded decoder equals the unpadded one with the same
real weights (loss, logits, real-row gradients within 1e-6 in fp32; padded rows start at zero and
get no gradient); the published presets pad to 128 and count their real rows against the papers;
a tp that does not divide the padded vocabulary is refused naming the key."""

import pytest
import torch

from tests.helpers import rel_err
from threefold.config import load_config
from threefold.errors import ConfigError
from threefold.models.decoder import build_model, count_parameters


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_padded_decoder_equals_the_unpadded_one(preset):
    plain_cfg = load_config(None, [f"model.preset={preset}", "model.vocab=200"]).model
    cfg = load_config(None, [f"model.preset={preset}", "model.vocab=200", "model.vocab_multiple=128"]).model
    assert cfg.padded_vocab == 256 and cfg.vocab == 200
    plain, padded = build_model(plain_cfg, 0), build_model(cfg, 0)
    tokens, targets = torch.randint(0, 200, (2, 3, 20), generator=torch.Generator().manual_seed(0))
    ref, loss = plain(tokens, targets), padded(tokens, targets)
    ref.backward()
    loss.backward()
    assert rel_err(loss.detach(), ref.detach()) < 1e-6
    with torch.no_grad():
        logits = padded(tokens)
        assert logits.shape == (3, 20, 200) and rel_err(logits, plain(tokens)) < 1e-6  # users see the real columns
    for (name, p), q in zip(plain.named_parameters(), padded.parameters()):
        rows = p.shape[0]
        assert torch.equal(q.detach()[:rows], p.detach()), name  # same seed: the same real weights
        if p.grad is None:  # the frozen key bias
            continue
        assert rel_err(q.grad[:rows], p.grad) < 1e-6, name
        if q.shape != p.shape:
            assert q.shape[0] == 256 and not q.detach()[rows:].any() and not q.grad[rows:].any(), name


def test_presets_pad_to_128_and_count_the_real_vocabulary():
    gpt2 = load_config(None, ["model.preset=gpt2-124m"]).model
    assert (gpt2.vocab, gpt2.vocab_multiple, gpt2.padded_vocab) == (50257, 128, 50304)
    assert count_parameters(gpt2) - count_parameters(gpt2, padded=False) == 47 * 768  # tied: one table
    assert load_config(None, ["model.preset=tiny"]).model.vocab_multiple == 1


def test_a_tp_that_does_not_divide_the_padded_vocabulary_is_refused():
    cfg = load_config(None, ["model.preset=tiny", "model.vocab=200", "model.vocab_multiple=3", "parallel.tp=2"])
    with pytest.raises(ConfigError) as info:
        cfg.validate(2)
    assert info.value.field == "model.vocab_multiple" and "201" in str(info.value) and "\n" not in str(info.value)
    # without the key, tp pads the vocabulary itself (as before)
    load_config(None, ["model.preset=tiny", "model.vocab=201", "parallel.tp=2"]).validate(2)
