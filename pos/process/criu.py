"""CRIU, driven through one narrow module: find a CRIU >= 4, build its command lines from typed
options, run it, and turn its failures into PosError with the tail of its log.

Where CRIU comes from, first found wins: $POS_CRIU (must work if set), `criu` on the PATH when it
is >= 4, then the copy that scripts/setup.sh installs (/opt/pos/criu/criu: CRIU 4.2 from Debian
forky run through its own glibc). Bookworm's 3.17 fails on kernels >= 6.x (vDSO layout), so
older versions are refused rather than allowed to fail half-way.
"""

import os
import re
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

from pos.errors import BadInput, PosError
from pos.image import names
from pos.process import kdat, procs
from pos.settings import DEFAULT_CRIU_LOG_MAX_MB, DEFAULT_LOG_DIR, Settings

SETUP_COPY = "/opt/pos/criu/criu"
MIN_VERSION = (4, 0)
FIX_INSTALL = ("run scripts/setup.sh (it installs CRIU 4.2 into /opt/pos/criu), or set POS_CRIU "
               "to a CRIU >= 4.0")

# Where the logs of failed CRIU runs are kept (the failed image or work folder is removed).
KEEP_BYTES = 64 << 20          # at most this much of a log is kept there (its head and tail)
TAIL_BYTES = 1 << 20           # where the error lines are looked for
POLL_S = 0.05                  # how often a restore's CRIU, its log and its stop are looked at
END_S = 2.0                    # what ending a restore's CRIU may take

@dataclass(frozen=True)
class KnownFailure:
    """One class of CRIU failure: what CRIU's log says, and the cause and the fix in words, so
    that the user reads one sentence instead of CRIU's log. `cause` and `fix` may name the
    pattern's groups ({0}, {1} ...); `action` limits the entry to "dump" or "restore"."""

    pattern: str
    cause: str
    fix: str
    action: str = ""


