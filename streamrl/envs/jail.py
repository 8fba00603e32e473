"""The program that puts one sandboxed command in its own namespaces (see sandbox.py).

Run as `python -I -S jail.py` with the call's spec on stdin (a dict, `marshal`ed:
the caller is the same interpreter); it uses the standard library only (and the
few modules that start fast), so it runs without the project's packages on the
path. It answers on stdout with one marshalled dict: `{"status": <wait
status>}`, `{"timed_out": True}`, `{"exec_error": why}` or `{"unavailable": why}`.

Three processes, each dying with its parent (`PR_SET_PDEATHSIG`):

  supervisor  this program: drops supplementary groups (and, as root, maps the
              sandbox to an unprivileged outer uid), unshares user, mount, PID,
              network, IPC, UTS and cgroup namespaces, has a forked helper in
              the parent user namespace write its uid/gid maps, then forks the
              init and waits for it until the deadline, when it kills it.
  init        PID 1 of the new PID namespace: builds the new root (read-only
              binds of what the interpreter needs, a new /proc, a size-capped
              tmpfs at /tmp), pivots into it, forks the command and reaps
              whatever is orphaned until the command exits; then it exits and
              the kernel kills every process left in the namespace before the
              supervisor's wait returns, so nothing the command started
              outlives the call.
  command     drops to the sandbox's uid, sets the limits and
              `PR_SET_NO_NEW_PRIVS`, and execs; it holds no capabilities after
              the exec (its uid is not the namespace's root).
"""

