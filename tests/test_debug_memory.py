"""`/debug/memory`'s parts (duplexkv/http/debug_memory.py): the resident memory by kind of mapping
adds up to the process's RSS and sorts glibc's thread arenas, executable (JIT) code, files and
stacks apart; a trim reports the RSS before and after it."""

import threading

import pytest

from duplexkv.http import debug_memory

MB = 1 << 20

SMAPS = f"""\
00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/python3
Rss:                 100 kB
55d000000000-55d000400000 rw-p 00000000 00:00 0 [heap]
Rss:                4096 kB
7f0000000000-7f0002000000 rw-p 00000000 00:00 0
Rss:               32768 kB
7f0002000000-7f0004000000 ---p 00000000 00:00 0
Rss:                   0 kB
{0x7f1000000000 + 4096:x}-{0x7f1000000000 + 4096 + 2 * MB:x} rw-p 00000000 00:00 0
Rss:                2048 kB
7f2000001000-7f2000002000 rwxp 00000000 00:00 0
Rss:                   4 kB
7f3000001000-7f3000101000 rw-p 00000000 00:00 0
Rss:                1024 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
Rss:                  12 kB
"""


def test_mappings_are_sorted_by_kind(tmp_path) -> None:
    path = tmp_path / "smaps"
    path.write_text(SMAPS)
    got = debug_memory.maps_summary(str(path))
    assert got == {"anon_1_64mb": {"rss_mb": 2.0, "maps": 1},
                   "anon_arena": {"rss_mb": 32.0, "maps": 1},
                   "anon_exec": {"rss_mb": 0.0, "maps": 1},
                   "anon_le_1mb": {"rss_mb": 1.0, "maps": 1},
                   "anon_reserved": {"rss_mb": 0.0, "maps": 1},
                   "file": {"rss_mb": 0.1, "maps": 1},
                   "heap": {"rss_mb": 4.0, "maps": 1},
                   "stack": {"rss_mb": 0.0, "maps": 1}}
    assert debug_memory.maps_summary(str(tmp_path / "missing")) is None


@pytest.mark.skipif(debug_memory.maps_summary() is None, reason="no /proc/self/smaps")
def test_the_kinds_add_up_to_the_rss() -> None:
    keep = []

    def allocate() -> None:  # a thread's allocations land in a glibc thread arena
        keep.extend(bytearray(512) for _ in range(20000))
    t = threading.Thread(target=allocate)
    t.start()
    t.join()
    total = sum(v["rss_mb"] for v in debug_memory.maps_summary().values())
    assert abs(total - debug_memory.rss_mb()) < max(8.0, 0.05 * total)


def test_a_trimmed_report_gives_the_rss_before_and_after() -> None:
    out = debug_memory.report(trim=True)
    if debug_memory.malloc_stats() is None:
        pytest.skip("not glibc")
    assert out["rss_before_trim_mb"] > 0 and out["rss_mb"] > 0 and "trimmed" in out
    assert out["maps"] and out["malloc"]["in_use_mb"] > 0
