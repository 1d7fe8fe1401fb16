"""When the trainer's own process group binds loopback only (`rl_lightning.parallel.local_group`).

That a 2-process fit's group listens on 127.0.0.0/8 only is checked during the dp=2 SFT fits of test_strategy.py
(`test_sft_parallel_losses_equal_single_process`), which run anyway.
"""

import socket

from rl_lightning.parallel.local_group import single_host


def test_only_a_single_host_run_binds_loopback():
    """Loopback channels when one node's ranks meet at a loopback address or this host's name; several nodes keep
    the launcher's rendezvous and interfaces."""
    for address in ("127.0.0.1", "127.0.1.1", "::1", "localhost", socket.gethostname()):
        assert single_host(1, address), address
    assert not single_host(2, "127.0.0.1")
    assert not single_host(1, "10.1.2.3") and not single_host(1, "node-that-is-not-this-one")


def test_the_engine_process_child_imports_no_lightning():
    """The engine process's child imports `local_group` for its loopback settings; through the package's ``__init__``
    that loaded Lightning (seconds), and the child missed its 8 s start-up limit (test_engine_restart's hung engine)."""
    import subprocess
    import sys

    code = ("import sys, rl_lightning.parallel.local_group, rl_lightning.engines.local_channels; "
            "print(sorted(m for m in ('lightning', 'pytorch_lightning') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
