"""CPU model of the full/empty mbarrier ring of the warp-specialized kernels (grouped_gemm.cu, grouped_gemm_wgrad.cu).

The producer warp and the 8 consumer warps are replayed as coroutines under a random scheduler, with the PTX
mbarrier semantics (a phase completes when its expected arrivals have arrived and its transaction bytes have
landed; ``try_wait.parity(p)`` succeeds once the phase of parity p is complete, so parity 1 passes on a fresh
barrier) and TMA loads that land at random later times. The agents follow the kernels' code: the running
stage / phase counters, the producer's ``wait(empty, phase ^ 1)`` then ``expect_tx``, the consumers'
``wait(full, phase)``, their release of step s - 1 after the wait that follows the MMAs of step s, and the release
of a tile's last step after the drain (wgrad: only when the tile has k-steps). Checked, for random tile
sequences (tiles with 0 to 7 k-steps) and ring depths: no deadlock, every consumer reads exactly the data of its
own step, and no load lands in a stage whose previous contents a consumer still uses.
"""

from __future__ import annotations

import random

import pytest

CONSUMERS = 8  # consumer warps: the empty barrier's count


class Barrier:
    def __init__(self, count: int) -> None:
        self.count, self.arrived, self.tx, self.phase = count, 0, 0, 0

    def _maybe_complete(self) -> None:
        if self.arrived == self.count and self.tx == 0:
            self.phase += 1
            self.arrived = 0

    def arrive(self, tx: int = 0) -> None:
        self.arrived += 1
        self.tx += tx
        self._maybe_complete()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        assert self.tx >= 0
        self._maybe_complete()

    def passed(self, parity: int) -> bool:
        return (self.phase & 1) != parity


class Ring:
    def __init__(self, stages: int) -> None:
        self.stages = stages
        self.full = [Barrier(1) for _ in range(stages)]
        self.empty = [Barrier(CONSUMERS) for _ in range(stages)]
        self.content = [None] * stages  # the global step whose data the stage holds
        self.users = [set() for _ in range(stages)]  # consumer warps still reading the stage
        self.inflight: list[tuple[int, int]] = []  # (stage, step) loads issued, not landed


def producer(ring: Ring, tiles: list[int]):
    stage, phase, step = 0, 0, 0
    for ksteps in tiles:
        for _ in range(ksteps):
            while not ring.empty[stage].passed(phase ^ 1):
                yield
            assert not ring.users[stage], f"step {step} issued into stage {stage} still in use"
            ring.full[stage].arrive(tx=1)  # mbarrier.arrive.expect_tx
            ring.inflight.append((stage, step))
            step += 1
            stage, phase = (0, phase ^ 1) if stage + 1 == ring.stages else (stage + 1, phase)
            yield


def consumer(
    ring: Ring, tiles: list[int], me: int, log: list, early_release: bool = False, skip_drain_release: bool = False
):
    stage, phase, step = 0, 0, 0
    for ksteps in tiles:
        prev = 0
        for s in range(ksteps):
            while not ring.full[stage].passed(phase):
                yield
            assert ring.content[stage] == step, f"warp {me} step {step} read stage holding {ring.content[stage]}"
            ring.users[stage].add(me)  # A converted now, B read by the MMAs until they retire
            log.append((me, step))
            if early_release:  # the bug the model must catch: releasing a stage whose MMAs may still run
                ring.empty[stage].arrive()
            yield
            # wait_group 1: the MMAs of step s - 1 retired -> release their stage
            if s >= 1:
                ring.users[prev].discard(me)
                if not early_release:
                    ring.empty[prev].arrive()
            prev = stage
            step += 1
            stage, phase = (0, phase ^ 1) if stage + 1 == ring.stages else (stage + 1, phase)
            yield
        # drain (wait_group 0), then the last stage of the tile (a tile without k-steps releases nothing)
        if ksteps > 0:
            ring.users[prev].discard(me)
            if not early_release and not skip_drain_release:
                ring.empty[prev].arrive()
        yield  # epilogue


def tma_engine(ring: Ring, rng: random.Random):
    while True:
        if ring.inflight and rng.random() < 0.5:
            stage, step = ring.inflight.pop(rng.randrange(len(ring.inflight)))
            assert not ring.users[stage], f"load of step {step} overwrote stage {stage} still in use"
            ring.content[stage] = step
            ring.full[stage].complete_tx(1)
        yield


def run(tiles: list[int], stages: int, seed: int, **bugs) -> list:
    """Replay the producer and the 8 consumer warps; ``bugs``: consumer mutations the model must catch."""
    ring = Ring(stages)
    rng = random.Random(seed)
    log: list = []
    agents = [producer(ring, tiles)] + [consumer(ring, tiles, w, log, **bugs) for w in range(CONSUMERS)]
    engine = tma_engine(ring, rng)
    live = list(agents)
    for _ in range(200000):
        if not live:
            return log
        a = rng.choice(live + [engine])
        try:
            next(a)
        except StopIteration:
            live.remove(a)
    raise AssertionError(f"deadlock or livelock: {len(live)} agents left, in flight {ring.inflight}")


@pytest.mark.parametrize("stages", [3, 4, 5])
@pytest.mark.parametrize("seed", range(6))
def test_ring_protocol_random_tiles(stages, seed):
    rng = random.Random(seed)
    tiles = [rng.choice([0, 1, 1, 2, 3, 7]) for _ in range(rng.randint(1, 9))]
    log = run(tiles, stages, seed)
    total = sum(tiles)
    for w in range(CONSUMERS):  # every warp consumed every step, in order
        assert [st for me, st in log if me == w] == list(range(total))


def test_ring_protocol_detects_a_missing_release():
    """The model can fail: consumers that never release a tile's last stage (no arrive after the drain) deadlock."""
    with pytest.raises(AssertionError, match="deadlock"):
        run([2, 2, 2, 2, 2], 2, seed=0, skip_drain_release=True)


def test_ring_protocol_detects_an_early_release():
    """The model can fail: releasing a stage as soon as it is read (before its MMAs retire) lets the producer
    overwrite data the MMAs may still be reading."""
    with pytest.raises(AssertionError, match="still in use"):
        for seed in range(20):
            run([3, 7, 2, 7], 2, seed, early_release=True)


def test_wgrad_empty_group_tiles_keep_the_counters_in_step():
    """grouped_gemm_wgrad.cu: a tile of an empty group has no k-steps: neither side advances the ring, and the
    consumers do not release (``ksteps > 0`` guard); tiles after it still pair up step for step."""
    log = run([0, 3, 0, 0, 2, 0], 3, seed=1)
    assert sorted({st for _, st in log}) == list(range(5))