import ctypes
import marshal
import os
import select
import signal
import stat
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACES = (
    CLONE_NEWUSER
    | CLONE_NEWNS
    | CLONE_NEWPID
    | CLONE_NEWNET
    | CLONE_NEWIPC
    | CLONE_NEWUTS
    | CLONE_NEWCGROUP
)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
# statvfs f_flag bits -> the mount flags a bind's remount must keep (a user namespace
# may not clear the flags its parent's mount was made with).
_KEPT_FLAGS = (
    (os.ST_RDONLY, MS_RDONLY),
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
libc.sethostname.argtypes = (ctypes.c_char_p, ctypes.c_size_t)
libc.prctl.argtypes = (ctypes.c_int,) + (ctypes.c_ulong,) * 4


class Refused(Exception):
  """The kernel refused a namespace operation: the sandbox cannot be made here."""


def _check(ret: int, what: str) -> None:
  if ret != 0:
    raise Refused(f"{what}: {os.strerror(ctypes.get_errno())}")


def _b(path):
  return None if path is None else os.fsencode(path)


def mount(source, target, fstype, flags, data=None) -> None:
  _check(libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
  machine = os.uname().machine
  number = _SYS_PIVOT_ROOT.get(machine)
  if number is None:
    raise Refused(f"pivot_root: unknown system call number on {machine}")
  _check(libc.syscall(ctypes.c_long(number), _b(new_root), _b(put_old)), f"pivot_root {new_root}")


def die_with_parent(parent: int) -> None:
  libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  if os.getppid() != parent:  # it died before the line above
    os._exit(1)


def answer(**reply) -> None:
  os.write(1, marshal.dumps(reply))
  os._exit(0)


# ------------------------------------------------------------ supervisor
def main() -> None:
  spec = marshal.loads(sys.stdin.buffer.read())
  deadline = time.monotonic() + spec["timeout_s"]
  die_with_parent(spec["parent"])
  inner = spec["uid"]
  if os.geteuid() == 0:
    # Root outside: supplementary groups dropped now, while it may, and the sandbox's uid
    # mapped to an unprivileged outer one, so even a write that escaped would be nobody's.
    try:
      os.setgroups([])
    except PermissionError:  # a namespace's root that may not: it has no others mapped
      pass
    outer_uid = outer_gid = spec["root_maps_to"]
  else:
    outer_uid, outer_gid = os.geteuid(), os.getegid()
  go_r, go_w = os.pipe()
  done_r, done_w = os.pipe()
  helper = os.fork()
  if helper == 0:  # writes the maps from the parent user namespace
    os.close(go_w)
    os.close(done_r)
    target = os.getppid()
    if os.read(go_r, 1) != b"u":
      os._exit(1)
    try:
      for name, text in (
          ("setgroups", "deny"),
          ("uid_map", f"{inner} {outer_uid} 1\n"),
          ("gid_map", f"{inner} {outer_gid} 1\n"),
      ):
        with open(f"/proc/{target}/{name}", "w") as f:
          f.write(text)
      os.write(done_w, b"ok")
    except OSError as err:
      os.write(done_w, f"writing the uid/gid maps: {err.strerror}".encode())
    os._exit(0)
  os.close(go_r)
  os.close(done_w)
  if libc.unshare(NAMESPACES) != 0:
    why = os.strerror(ctypes.get_errno())
    os.close(go_w)
    os.waitpid(helper, 0)
    answer(unavailable=f"unshare: {why}")
  os.write(go_w, b"u")
  os.close(go_w)
  said = os.read(done_r, 4096)
  os.waitpid(helper, 0)
  if said != b"ok":
    answer(unavailable=said.decode() or "the uid/gid map helper died")

  report_r, report_w = os.pipe()  # the init and the command to us; closed by exec
  init = os.fork()
  if init == 0:
    os.close(report_r)
    os.close(1)  # our answer to the caller is ours alone
    run_init(spec, report_w)
  os.close(report_w)
  timed_out = not _wait_until(init, deadline)
  if timed_out:
    os.kill(init, signal.SIGKILL)
  os.waitpid(init, 0)  # returns once every process of the namespace is gone
  report = b""
  while chunk := os.read(report_r, 65536):
    report += chunk
  # The first line says how it went: the command's exec error comes before the init's status.
  kind, _, detail = report.decode(errors="replace").partition("\n")[0].partition(" ")
  if timed_out:
    answer(timed_out=True)
  if kind == "S":
    answer(status=int(detail))
  if kind == "X":
    answer(exec_error=detail)
  answer(unavailable=detail if kind == "E" else "the sandbox's init died during setup")


def _wait_until(pid: int, deadline: float) -> bool:
  """Whether `pid` exited before `deadline` (it is not reaped)."""
  fd = os.pidfd_open(pid)
  try:
    left = deadline - time.monotonic()
    return left > 0 and bool(select.select([fd], [], [], left)[0])
  finally:
    os.close(fd)


# ------------------------------------------------------------------ init
def run_init(spec: dict, report_w: int) -> None:
  try:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # Its parent is outside its PID namespace (getppid() says 0): whether the supervisor
    # died before the line above shows as the report pipe having no reader.
    watch = select.poll()
    watch.register(report_w, select.POLLOUT)
    if any(events & select.POLLERR for _, events in watch.poll(0)):
      os._exit(1)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the command cannot ptrace or read us
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
      signal.signal(sig, signal.SIG_DFL)  # PID 1 ignores what it has no handler for
    build_root(spec)
    _check(libc.sethostname(b"sandbox", 7), "sethostname")
  except Refused as err:
    os.write(report_w, f"E {err}\n".encode())
    os._exit(1)
  except OSError as err:
    os.write(report_w, f"E setting up the sandbox: {err}\n".encode())
    os._exit(1)
  command = os.fork()
  if command == 0:
    run_command(spec, report_w)
  while True:  # reaps orphans until the command is done
    pid, status = os.wait()
    if pid == command:
      os.write(report_w, f"S {status}\n".encode())
      os._exit(0)


def build_root(spec: dict) -> None:
  """The new root: the binds of `spec["ro_paths"]`, devices, /proc, a tmpfs at /tmp."""
  mount(None, "/", None, MS_REC | MS_PRIVATE)
  # The sources are opened while this process may still reach them (a root host's
  # interpreter may live under /root); from here on it is the sandbox's uid, which owns
  # what it creates, and binds them through /proc/self/fd.
  links, opened = {}, {}
  for path in spec["ro_paths"]:
    if os.path.islink(path):
      links[path] = os.readlink(path)
    else:
      opened[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
  uid = spec["uid"]
  os.setresgid(uid, uid, uid)
  os.setresuid(uid, uid, uid)  # keeps the namespace's capabilities: its root is unmapped
  # A scratch tmpfs holds the new root while it is built; pivoting into it leaves the
  # old root at /oldroot, whole (its /tmp included).
  base = "/tmp" if os.path.isdir("/tmp") else "/mnt"
  mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0700")
  os.mkdir(f"{base}/oldroot")
  os.mkdir(f"{base}/newroot")
  pivot_root(base, f"{base}/oldroot")
  os.chdir("/")
  mount("tmpfs", "/newroot", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
  for path, target in links.items():  # /bin -> usr/bin on merged-/usr systems
    os.makedirs(os.path.dirname("/newroot" + path), exist_ok=True)
    os.symlink(target, "/newroot" + path)
  # Its writable directory first: a read-only path may lie under /tmp on the host.
  os.mkdir("/newroot/tmp")
  mount(
      "tmpfs",
      "/newroot/tmp",
      "tmpfs",
      MS_NOSUID | MS_NODEV,
      f"size={spec['tmp_bytes']},mode=0700,uid={uid},gid={uid}",
  )
  os.mkdir("/newroot/dev")
  for name in DEVICES:
    if os.path.exists(f"/oldroot/dev/{name}"):
      open(f"/newroot/dev/{name}", "w").close()
      mount(f"/oldroot/dev/{name}", f"/newroot/dev/{name}", None, MS_BIND)
  for name, target in (("fd", "/proc/self/fd"), ("stdin", "fd/0"), ("stdout", "fd/1")):
    os.symlink(target, f"/newroot/dev/{name}")
  os.symlink("fd/2", "/newroot/dev/stderr")
  os.mkdir("/newroot/proc")
  # Ours is PID 1's namespace: it shows only the sandbox's processes.
  mount("proc", "/newroot/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  # No user namespaces of its own: they would give the command capabilities again (over
  # namespaces of its own), the way in of many kernel exploits.
  with open("/newroot/proc/sys/user/max_user_namespaces", "w") as f:
    f.write("0")
  for path, fd in opened.items():
    is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
    _bind_read_only(f"/oldroot/proc/self/fd/{fd}", "/newroot" + path, is_dir)
    os.close(fd)
  mount(None, "/newroot", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
  _check(libc.umount2(b"/oldroot", MNT_DETACH), "umount /oldroot")
  os.chdir("/newroot")
  pivot_root(".", ".")
  _check(libc.umount2(b".", MNT_DETACH), "umount the scratch root")
  os.chdir("/")


def _bind_read_only(source: str, target: str, is_dir: bool) -> None:
  if is_dir:
    os.makedirs(target, exist_ok=True)
  else:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    open(target, "w").close()
  mount(source, target, None, MS_BIND | MS_REC)
  # Read-only, with every mount below it (mount_setattr, Linux 5.12+); else the top one,
  # keeping the flags a user namespace may not clear.
  attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
  done = libc.syscall(
      ctypes.c_long(_SYS_MOUNT_SETATTR),
      ctypes.c_long(AT_FDCWD),
      _b(target),
      ctypes.c_long(AT_RECURSIVE),
      attr,
      ctypes.c_long(32),
  )
  if done == 0:
    return
  kept = os.statvfs(target).f_flag
  flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
  flags |= sum(ms for st, ms in _KEPT_FLAGS if kept & st)
  mount(None, target, None, flags)


# --------------------------------------------------------------- command
def run_command(spec: dict, report_w: int) -> None:
  import resource  # pylint: disable=g-import-not-at-top

  try:
    os.chdir("/tmp")
    for name, text in spec["files"].items():
      with open(name, "w") as f:
        f.write(text)
  except OSError as err:  # the caller's files do not fit in its /tmp
    os.write(report_w, f"X cannot write its files: {err}\n".encode())
    os._exit(127)
  try:
    for name, value in spec["limits"].items():
      limit = getattr(resource, name)
      resource.setrlimit(limit, (value, value))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl no_new_privs")
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(spec["stdout_fd"], 1)
    os.dup2(spec["stderr_fd"], 2)
    os.closerange(3, report_w)
    os.closerange(report_w + 1, 1 << 16)
  except (OSError, Refused) as err:
    os.write(report_w, f"E preparing the command: {err}\n".encode())
    os._exit(127)
  try:
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
  except OSError as err:
    os.write(report_w, f"X cannot run {spec['argv'][0]!r}: {err.strerror}\n".encode())
    os._exit(127)


if __name__ == "__main__":
  main()