LAZY_OFF = "set POS_LAZY_PAGES=0 (CRIU then restores all of the memory before the job runs)"
# First match wins, so the narrow entries come before the broad ones.
KNOWN_FAILURES: tuple[KnownFailure, ...] = (
    # a lazy restore (POS_LAZY_PAGES=1, pos/operation/lazypages.py): `criu check --feature
    # uffd-noncoop`'s answer when its daemon ended at once, or the restore's own refusal.
    # Docker's default seccomp profile refuses userfaultfd(2), as kernels built without it do.
    KnownFailure(r"UFFD is not supported|userfaultfd descriptor|lazy-pages: register",
                 "this kernel, or the sandbox pos runs in (a container's seccomp profile), "
                 "refuses CRIU the userfaultfd that a lazy restore needs", LAZY_OFF),
    # Linux 6.16 refuses SO_PASSCRED/SO_PASSSEC on INET sockets and CRIU 4.1 treats that as
    # fatal (checkpoint-restore/criu#2718, fixed after 4.1): no process with a TCP/UDP socket
    # can be dumped by it, whatever the options.
    KnownFailure(r"Can't get 1:(16|34) opt", "this CRIU cannot dump INET (TCP/UDP) sockets on "
                 "this kernel (Linux >= 6.16 refuses SO_PASSCRED on them; CRIU issue 2718)",
                 "use a CRIU released after 4.1 (POS_CRIU), or a kernel older than 6.16"),
    # before the "TCP connection" entry: the lock of the connections is what failed here
    KnownFailure(r"Iptables configuration failed|Failed to lock TCP connection",
                 "CRIU could not lock the process's TCP connections for the dump (it runs "
                 "iptables-restore)", "install iptables (apt-get install iptables), or run pos "
                 "where iptables works"),
    KnownFailure(r"No space left on device", "the image's filesystem ran out of space",
                 "free space there or give another -D"),
    # CRIU refuses to reopen a file whose size differs from the dump's. pos itself reopens a
    # log (a file open write-only at its end) for appending; this is any other file.
    KnownFailure(r"File (\S+) has bad size (\d+) \(expect (\d+)\)",
                 "the file /{0} changed since the dump ({2} bytes then, {1} now)",
                 "put it back as it was at the dump, or hand the restore a descriptor of it "
                 "with --inherit-fd 'fd[N]:{0}'"),
    # a shell job's terminal is the one CRIU itself runs on: pos gives it its own
    KnownFailure(r"Don't have tty to inherit session from", "the process had a terminal, and "
                 "the restore attaches it to the terminal that `pos restore` runs on, which has "
                 "none", "run pos restore on a terminal, or start the job with its output "
                 "redirected (setsid COMMAND </dev/null >LOG 2>&1) before the checkpoint",
                 "restore"),
    # before the shell-job entry: --shell-job does not help here (CRIU cannot recreate a
    # session whose leader it cannot see), a session of the job's own does
    KnownFailure(r"outside of its pid namespace", "the process's session was started outside "
                 "its PID namespace (a container's first process that never called setsid), so "
                 "CRIU cannot recreate it, not even with --shell-job", "start the job in its own "
                 "session (setsid COMMAND, or your runtime's init option), then checkpoint it"),
    # a job started in the background (`&`) of a shell or a script, terminal or not
    KnownFailure(r"The root process (\d+) is not a session leader", "PID {0} does not lead its "
                 "session: the session's leader (the shell or script that started it) is not "
                 "part of the dump", "add --shell-job, or start the job in a session of its own "
                 "(setsid COMMAND)"),
    KnownFailure(r"isn't dumped|[Ss]ession leader .* outside|tty",
                 "the process belongs to a terminal session that is not part of the dump",
                 "add --shell-job"),
    KnownFailure(r"Connected TCP socket|TCP connection", "the process has established TCP "
                 "connections", "add --tcp-established"),
    # a stream socket's other half cannot be recreated by the restore: --ext-unix-sk does not
    # help, the launcher keeps the peer and hands the socket back (--inherit-fd)
    KnownFailure(r"Can't dump half of stream unix", "the process has a UNIX stream socket "
                 "connected outside its tree", "add --external 'unix[INODE]' (INODE of its "
                 "socket:[INODE] in /proc/PID/fd) and restore with --inherit-fd "
                 "'fd[N]:socket:[INODE]'"),
    # the dump left the socket to the restore (--external), and the restore was not given it
    KnownFailure(r"External socket found in image", "the image holds a UNIX socket that the "
                 "dump left external, and the restore was not given it", "restore with "
                 "--inherit-fd 'fd[N]:socket:[INODE]' (N: pos's descriptor of a socket, INODE: "
                 "the one of the dump's --external 'unix[INODE]')", "restore"),
    KnownFailure(r"External socket|unix socket .*external", "the process has a UNIX socket "
                 "connected outside its tree", "add --ext-unix-sk for a datagram socket; for a "
                 "stream socket add --external 'unix[INODE]' and restore with --inherit-fd "
                 "'fd[N]:socket:[INODE]'"),
    KnownFailure(r"Missing file locks|[Ff]ile lock", "the process holds file locks",
                 "add --file-locks"),
    KnownFailure(r"[Uu]nable to find mount point|[Ee]xternal mount", "the process uses a mount "
                 "CRIU cannot see as its own", "name it with --external mnt[...]"),
    KnownFailure(r"Can't fork for (\d+): File exists|PID .* is busy|clone.*File exists",
                 "a PID of the image is taken by another process", "stop that process, then "
                 "restore again"),
    KnownFailure(r"/dev/nvidia", "the process still has NVIDIA device files open",
                 "pos checkpoints the GPU state first; check that the driver checkpoint "
                 "succeeded"),
)
# CRIU's closing lines, whatever failed: never the cause themselves
SUMMARY = re.compile(r"(Dumping|Restoring) FAILED|Unable to open fd=")


GHOST_LIMIT_DEFAULT = 1 << 20     # CRIU's own


