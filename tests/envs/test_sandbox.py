"""The sandbox model-written code runs in, tried as an attacker would (the policy being
trained writes that code): one test per guarantee, each run for real in the isolated
sandbox; where the older `unsafe` subprocess lets the attack through, the test shows
that too, so it is an attack that would succeed without the sandbox."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from streamrl.envs import base, sandbox, tools
from streamrl.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kernel_gives_user_namespaces() -> bool:
  unshare = shutil.which("unshare")
  if unshare is None:
    return True  # no way to ask: let the sandbox's own tests say
  return subprocess.run([unshare, "--user", "--map-root-user", "true"], check=False).returncode == 0


# The sandbox's tests fail where our code is wrong, and are skipped only where the kernel
# itself refuses unprivileged user namespaces (then the tool refuses to start: the last tests).
pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        not _kernel_gives_user_namespaces(), reason="this kernel refuses user namespaces"
    ),
]


def _py(code: str, timeout_s: float = 20.0, **kwargs) -> sandbox.Result:
  return sandbox.python(textwrap.dedent(code), timeout_s=timeout_s, **kwargs)


def _running_with(marker: str) -> list[int]:
  """The host's processes whose command line holds `marker`."""
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit() and int(entry) != os.getpid():
      try:
        with open(f"/proc/{entry}/cmdline", "rb") as f:
          if marker.encode() in f.read():
            pids.append(int(entry))
      except OSError:
        pass
  return pids


def test_it_runs_code_as_an_unprivileged_uid_without_capabilities():
  r = _py("""
      import ctypes, os
      status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())
      print(os.getuid(), os.getgid(), status['CapEff'].strip(), status['CapPrm'].strip(),
            status['NoNewPrivs'].strip(), os.getcwd())
      libc = ctypes.CDLL(None, use_errno=True)  # a user namespace would give capabilities back
      print(libc.unshare(0x10000000), ctypes.get_errno())
      """)
  assert r.returncode == 0, r
  ids, nested = r.stdout.splitlines()
  assert ids.split() == ["65534", "65534", "0" * 16, "0" * 16, "1", "/tmp"]
  assert nested == "-1 28"  # ENOSPC


def test_it_cannot_read_a_private_file_outside(tmp_path):
  secret = tmp_path / "credentials"
  secret.write_text("token-4f2a")
  secret.chmod(0o600)
  attack = f"""
      import os
      print(open({str(secret)!r}).read())
      """
  r = _py(attack)
  assert r.returncode != 0 and "FileNotFoundError" in r.stderr, r
  assert "token-4f2a" not in r.stdout + r.stderr
  # Nothing of the host's tree but what the interpreter needs: no home, no project.
  top = set(_py("import os; print(*os.listdir('/'))").stdout.split())
  allowed = {"dev", "proc", "tmp", "etc"} | {p.split("/")[1] for p in sandbox._read_only_paths(())}
  assert top <= allowed, top - allowed
  assert "token-4f2a" in _py(attack, mode="unsafe").stdout  # the attack works without it


def test_it_cannot_write_or_delete_outside(tmp_path):
  victim = tmp_path / "checkpoint.bin"
  victim.write_text("weights")
  r = _py(f"""
      import os, sys
      for what, attempt in [
          ("delete", lambda: os.remove({str(victim)!r})),
          ("create", lambda: open({str(tmp_path / 'new.txt')!r}, 'w')),
          ("prefix", lambda: open(os.path.join(sys.base_prefix, 'x'), 'w')),
          ("usr", lambda: open('/usr/x', 'w')),
          ("root", lambda: os.mkdir('/x')),
      ]:
        try:
          attempt()
          print(what, 'done')
        except OSError as err:
          print(what, type(err).__name__)
      open('mine.txt', 'w').write('ok')  # its own directory is writable
      print('own', open('mine.txt').read())
      """)
  assert r.returncode == 0, r
  assert "done" not in r.stdout, r.stdout
  assert "own ok" in r.stdout
  assert victim.read_text() == "weights" and not (tmp_path / "new.txt").exists()
  # Its directory is capped: past sandbox.TMP_BYTES a write fails, the host's disk untouched.
  r = _py(f"""
      i = 0
      try:
        while True:
          with open(f'f{{i}}', 'wb') as f:
            f.write(bytes({sandbox.FILE_BYTES}))
          i += 1
      except OSError as err:
        print(i, err.errno)
      """)
  assert r.returncode == 0, r
  files, errno_ = map(int, r.stdout.split())
  assert files * sandbox.FILE_BYTES <= sandbox.TMP_BYTES and errno_ == 28  # ENOSPC
  r = _py(f"import os; os.remove({str(victim)!r})", mode="unsafe")
  assert r.returncode == 0 and not victim.exists()  # the attack works without it


