"""CPU tests of the NVSHMEM transport's host-side configuration (moe_ep/comm/cuda_transport.py)."""

from __future__ import annotations

import pytest

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