@dataclass(frozen=True)
class Options:
    """The CRIU options a user may need, recorded in the image so that restore uses the same."""

    shell_job: bool = False          # --shell-job: the tree belongs to a terminal session
    tcp_established: bool = False    # --tcp-established: dump/restore live TCP connections
    ext_unix_sk: bool = False        # --ext-unix-sk: UNIX sockets connected outside the tree
    file_locks: bool = False         # --file-locks
    external: tuple[str, ...] = ()   # --external RES: files, mounts ... that CRIU leaves alone
    network_lock: Optional[str] = None   # "skip": every TCP connection is inside the tree
    ghost_limit: Optional[int] = None    # bytes: the largest deleted file CRIU may save
    empty_netns: bool = False        # --empty-ns net: the tree's network namespace of its own
                                     # (pos run --clonable) is saved empty, each restore makes
                                     # a new one: no addresses, routes or firewall to save, and
                                     # copies of one image do not share one

    def argv(self) -> list[str]:
        out = ["--network-lock", self.network_lock] if self.network_lock else []
        if self.ghost_limit:
            out += ["--ghost-limit", str(self.ghost_limit)]
        if self.empty_netns:
            out += ["--empty-ns", "net"]
        for flag, on in (("--shell-job", self.shell_job), ("--tcp-established", self.tcp_established),
                         ("--ext-unix-sk", self.ext_unix_sk), ("--file-locks", self.file_locks)):
            if on:
                out.append(flag)
        for res in self.external:
            out += ["--external", res]
        return out

    def fitted(self, pids: list[int]) -> "Options":
        """These options for the tree `pids`: with --tcp-established, no network lock where
        every connection has both ends in the tree (procs.tcp_within); a ghost limit that
        takes the largest deleted file the tree holds, where one is over CRIU's 1 MiB; the
        network namespace saved empty for a tree of its own namespaces."""
        from pos.process import procs

        out = self
        if self.tcp_established and not self.network_lock and procs.tcp_within(pids):
            out = replace(out, network_lock="skip")
        ghost = procs.largest_deleted_file(pids)
        if ghost > GHOST_LIMIT_DEFAULT:
            out = replace(out, ghost_limit=ghost + (1 << 20))
        if procs.own_namespaces(pids) and procs.own_netns(pids[0]):
            out = replace(out, empty_netns=True)
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["external"] = list(self.external)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Options":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        known["external"] = tuple(known.get("external", ()))
        return cls(**known)


@dataclass(frozen=True)
class PageServer:
    """Where `criu dump` sends memory pages instead of writing pages-*.img locally; `tls`:
    CRIU's options that authenticate both ends (pos/engines/migrate_key.py)."""

    address: str
    port: int
    tls: tuple[str, ...] = ()


