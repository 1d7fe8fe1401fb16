"""Hostile programs against the code sandbox's OS isolation (issue 12): each test runs the attack with the in-interpreter
audit hook switched off (``audit_hook=False``) as well as on, to show that the namespaces hold on their own.

They need bubblewrap; CI installs it (``make setup``). Where it is missing they skip with that reason, and
`test_code_rewards_refuse_without_isolation` checks the refusal instead.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from rl_lightning.errors import ConfigError
from rl_lightning.rewards import isolation
from rl_lightning.rewards.code import code_reward
from rl_lightning.rewards.sandbox import run_sandboxed

needs_bwrap = pytest.mark.skipif(isolation.isolation_level() != "bwrap",
                                 reason=f"no bubblewrap isolation on this machine; {isolation.INSTALL_HINT}")
HOOK = pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "no-hook"])


def _run(code, audit_hook, **kwargs):
    # 15 s: the programs finish in well under a second, but a loaded 2-core machine (load 14 in one full-suite run)
    # took over 3 s to start Python inside the sandbox; the limit itself is tested below with a program that spins
    return run_sandboxed(textwrap.dedent(code), audit_hook=audit_hook, **{"timeout_s": 15.0, **kwargs})


@needs_bwrap
def test_honest_solution_scores_one():
    program = "```python\nimport sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n```"
    cases = [{"input": "1 2 3", "output": "6"}, {"input": "40 2", "output": "42\n"}]
    assert code_reward([{"role": "assistant", "content": program}], cases) == 1.0


@needs_bwrap
@HOOK
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_cut_at_the_cap(stream, audit_hook):
    start = time.monotonic()
    result = _run(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)\n", audit_hook,
                  max_output_bytes=100_000)
    assert result.reason == "output limit: more than 100000 bytes" and not result.ok
    assert len(getattr(result, stream)) == 100_000
    assert time.monotonic() - start < 2.0  # killed as soon as the cap is passed, not at the 3 s limit


@needs_bwrap
def test_output_flood_does_not_grow_the_trainer():
    """Peak RSS of a fresh trainer-like process: one harmless call, then a 1 GB flood capped at 1 MiB."""
    script = textwrap.dedent("""
        import resource
        from rl_lightning.rewards.sandbox import run_sandboxed
        run_sandboxed("print(1)")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = run_sandboxed("import sys\\nfor _ in range(16384):\\n    sys.stdout.write('x' * 65536)",
                               timeout_s=20, max_output_bytes=1 << 20)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(result.reason, len(result.stdout), after - before)
    """)
    reason, kept, grown_kib = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                             check=True).stdout.rsplit(" ", 2)
    assert reason.startswith("output limit") and int(kept) == 1 << 20
    assert int(grown_kib) < 8 * 1024  # cap (1 MiB) + a chunk + decoding copies; before the fix: the whole GB


@needs_bwrap
@HOOK
def test_no_secret_or_outside_file_is_readable(tmp_path, monkeypatch, audit_hook):
    answers = tmp_path / "answers.txt"
    answers.write_text("the answers: 42")
    monkeypatch.setenv("RL_TEST_SECRET", "s3cret-token")
    code = f"""
        import glob, os
        seen = [str(dict(os.environ))]
        for path in [{str(answers)!r}, "/proc/{os.getpid()}/environ", "/proc/{os.getppid()}/environ", "/etc/shadow",
                     *glob.glob("/proc/*/environ")]:
            try:
                seen.append(open(path, "rb").read().decode(errors="replace"))
            except OSError as e:
                seen.append(type(e).__name__)
        print(seen)
        print(sorted(p for p in os.listdir("/proc") if p.isdigit()))
    """
    result = _run(code, audit_hook)
    assert result.ok, result
    assert "s3cret-token" not in result.stdout and "the answers" not in result.stdout
    assert "FileNotFoundError" in result.stdout
    assert result.stdout.splitlines()[-1] == "['1', '2']"  # bwrap's init and the program: no trainer processes


@needs_bwrap
@HOOK
def test_nothing_is_written_outside(tmp_path, audit_hook):
    target = tmp_path / "escaped"
    code = f"""
        import os
        open("inside.txt", "w").write("x")
        attempts = [lambda: os.rename("inside.txt", {str(target)!r}), lambda: os.replace("inside.txt", {str(target)!r}),
                    lambda: os.link("inside.txt", {str(target)!r}), lambda: os.symlink("/etc", {str(target)!r}),
                    lambda: open({str(target)!r}, "w"), lambda: open("/usr/escaped", "w"),
                    lambda: os.open("escaped", os.O_WRONLY | os.O_CREAT, dir_fd=os.open("/usr", os.O_RDONLY))]
        for attempt in attempts:
            try:
                attempt()
                print("written")
            except OSError as e:
                print(type(e).__name__)
    """
    result = _run(code, audit_hook)
    assert result.ok, result
    assert "written" not in result.stdout and len(result.stdout.split()) == 7
    assert not target.exists() and not os.path.exists("/usr/escaped")
    if audit_hook:  # the hook refuses every path argument, rename/link destinations included; os.open's audit event
        # carries no dir_fd, so that one only the read-only mount stops (one reason the hook is not the boundary)
        assert result.stdout.split() == ["PermissionError"] * 6 + ["OSError"]


@needs_bwrap
@HOOK
def test_no_process_can_be_created(audit_hook):
    code = """
        import _posixsubprocess, os
        for attempt in (os.fork, lambda: os.posix_spawn("/usr/bin/sleep", ["sleep", "30"], {}),
                        lambda: _posixsubprocess.fork_exec(["sleep"], [b"/usr/bin/sleep"], True, (), None, None,
                                                           -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1,
                                                           None, None, None, -1, None, False)):
            try:
                print("child", attempt())
            except (OSError, TypeError) as e:
                print(type(e).__name__, e.errno if isinstance(e, OSError) else "")
    """
    result = _run(code, audit_hook)
    assert "child" not in result.stdout, result
    assert result.stdout.count("PermissionError") >= 2, result


@needs_bwrap
def test_no_nested_namespaces():
    """exec is allowed (it replaces the one process), but what it runs cannot make itself root in a new user
    namespace."""
    result = _run('import os\nos.execv("/usr/bin/unshare", ["unshare", "--user", "--map-root-user", "id"])', False)
    assert result.stdout == "" and "unshare failed" in result.stderr and not result.ok, result


def _sleepers(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


@needs_bwrap
def test_background_process_dies_with_the_call(monkeypatch):
    """Process creation allowed (the seccomp layer off): a setsid'd child holding the output pipes is still killed
    with the namespace, and the call does not wait for it."""
    monkeypatch.setattr(isolation, "seccomp_program", lambda: None)
    code = """
        import os
        if os.fork() == 0:
            os.setsid()
            os.execv("/usr/bin/sleep", ["sleep", "987.654"])
        print("parent done")
    """
    start = time.monotonic()
    result = _run(code, audit_hook=False, timeout_s=10.0)
    assert result.stdout == "parent done\n" and result.ok, result
    assert time.monotonic() - start < 2.0  # not blocked by the child holding stdout open
    time.sleep(0.2)  # the kernel reaps the namespace asynchronously
    assert _sleepers("987.654") == []


@needs_bwrap
@HOOK
@pytest.mark.parametrize("code", ["while True:\n    pass", "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)"],
                         ids=["busy", "closed-pipes"])
def test_call_returns_within_its_time_limit(code, audit_hook):
    start = time.monotonic()
    result = _run(code, audit_hook, timeout_s=1.5)
    assert result.timed_out and result.reason == "timeout"
    assert time.monotonic() - start < 1.5 + 0.5  # limit + kill and reap


def test_code_rewards_refuse_without_isolation(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap on PATH
    monkeypatch.delenv(isolation.OPT_IN, raising=False)
    isolation.isolation_level.cache_clear()
    isolation.require_isolation.cache_clear()
    try:
        with pytest.raises(ConfigError, match=f"set {isolation.OPT_IN}=1") as error:
            run_sandboxed("print(1)")
        assert "\n" not in str(error.value)
        monkeypatch.setenv(isolation.OPT_IN, "1")
        result = run_sandboxed("print(input())", stdin="opted in")
        assert result.ok and result.stdout == "opted in\n"
    finally:
        isolation.isolation_level.cache_clear()
        isolation.require_isolation.cache_clear()


def test_an_environment_using_code_rewards_is_refused_at_start_up(tmp_path, monkeypatch):
    from rl_lightning.envs.environment import load_environment

    env = tmp_path / "code_env.py"
    env.write_text("from rl_lightning.rewards.code import code_reward\n\n"
                   "def reward_fn(messages, answer):\n    return code_reward(messages, answer)\n")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(isolation.OPT_IN, raising=False)
    isolation.isolation_level.cache_clear()
    isolation.require_isolation.cache_clear()
    try:
        with pytest.raises(ConfigError, match=f"code sandbox: no OS isolation here .* set {isolation.OPT_IN}=1"):
            load_environment(str(env))
        plain = tmp_path / "plain_env.py"
        plain.write_text("def reward_fn(messages, answer):\n    return 1.0\n")
        assert load_environment(str(plain)).score([], None, "row 1") == (1.0, {})  # other rewards are unaffected
    finally:
        isolation.isolation_level.cache_clear()
        isolation.require_isolation.cache_clear()