def test_nothing_it_starts_outlives_the_call_or_holds_it_up():
  marker = f"straggler-{uuid.uuid4().hex}"
  attack = f"""
      import os, time, sys
      # {marker}
      if os.fork() == 0:  # a child holding stdout open, and a daemonized grandchild
        if os.fork() == 0:
          os.setsid()
          time.sleep(60)
        time.sleep(60)
        os._exit(0)
      print('parent done', flush=True)
      """
  t0 = time.monotonic()
  r = _py(attack, timeout_s=60)
  took = time.monotonic() - t0
  assert (r.returncode, r.stdout.strip(), r.timed_out) == (0, "parent done", False), r
  assert took < 30, took  # it returned when its command did, not at its deadline
  assert _running_with(marker) == []
  # Cut at its deadline too, with its children.
  r = _py(attack.replace("print('parent done', flush=True)", "time.sleep(60)"), timeout_s=1)
  assert r.timed_out and r.returncode is None
  assert _running_with(marker) == []
  # Without it, the children outlive the call (then this test kills them).
  sandbox.python(textwrap.dedent(attack), timeout_s=2, mode="unsafe")
  survivors = _running_with(marker)
  for pid in survivors:
    os.kill(pid, signal.SIGKILL)
  assert survivors


def test_it_cannot_see_or_signal_the_hosts_processes():
  host = subprocess.Popen(["sleep", "60"])  # stands in for the trainer, a generator, Ray
  try:
    r = _py(f"""
        import os, signal
        print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
        try:
          os.kill({host.pid}, signal.SIGKILL)
          print('killed')
        except ProcessLookupError:
          print('no such process')
        try:
          os.kill(-1, signal.SIGKILL)  # every process it may signal but itself and its init
          print('signalled some')
        except ProcessLookupError:
          print('none to signal')
        """)
    assert r.returncode == 0, r
    pids, answer, everyone = r.stdout.splitlines()
    assert json.loads(pids) == [1, 2] and answer == "no such process", r.stdout
    assert everyone == "none to signal"
    time.sleep(0.2)
    assert host.poll() is None  # alive
  finally:
    host.kill()
    host.wait()


def test_a_fork_storm_is_bounded():
  marker = f"storm-{uuid.uuid4().hex}"
  r = _py(f"""
      import os, time
      # {marker}
      n = 0
      try:
        while n < 10_000:
          if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
          n += 1
      except OSError as err:
        print(n, err.errno)
      """)
  assert r.returncode == 0, r
  forked, errno_ = map(int, r.stdout.split())
  assert forked < sandbox.PROCESSES and errno_ == 11  # EAGAIN
  assert _running_with(marker) == []


def test_it_has_no_network():
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(1)
  listener.settimeout(0.5)
  port = listener.getsockname()[1]
  try:
    r = _py(f"""
        import socket
        print(socket.if_nameindex())
        for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:
          try:
            socket.create_connection(addr, 2)
            print('connected')
          except OSError as err:
            print(type(err).__name__)
        """)
    assert r.returncode == 0, r
    interfaces, *attempts = r.stdout.splitlines()
    assert interfaces == "[(1, 'lo')]" and "connected" not in attempts, r.stdout
    with pytest.raises(socket.timeout):
      listener.accept()
  finally:
    listener.close()


def test_memory_and_time_are_limited():
  r = _py("x = bytearray(2 << 30)")
  assert "MemoryError" in r.stderr, r
  r = _py("while True: pass", timeout_s=1)
  assert r.timed_out, r
  with pytest.raises(tools.ToolError, match="timeout"):
    tools.python_sandbox("import time; time.sleep(30)", 1.0)
  assert tools.python_sandbox("print(6*7)", 10) == "42"


