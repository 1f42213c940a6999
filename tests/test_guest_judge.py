"""How the guest harness (tests/guest/phxguest.py) judges a console: the one
boot it retries is a kernel that died before its init ran (none of phx's code
had run); a death after that, or a timeout, is never retried and fails."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "guest"))
import phxguest  # noqa: E402

# the console of the 7.3 boot that died in a .ci/run (2026-12-06), shortened
EARLY = """Booting from ROM...
Probing EDD (edd=off to disable)... ok
[    1.677633] Oops: int3: 0000 [#1] SMP NOPTI
[    1.685257] RIP: 0010:sched_clock_cpu+0x9/0x1f0
[    1.687739] Call Trace:
[    1.693918] Kernel panic - not syncing: Fatal exception in interrupt
"""


def test_a_kernel_dead_before_init_is_retried_once():
    assert phxguest.died_before_init(EARLY) == "[    1.677633] Oops: int3: 0000 [#1] SMP NOPTI"
    ok, reasons = phxguest.judge(EARLY, ["insmod"])
    assert not ok and any(r.startswith("kernel trouble") for r in reasons)


def test_a_death_after_init_is_phxs_business():
    late = "PHX-GUEST-BOOTED 7.3.4\nPHX-PASS insmod\n" + EARLY
    assert phxguest.died_before_init(late) is None
    assert not phxguest.judge(late, ["insmod"])[0]


def test_a_silent_guest_is_not_retried():
    # no output at all (qemu failed to start, a hang before the kernel): no
    # trouble line, so nothing says the kernel died: not retried
    assert phxguest.died_before_init("Booting from ROM...\n") is None
