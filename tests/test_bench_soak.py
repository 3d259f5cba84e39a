"""The soak's memory slopes (duplexkv_bench/soak.py): a bounded sawtooth (a busy worker's heap,
returned every few trim intervals) must read as flat, and growth as growth, whatever phase the
run ends in."""

from duplexkv_bench.soak import envelope, retained, slope_mb_per_min, summarize

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


def test_retained_slope_reads_the_rss_after_each_snapshots_trim():
    """A worker whose RSS saw-tooths but whose RSS after a trim stays flat retains nothing: the
    retained slope reads the trimmed snapshots only (not the untrimmed one at the end, nor a
    process that did not answer), after the warm-up."""
    class P:
        def __init__(self, name):
            self.name = name
    samples = [{"t": float(t), "w": 500.0 + (t % 120)} for t in range(0, 1200, 10)]
    debug = [{"t": float(t), "w": {"rss_mb": 400.0 + (t % 7) * 0.01, "trimmed": True}}
             for t in range(0, 1200, 60)]
    debug += [{"t": 1190.0, "w": None}, {"t": "end", "w": {"rss_mb": 900.0}}]
    pts = retained(debug, "w")
    assert len(pts) == 20 and all(v < 401 for _, v in pts)
    row = summarize([P("w")], samples, 1200, warmup_s=300, debug=debug)[0]
    assert row["retained_points"] == 15
    assert abs(row["slope_retained_mb_per_min"]) < 0.1
    growing = [{"t": s["t"], "w": {"rss_mb": 400.0 + s["t"] / 60, "trimmed": True}}
               for s in debug[:20]]
    assert summarize([P("w")], samples, 1200, 300, growing)[0][
        "slope_retained_mb_per_min"] == 1.0
    assert summarize([P("w")], samples, 1200, 300)[0]["slope_retained_mb_per_min"] is None