def test_a_user_environment_runs_its_commands_in_the_sandbox(tmp_path):
  data = tmp_path / "data"
  data.mkdir()
  (data / "words.txt").write_text("a b c\n")
  r = sandbox.run(
      ["sh", "-c", f"cat solution.py {data}/words.txt | wc -w; python3 -I -S solution.py"],
      files={"solution.py": "print('solved')\n"},
      read_only=[str(data)],
      timeout_s=20,
  )
  assert r.returncode == 0 and r.stdout.split() == ["4", "solved"], r
  r = sandbox.run(["no-such-command"], timeout_s=20)
  assert r.returncode == 127 and "cannot run 'no-such-command'" in r.stderr, r
  with pytest.raises(UserError, match="does not exist"):
    sandbox.run(["true"], read_only=[str(tmp_path / "missing")])
  with pytest.raises(ValueError, match="plain name"):
    sandbox.run(["true"], files={"../x": ""})
  # A tool worker runs its calls in the mode of the run's env.sandbox.
  step = base.step_in_worker("python", None, "", "[py import os;print(os.getuid())]", 10.0)
  assert step.observation == f"({sandbox.SANDBOX_UID})"
  try:
    step = base.step_in_worker("python", None, "", "[py print(1+1)]", 10.0, "unsafe")
    assert step.observation == "(2)"
    with pytest.raises(UserError, match="env.sandbox='docker' is unknown"):
      base.step_in_worker("python", None, "", "[py 1]", 10.0, "docker")
  finally:
    sandbox.set_default_mode("isolated")


_ATTACKS = textwrap.dedent("""
    import json, os, socket, sys
    sys.path.insert(0, sys.argv[1])
    from streamrl.envs import sandbox
    out = {"uid": os.getuid()}
    read = "print(open(%r).read())" % sys.argv[2]
    out["read_isolated"] = sandbox.python(read, timeout_s=20).stdout
    out["read_unsafe"] = sandbox.python(read, timeout_s=20, mode="unsafe").stdout
    out["delete"] = sandbox.python("import os; os.remove(%r)" % sys.argv[2], timeout_s=20).returncode
    out["procs"] = sandbox.python("import os; print(len(os.listdir('/proc')))", timeout_s=20).stdout
    out["net"] = sandbox.python("import socket; print(socket.if_nameindex())", timeout_s=20).stdout
    print(json.dumps(out))
    """)


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
    reason="needs root to become another user, setpriv and a system python",
)
def test_as_a_user_without_privileges_it_holds_the_same():
  """The laptop's case: the run's user is not root; its own 0600 file is the secret."""
  home = tempfile.mkdtemp(prefix="streamrl-home-")
  try:
    os.chown(home, 65534, 65534)
    secret = os.path.join(home, "credentials")
    with open(secret, "w") as f:
      f.write("token-77e1")
    os.chown(secret, 65534, 65534)
    os.chmod(secret, 0o600)
    proc = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-I",
            "-c",
            _ATTACKS,
            REPO,
            secret,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=home,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["uid"] == 65534
    assert out["read_unsafe"].strip() == "token-77e1"  # as that user, the file is readable
    assert "token-77e1" not in out["read_isolated"]
    assert out["delete"] != 0 and os.path.exists(secret)
    assert int(out["procs"]) < 100 and out["net"].strip() == "[(1, 'lo')]"
  finally:
    shutil.rmtree(home)


_REFUSED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from streamrl.envs import sandbox, tools
    out = {}
    code = "import socket; socket.create_connection(('127.0.0.1', %s), 2); print('connected')"
    for name, call in [
        ("check", lambda: sandbox.check()),
        ("tool", lambda: tools.python_sandbox(code % sys.argv[2], 10)),
    ]:
      try:
        call()
        out[name] = "ran"
      except sandbox.SandboxUnavailable as err:
        out[name] = str(err)
    out["unsafe"] = sandbox.python("print(6*7)", mode="unsafe").stdout.strip()
    print(json.dumps(out))
    """)


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs util-linux's unshare")
def test_where_the_kernel_refuses_user_namespaces_the_tool_refuses_to_run():
  """A user namespace whose limit of nested namespaces is 0 stands in for a kernel that
  refuses them: the tool refuses (so no code reaches the network), naming the opt-out."""
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(1)
  listener.settimeout(0.5)
  script = (
      "echo 0 > /proc/sys/user/max_user_namespaces && "
      f'exec {sys.executable} -c "$0" {REPO} {listener.getsockname()[1]}'
  )
  try:
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", script, _REFUSED],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for name in ("check", "tool"):
      assert "env.sandbox=unsafe" in out[name], out
      assert out[name].count(". ") == 0  # one sentence
    assert out["unsafe"] == "42"  # the explicit opt-out still runs code
    with pytest.raises(socket.timeout):
      listener.accept()
  finally:
    listener.close()
