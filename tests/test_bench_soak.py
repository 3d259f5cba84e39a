"""The soak's memory slopes (duplexkv_bench/soak.py): a bounded sawtooth (a busy worker's heap,
returned every few trim intervals) must read as flat, and growth as growth, whatever phase the
run ends in."""

from duplexkv_bench.soak import envelope, slope_mb_per_min

PERIOD = 120


def sawtooth(growth_mb_per_min: float, phase_s: float, end_s: int = 600):
    return [(t, 600 + growth_mb_per_min * t / 60 + 90 * (((t + phase_s) % PERIOD) / PERIOD))
            for t in range(0, end_s, 10)]


def test_a_flat_sawtooth_has_a_flat_floor_whatever_the_phase() -> None:
    swings = []
    for phase in range(0, PERIOD, 20):
        pts = sawtooth(0.0, phase)
        swings.append(abs(slope_mb_per_min(pts)))
        assert abs(slope_mb_per_min(envelope(pts, PERIOD, min))) < 0.5
        assert abs(slope_mb_per_min(envelope(pts, PERIOD, max))) < 0.5
    assert max(swings) > 1.0  # the plain slope is what misled: it depends on the phase


def test_growth_under_the_sawtooth_shows_in_the_floor() -> None:
    for phase in (0, 40, 80):
        floor = slope_mb_per_min(envelope(sawtooth(2.0, phase), PERIOD, min))
        assert 1.5 < floor < 2.5, floor


def test_a_partial_last_window_is_left_out() -> None:
    pts = [(0, 1.0), (60, 2.0), (110, 3.0), (120, 100.0)]  # the window from 120 s: one sample
    assert envelope(pts, PERIOD) == [(0, 1.0)]