@dataclass
class Criu:
    path: str
    version: tuple[int, ...]
    version_text: str = field(default="")
    log_dir: Path = Path(DEFAULT_LOG_DIR)     # where the logs of failed runs are kept
    log_max: int = DEFAULT_CRIU_LOG_MAX_MB << 20   # a restore whose log passes it is ended

    def _base(self, action: str, images: Path, log: str, workdir: Optional[Path]) -> list[str]:
        argv = [self.path, action, "-D", str(images), "-o", log, "-v4"]
        if workdir is not None:
            argv += ["-W", str(workdir)]
        return argv

    def dump_argv(self, pid: int, images: Path, opts: Options, leave_running: bool,
                  page_server: Optional[PageServer] = None, parent: Optional[str] = None
                  ) -> list[str]:
        """Without `leave_running` the tree stays, stopped, for the caller to end once the
        image is sealed: a pos that dies before then leaves it to run on (CRIU never ends it
        itself, or a pos that died between the dump and the seal would lose the job).
        `parent`: a pre-dump's folder, relative to `images` (predump_argv): the dump writes
        only the pages written since (CRIU takes the rest from there only with --track-mem)."""
        argv = self._base("dump", images, names.DUMP_LOG, None) + ["-t", str(pid), *opts.argv()]
        argv.append("--leave-running" if leave_running else "--leave-stopped")
        if parent is not None:
            argv += ["--track-mem", "--prev-images-dir", parent]
        if page_server is not None:
            argv += ["--page-server", "--address", page_server.address,
                     "--port", str(page_server.port), *page_server.tls]
        return argv

    def predump_argv(self, pid: int, images: Path, opts: Options) -> list[str]:
        """CRIU's pre-dump of the running tree: its memory into `images`, the kernel's
        soft-dirty bits cleared, for a dump_argv with `parent`. The tree runs on. Read mode:
        the tree is frozen only while CRIU finds its pages, and runs while they are read
        (process_vm_readv) and written; splice, CRIU's default, drains them frozen."""
        return self._base("pre-dump", images, names.PREDUMP_LOG, None) + [
            "-t", str(pid), *opts.argv(), "--track-mem", "--pre-dump-mode", "read"]

    def restore_argv(self, images: Path, opts: Options, workdir: Path, pidfile: Path,
                     inherit_fds: tuple[str, ...] = (), leave_stopped: bool = False,
                     lazy_pages: bool = False) -> list[str]:
        """`leave_stopped`: the restored tree stays stopped (SIGSTOP) for the caller to resume.
        `lazy_pages`: the memory that may be lazy is left to the daemon of lazy_pages_argv with
        the same `workdir`, where CRIU's socket between the two is."""
        argv = self._base("restore", images, names.RESTORE_LOG, workdir) + [
            "-d", "--pidfile", str(pidfile), *opts.argv()]
        if leave_stopped:
            argv.append("--leave-stopped")
        if lazy_pages:
            argv.append("--lazy-pages")
        for spec in inherit_fds:
            argv += ["--inherit-fd", spec]
        return argv

    def lazy_pages_argv(self, images: Path, workdir: Path, status_fd: int) -> list[str]:
        """CRIU's lazy-pages daemon for the image in `images`, in the foreground: it listens on
        lazy-pages.socket in `workdir` (CRIU's fixed name, relative to its work folder: criu/
        uffd.c), writes a byte to `status_fd` once it does, serves the pages of the restore
        that connects there, and exits once every page is in."""
        return self._base("lazy-pages", images, names.LAZY_PAGES_LOG, workdir) + [
            "--status-fd", str(status_fd)]

    def lacks(self, feature: str) -> str:
        """What CRIU says this kernel lacks of `feature` (`criu check --feature`), "" when
        it has it."""
        try:
            p = subprocess.run([self.path, "check", "--feature", feature], capture_output=True,
                               text=True, timeout=60)
        except subprocess.TimeoutExpired:
            return f"criu check --feature {feature} did not answer within 60 s"
        said = (p.stdout + p.stderr).strip().splitlines()
        if p.returncode == 0:
            return ""
        return _plain(said[-1]) if said else f"criu check --feature {feature} failed"

    def page_server_argv(self, images: Path, server: PageServer, workdir: Path) -> list[str]:
        return self._base("page-server", images, names.PAGE_SERVER_LOG, workdir) + [
            "--address", server.address, "--port", str(server.port), *server.tls]

    def start(self, argv: list[str], pass_fds: tuple[int, ...] = (),
              terminal: bool = False) -> subprocess.Popen:
        """Start CRIU in its own process group: a Ctrl-C meant for pos must not kill CRIU while
        its parasite code runs inside the target (pos decides what to do instead). `pass_fds`
        stay open in CRIU: the descriptors that --inherit-fd hands to the restored tree.
        `terminal`: CRIU gets pos's stdin, a terminal, which a shell job's restore attaches
        the job to (CRIU takes the terminal of its own stdin). CRIU's kernel-feature cache
        is kept first, where CRIU cannot keep it itself (pos/process/kdat.py): without it, CRIU
        probes the kernel for 30-70 ms before it starts on a job."""
        kdat.keep(self.path, self.version_text)
        return subprocess.Popen(argv, stdin=0 if terminal else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=os.setpgrp, pass_fds=pass_fds)

    def finish(self, proc: subprocess.Popen, what: str, log: Path,
               stop: Callable[[], Optional[BaseException]] = lambda: None) -> None:
        """Wait for CRIU and raise PosError if it failed.

        A restore's CRIU holds nothing of a live process, so it is ended at once, with the
        tasks it restored so far, on SIGINT/SIGTERM, when `stop()` gives a reason (raised: the
        image's check beside it failed), or when its log passes `log_max` (it loops:
        a restorer re-reading a short file logged 36 MB/s, issue 26). Any other CRIU has its
        parasite code inside the target: a SIGINT/SIGTERM is held back until it is done (then
        raised), so that the undo starts from a finished step."""
        endable = what == "restore"
        limit = self.log_max if endable else 0
        interrupted = False
        while True:
            try:
                out = proc.communicate(timeout=POLL_S if endable else None)[0] or b""
                break
            except subprocess.TimeoutExpired:
                reason = stop()
                if reason is None and log_bytes(log) > limit:
                    reason = overflow(what, log, limit, self.log_dir)
                if reason is not None:
                    end_restore(proc.pid)
                    proc.wait()
                    raise reason from None
            except KeyboardInterrupt:
                if endable:
                    end_restore(proc.pid)
                    proc.wait()
                    raise
                interrupted = True
        if interrupted:
            raise KeyboardInterrupt
        if proc.returncode != 0:
            raise failure(what, log, self.log_dir, out.decode("utf-8", "replace"))


