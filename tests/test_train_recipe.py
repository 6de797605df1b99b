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
