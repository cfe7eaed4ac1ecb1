"""`train --help` names the optimizer's keys, and each option sets its key."""

import pytest

from threefold.cli import main
from threefold.config import load_config
from threefold.train.command import OPTION_KEYS


def test_train_help_lists_the_optimizer_keys(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, key in [("--optimizer", "train.optimizer"), ("--beta1", "train.beta1"), ("--beta2", "train.beta2"),
                        ("--eps", "train.eps"), ("--weight-decay", "train.weight_decay"),
                        ("--grad-clip", "train.grad_clip"), ("--warmup-steps", "train.warmup_steps"),
                        ("--min-lr-ratio", "train.min_lr_ratio")]:
        assert option in text and f"sets {key}" in text, option
    cfg = load_config(None, [f"{OPTION_KEYS['beta2']}=0.99", f"{OPTION_KEYS['weight_decay']}=0.0"])
    assert cfg.train.beta2 == 0.99 and cfg.train.weight_decay == 0.0