def end_restore(pid: int) -> None:
    """End the running `criu restore` `pid` and every task it has restored so far. CRIU ignores
    SIGTERM, and a task it is restoring outlives a SIGKILL of CRIU (it waits, or loops, in
    CRIU's restorer code: seen with CRIU 4.2); a task killed first makes CRIU kill the others
    and exit. So the tasks go first, then CRIU's process group, whatever is left of it."""
    deadline = time.monotonic() + END_S
    while procs.alive(pid) and time.monotonic() < deadline:
        procs.kill_tree(procs.tree(pid)[1:])
        procs.wait_gone(pid, POLL_S)
    procs.kill_tree(procs.tree(pid)[1:])
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    procs.wait_gone(pid, END_S)


def overflow(what: str, log: Path, limit: int, log_dir: Path) -> PosError:
    """The failure of a CRIU ended because its log passed `limit` bytes: what it repeats."""
    last = (log_tail(log, 1) or ["no log"])[-1]
    kept = keep_log(log, log_dir) or log
    return PosError(f"criu {what} was ended after its log passed {limit >> 20} MiB, repeating "
                    f"\"{_plain(last)}\"", f"the image may be damaged: check it with `pos "
                    f"inspect DIR --verify`; CRIU's log: {kept} (POS_CRIU_LOG_MAX_MB raises the bound)")


def log_bytes(path: Path) -> int:
    """The size of a log CRIU writes (0 before it exists)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _plain(line: str) -> str:
    """A log line without CRIU's time stamp and PID."""
    return re.sub(r"^\([\d.]+\)\s+(\d+: )?", "", line.strip())


def inherited_fds(specs: tuple[str, ...]) -> tuple[int, ...]:
    """The descriptors of pos that --inherit-fd specs (`fd[N]:RES`) name; BadInput for a spec
    of another form or a descriptor pos does not have (CRIU would fail later, less clearly)."""
    fds = []
    for spec in specs:
        m = re.fullmatch(r"fd\[(\d+)\]:(.+)", spec)
        if m is None:
            raise BadInput(f"--inherit-fd {spec!r} is not of the form fd[N]:RESOURCE",
                           "e.g. --inherit-fd 'fd[3]:socket:[12345]'")
        fd = int(m.group(1))
        try:
            os.fstat(fd)
        except OSError:
            raise BadInput(f"--inherit-fd {spec!r} names descriptor {fd}, which pos was not "
                           "given", f"start pos with descriptor {fd} open on the resource") \
                from None
        fds.append(fd)
    return tuple(fds)


def reopen_logs(logs: dict[str, int]) -> dict[int, str]:
    """The image's logs (procs.logs) opened for appending: descriptor -> the --inherit-fd
    spec that hands it to the restored tree instead of the file that CRIU would reopen at its
    old offset (and refuse, once the log has grown). CRIU names a file by its path without the
    leading "/". A log that is gone is left to CRIU, which names it."""
    out = {}
    for path in logs:
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):   # a FIFO there would block the open
                continue
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError:
            continue
        out[fd] = f"fd[{fd}]:{path.lstrip('/')}"
    return out


