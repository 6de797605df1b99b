"""CPU tests of the NVSHMEM transport's host-side configuration (moe_ep/comm/cuda_transport.py)."""

from __future__ import annotations

import os

import pytest

from moe_ep._env import env_override
from moe_ep.comm import cuda_transport as ct


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_send_warps_env_and_default(kind, monkeypatch):
    name = f"MOE_EP_{kind.upper()}_SEND_WARPS"
    monkeypatch.delenv(name, raising=False)
    assert ct._send_warps(kind) == ct._SEND_WARPS_DEFAULT[kind]
    for n in (1, 7, 16):
        monkeypatch.setenv(name, str(n))
        assert ct._send_warps(kind) == n


@pytest.mark.parametrize("raw", ["0", "17", "-1", "four", "2.5"])
def test_send_warps_rejects_bad_values(raw, monkeypatch):
    # 0 sender warps would leave the send tickets to no warp (every CTA needs one: the no-deadlock argument of
    # kernels/ep_sync.cuh); more than the CTA's 16 warps is meaningless
    monkeypatch.setenv("MOE_EP_DISPATCH_SEND_WARPS", raw)
    with pytest.raises(ValueError, match="MOE_EP_DISPATCH_SEND_WARPS"):
        ct._send_warps("dispatch")


@pytest.mark.parametrize(
    ("hidden", "want"), [(32, 1), (2048, 1), (3584, 1), (3616, 1), (4096, 1), (7168, 2), (14336, 4), (32768, 4)]
)
@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_pieces_default(kind, hidden, want, monkeypatch):
    # one piece per 7 steps of 512 elements (steps = ceil(hidden / 512)), at least 1, at most 4
    monkeypatch.delenv(f"MOE_EP_{kind.upper()}_PIECES", raising=False)
    assert ct._pieces(kind, hidden) == want


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_pieces_env(kind, monkeypatch):
    for n in range(1, ct.DISPATCH_MAX_PIECES + 1):
        monkeypatch.setenv(f"MOE_EP_{kind.upper()}_PIECES", str(n))
        assert ct._pieces(kind, 7168) == n


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
@pytest.mark.parametrize("raw", ["0", "5", "x"])
def test_pieces_rejects_bad_values(kind, raw, monkeypatch):
    # more pieces than the symmetric region has row flags for would write past disp_flag / comb_flag
    name = f"MOE_EP_{kind.upper()}_PIECES"
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        ct._pieces(kind, 7168)


def test_env_override_restores(monkeypatch):
    monkeypatch.setenv("MOE_EP_COMBINE_PIECES", "3")
    monkeypatch.delenv("MOE_EP_DISPATCH_PIECES", raising=False)
    with env_override({"MOE_EP_COMBINE_PIECES": "1", "MOE_EP_DISPATCH_PIECES": "4"}):
        assert ct._pieces("combine", 7168) == 1 and ct._pieces("dispatch", 7168) == 4
    assert ct._pieces("combine", 7168) == 3  # the old value is back
    assert "MOE_EP_DISPATCH_PIECES" not in os.environ  # an absent variable is absent again
    with pytest.raises(RuntimeError), env_override({"MOE_EP_DISPATCH_PIECES": "2"}):
        raise RuntimeError("restored on errors too")
    assert "MOE_EP_DISPATCH_PIECES" not in os.environ
