"""Runs untrusted Python in the sandbox: started by `sandbox.py` as `python -I -S sandbox_runner.py` in a fresh
folder, it reads {code, calls, limits} from stdin, locks itself down, runs the code, evaluates each call and
writes one JSON line per call (the repr of its value, or its error) to its original stdout.

The lockdown, in order, before any untrusted line runs:
1. a network namespace of its own (no interface but a down loopback), when the kernel allows one: as root
   directly, otherwise inside a new user namespace; made with ctypes, then the runner re-executes itself so
   that the code's interpreter has never loaded ctypes;
2. as root: drop to the unprivileged `drop_to_uid` (so the process limit counts, and root's powers are
   gone), after importing the standard-library modules solutions commonly use (PRELOADED);
3. resource limits: CPU seconds, address space, file size, open files, processes, no core dumps;
4. stdout/stderr to /dev/null (prints cannot forge results);
5. an audit hook (PEP 578, which code cannot remove) that refuses: opening or listing files outside the
   sandbox folder (reading the standard library excepted), creating, renaming or deleting them, links,
   sockets, fork/exec/spawn/system/subprocess, signals to other processes, and importing ctypes,
   _posixsubprocess or mmap (ways around the hook).
This file imports only the standard library: `-S` leaves no site-packages on the path.
"""

import json
import os
import resource
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
REFUSED_EVENTS = {
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "os.startfile",
    "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "os.link", "os.symlink",
    "socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.sendto", "socket.sethostname", "os.setuid", "os.setgid", "os.chroot", "resource.setrlimit",
    "resource.prlimit", "sys.remote_exec", "pty.spawn", "os.add_dll_directory",
}  # fmt: skip
PATH_EVENTS = {  # event -> positions of the path arguments
    "os.listdir": (0,), "os.scandir": (0,), "os.chdir": (0,), "os.mkdir": (0,), "os.remove": (0,),
    "os.rmdir": (0,), "os.rename": (0, 1), "os.replace": (0, 1), "os.chmod": (0,), "os.chown": (0,),
    "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (0, 1),
    "shutil.move": (0, 1), "glob.glob": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
}  # fmt: skip
REFUSED_MODULES = {"ctypes", "_ctypes", "_posixsubprocess", "mmap", "_multiprocessing"}
# Imported before the drop to `uid`, which may not be able to read the standard library's folder (under /root)
PRELOADED = ("bisect", "collections", "copy", "dataclasses", "decimal", "fractions", "functools", "heapq",
             "itertools", "math", "operator", "random", "re", "statistics", "string", "typing")  # fmt: skip
DEVICES = {"/dev/null", "/dev/urandom", "/dev/zero"}


def isolate_network() -> str:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for flags in ((CLONE_NEWNET,) if os.geteuid() == 0 else ()) + (CLONE_NEWUSER | CLONE_NEWNET,):
        if libc.unshare(flags) == 0:
            return "namespace"
    return "audit hook"


def set_limits(limits: dict) -> None:
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL a second later
    memory = limits["memory_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = limits["file_size_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.getuid() != 0 and limits["drop_to_uid"] is not None:  # counted per user: only a user of its own
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))


def audit_hook(folder: str, readable: list[str]):
    def inside(path, roots) -> bool:
        if isinstance(path, int):
            return True  # an already open descriptor
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        real = os.path.realpath(os.path.join(folder, path))
        return real in DEVICES or any(real == root or real.startswith(root + os.sep) for root in roots)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (list(args) + [None, None])[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
            if path is not None and not inside(path, [folder] if writes else [folder, *readable]):
                raise PermissionError(f"sandbox: {path} is outside the sandbox folder")
        elif event in REFUSED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event in PATH_EVENTS:
            roots = [folder, *readable] if event in ("os.listdir", "os.scandir", "glob.glob") else [folder]
            for position in PATH_EVENTS[event]:
                if position < len(args) and args[position] is not None and not inside(args[position], roots):
                    raise PermissionError(f"sandbox: {event} on {args[position]} is outside the sandbox folder")
        elif event == "import" and args[0].split(".")[0] in REFUSED_MODULES:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")

    return hook


def main() -> None:
    if sys.argv[1:2] != ["--isolated"]:  # stage 1: the namespace needs ctypes; a fresh interpreter runs the rest
        network = isolate_network()
        os.execv(sys.executable, [sys.executable, "-I", "-S", __file__, "--isolated", network])
    network = sys.argv[2]
    request = json.loads(sys.stdin.read())
    limits, folder = request["limits"], os.path.realpath(os.getcwd())
    for module in PRELOADED:
        __import__(module)
    if os.geteuid() == 0 and limits["drop_to_uid"] is not None:
        os.setgroups([])
        os.setgid(limits["drop_to_uid"])
        os.setuid(limits["drop_to_uid"])
    set_limits(limits)
    results = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    readable = [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]
    results.write(json.dumps({"network": network}) + "\n")
    results.flush()
    sys.addaudithook(audit_hook(folder, readable))
    del request["limits"]

    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        exec(compile(request["code"], "<solution>", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt from the code are its errors too
        results.write(json.dumps({"error": f"{type(e).__name__}: {e}"[:500]}) + "\n")
        results.flush()
        return
    for index, call in enumerate(request["calls"]):
        try:
            line = {"index": index, "repr": repr(eval(call, namespace))[: limits["max_output"]]}
        except BaseException as e:  # noqa: BLE001
            line = {"index": index, "error": f"{type(e).__name__}: {e}"[:500]}
        results.write(json.dumps(line) + "\n")
        results.flush()


if __name__ == "__main__":
    main()
