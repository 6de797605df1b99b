"""launch/train.py's recipe choice, held-out loss and reproducibility (issue 40), on CPU: the argument rules, and
two one-process runs of one seed with the blockwise recipe on the reference backend, bitwise equal."""

from __future__ import annotations

import pytest

from tests.test_train import TRAIN, _script, run_train


@pytest.fixture(scope="module")
def train():
    return _script(TRAIN)


def test_recipe_arguments(train, capsys):
    """--recipe picks MoEConfig.recipe; --no-quantize is recipe bf16; blockwise needs multiples of 128; the MXFP8
    expert gather is the mxfp8 recipe's only; the default gather of an FP8 recipe is fp8 (in the layer's recipe)."""
    a = train.parse_args(["--preset", "tiny"])
    assert (a.recipe, a.no_quantize, a.expert_gather) == ("mxfp8", False, "fp8")
    a = train.parse_args(["--preset", "tiny", "--no-quantize"])
    assert (a.recipe, a.no_quantize, a.expert_gather) == ("bf16", True, "plain")
    a = train.parse_args(["--preset", "tiny", "--recipe", "blockwise", "--dim", "128", "--ffn-hidden", "256"])
    assert (a.recipe, a.no_quantize, a.expert_gather) == ("blockwise", False, "fp8")
    for bad, msg in (
        (["--recipe", "blockwise"], "multiples of 128"),
        (["--recipe", "mxfp8", "--no-quantize"], "--no-quantize is recipe bf16"),
        (["--recipe", "blockwise", "--dim", "128", "--ffn-hidden", "128", "--expert-gather", "mxfp8"], "mxfp8"),
    ):
        with pytest.raises(SystemExit) as e:
            train.parse_args(["--preset", "tiny", *bad])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


def test_blockwise_run_is_reproducible_with_held_out_loss(tmp_path):
    """Two runs of one seed give bitwise the same training and held-out losses; the held-out loss is logged every
    --eval-every steps and after the last one, finite, and below the untrained model's (~ln 256 = 5.5)."""
    args = ("--recipe", "blockwise", "--dim", "128", "--ffn-hidden", "128", "--steps", "6", "--eval-every", "3",
            "--eval-batches", "2", "--batch-size", "2", "--seq-len", "64", "--deterministic")  # fmt: skip
    a = run_train(tmp_path, 1, *args, name="a")
    b = run_train(tmp_path, 1, *args, name="b")
    assert a["variant"] == "reference_blockwise" and a["recipe"] == "blockwise"
    assert [e["step"] for e in a["eval"]] == [3, 6]
    assert a["loss"] == b["loss"] and a["eval"] == b["eval"]
    assert a["summary"]["finite"] and a["summary"]["eval_loss"] == a["eval"][-1]["loss"] < 5.3


def test_loss_parity_rule_by_hand():
    """launch/loss_parity.py's summary: per-variant mean / population std of the held-out losses; parity = within 1%
    of bf16's mean and within the bf16 seeds' largest deviation from their mean (here 0.02)."""
    parity = _script(TRAIN.parent / "loss_parity.py")

    def log(v: float) -> dict:
        return {"summary": {"eval_loss": v}, "eval": [{"step": 10, "loss": v}], "loss": [v]}

    logs = {("bf16", 0): log(2.00), ("bf16", 1): log(2.04), ("mxfp8", 0): log(2.03), ("mxfp8", 1): log(2.05),
            ("blockwise", 0): log(2.10), ("blockwise", 1): log(2.10)}  # fmt: skip
    res = parity.summarize(logs)
    bf, mx, bw = res["variants"]["bf16"], res["variants"]["mxfp8"], res["variants"]["blockwise"]
    assert bf["mean"] == pytest.approx(2.02) and bf["std"] == pytest.approx(0.02)
    assert mx["mean"] == pytest.approx(2.04) and mx["eval_curves"] == [[[10, 2.03]], [[10, 2.05]]]
    assert res["parity"]["mxfp8"]["within_1pct"] and res["parity"]["mxfp8"]["within_bf16_spread"]  # 0.99%, 0.02
    assert (
        bw["std"] == 0.0
        and not res["parity"]["blockwise"]["within_1pct"]
        and not res["parity"]["blockwise"]["within_bf16_spread"]
    )