def _last_lines(log: Path) -> list[str]:
    """The lines of a CRIU log's last MiB (a log that ran away holds gigabytes)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def log_tail(log: Path, lines: int = 6) -> list[str]:
    """The last error lines of a CRIU log (or its last lines when it names no error), from
    its last MiB."""
    text = _last_lines(log)
    errors = [ln for ln in text if "Error" in ln or "error" in ln]
    return (errors or text)[-lines:]


def logged_error(log: Path) -> bool:
    """Whether CRIU logged an error in the last MiB of `log`: a line of its pr_err, which
    starts "Error (FILE:LINE): " (its debug lines may name errors it recovered from)."""
    return any("Error (" in ln for ln in _last_lines(log))


def keep_log(log: Path, log_dir: Path) -> Optional[Path]:
    """A copy of CRIU's log in `log_dir` that outlives the failed image or work folder it was
    written in (both are removed by the undo), root-only, at most its first and last
    KEEP_BYTES / 2; None when there is none to keep."""
    try:
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        kept = log_dir / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{log.name}"
        fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out, open(log, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(0)
            if size <= KEEP_BYTES:
                out.write(f.read())
            else:
                out.write(f.read(KEEP_BYTES // 2))
                out.write(f"\n[pos: {size - KEEP_BYTES} bytes of CRIU's log left out]\n"
                          .encode())
                f.seek(size - KEEP_BYTES // 2)
                out.write(f.read())
        return kept
    except OSError:
        return None


def known(what: str, said: str, log: Path) -> Optional[BadInput]:
    """The failure of `criu what` in one sentence, when what CRIU said (`said`) is of a
    KNOWN_FAILURES class; `log`: where its log is kept."""
    for entry in KNOWN_FAILURES:
        m = re.search(entry.pattern, said)
        if m and entry.action in ("", what):
            groups = m.groups()
            return BadInput(f"criu {what} failed: {entry.cause.format(*groups)}",
                            f"{entry.fix.format(*groups)} (CRIU's log: {log})")
    return None


def failure(what: str, log: Path, log_dir: Path, output: str = "") -> PosError:
    """One PosError for a failed CRIU run: a known cause with its fix, else CRIU's last error
    before its closing lines (never "Restoring FAILED" alone); its log kept in `log_dir`."""
    errors = log_tail(log) or output.strip().splitlines()[-6:]
    log = keep_log(log, log_dir) or log
    found = known(what, "\n".join(errors), log)
    if found is not None:
        return found
    causes = [ln for ln in errors if not SUMMARY.search(ln)] or errors or ["no log"]
    cause = _plain(causes[-1])
    return PosError(f"criu {what} failed: {cause}", f"see CRIU's log {log}")


def _version_of(path: str) -> Optional[tuple[tuple[int, ...], str]]:
    try:
        p = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", p.stdout)
    if p.returncode != 0 or not m:
        return None
    return tuple(int(x) for x in m.groups() if x is not None), m.group(0).split(":")[1].strip()


@lru_cache(maxsize=None)
def _find(env_value: str, path_copy: str) -> Criu:
    if env_value:
        found = _version_of(env_value)
        if found is None:
            raise BadInput(f"POS_CRIU={env_value} does not run as CRIU ({env_value} --version "
                           "failed)", FIX_INSTALL)
        if found[0] < MIN_VERSION:
            raise BadInput(f"POS_CRIU={env_value} is CRIU {found[1]}, pos needs >= 4.0",
                           FIX_INSTALL)
        return Criu(env_value, *found)
    seen = []
    for candidate in (path_copy, SETUP_COPY):
        if not candidate or not os.access(candidate, os.X_OK):
            continue
        found = _version_of(candidate)
        if found is None:
            continue
        if found[0] >= MIN_VERSION:
            return Criu(candidate, *found)
        seen.append(f"{candidate} is {found[1]}")
    if seen:
        raise BadInput(f"no CRIU >= 4.0 found ({'; '.join(seen)}; older CRIU fails on recent "
                       "kernels)", FIX_INSTALL)
    raise BadInput("CRIU is not installed (pos needs CRIU >= 4.0 for process images)",
                   FIX_INSTALL)


def find(settings: Optional[Settings] = None) -> Criu:
    """The CRIU to use (see the module docstring), with where its logs go; BadInput naming the
    fix when none fits."""
    s = settings or Settings.from_env()
    return replace(_find(s.criu, shutil.which("criu") or ""), log_dir=s.log_dir,
                   log_max=s.criu_log_max_bytes)

