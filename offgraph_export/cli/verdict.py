"""The verdict of ``check`` and ``run`` comes from a process that runs no user code (issue 25).

``check --model FILE.py:build`` imports the user's model file; code there that calls
``os._exit(0)`` (or ``sys.exit(0)`` where nothing catches it) would end the command with status 0
and no report, and a CI gate would pass what was never checked. So the command does its work in
a child interpreter (the same command line, ``python -m offgraph_export ...``) and the parent,
which imports nothing of the user's, gives the exit status:

* the parent makes a pipe and a random token and hands the child both through one environment
  variable (:data:`ENV`), which the child removes from its environment before any user code runs
  (and the pipe's end is made non-inheritable, so no grandchild gets it either);
* the child runs today's code path; when its command is done, output flushed, its very last act
  is one JSON record on the pipe: ``{"token", "command", "complete", "passed", "exit_code"}``,
  where ``complete`` is true only when the command itself said so (:func:`completed`) after
  printing its whole report; an error the CLI reports (``error: ...``, status 2) gives a record
  with ``complete`` false and that status;
* the child's stdout and stderr are the parent's own file descriptors (or, where the parent's
  streams have none, as under ``click.testing.CliRunner``, are copied into them), so the output
  is what it was;
* the parent exits 0 only for a record with the token, ``complete`` true and an exit code equal to
  the child's status 0; a child that ended without a record, with one that disagrees with its
  status, or by a signal, gives one line ``error: COMMAND did not complete: ...`` and status 1.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path

__all__ = ["ENV", "begin", "completed", "finish", "in_child", "run_in_child"]

#: ``FD:TOKEN``: set by the parent for the child only.
ENV = "OFFGRAPH_EXPORT_VERDICT_CHANNEL"

_MAX_RECORD = 4096


class _Child:
    def __init__(self, fd: int, token: str) -> None:
        self.fd = fd
        self.token = token
        self.done: tuple[int, bool] | None = None  # (exit code, passed) once the command completed


_child: _Child | None = None
_argv: list[str] = []


def begin(argv: list[str]) -> None:
    """Called first by the CLI's ``main``: remember the command line, and, in a child, take the
    channel out of the environment before any user code can see it."""
    global _child, _argv
    _argv = list(argv)
    value = os.environ.pop(ENV, None)
    if value is None or _child is not None:
        return
    fd_text, sep, token = value.partition(":")
    if not sep or not fd_text.isdigit() or len(token) < 32:
        return
    fd = int(fd_text)
    try:
        os.set_inheritable(fd, False)  # no process the user's code starts gets the channel
    except OSError:
        return
    _child = _Child(fd, token)


def in_child() -> bool:
    return _child is not None


def completed(exit_code: int, passed: bool = True) -> None:
    """The command's own word, after its whole report is printed: it completed, with this status."""
    if _child is not None:
        _child.done = (int(exit_code), bool(passed))


def finish(exit_code: int) -> None:
    """The child's last act before it exits with ``exit_code``: the record for the parent."""
    global _child
    child, _child = _child, None
    if child is None:
        return
    try:  # the report is out before the record says so
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        complete = False
    else:
        complete = child.done is not None and child.done[0] == exit_code
    record = {
        "token": child.token,
        "complete": complete,
        "passed": bool(child.done[1]) if complete and child.done is not None else False,
        "exit_code": int(exit_code),
    }
    try:
        os.write(child.fd, (json.dumps(record) + "\n").encode())
        os.close(child.fd)
    except OSError:
        pass


# -- the parent ---------------------------------------------------------------------------------


def _stream_fd(stream) -> int | None:
    """The file descriptor behind ``stream``, flushed; None where it has none (a test runner's
    in-memory stream)."""
    try:
        stream.flush()
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _pump(source, target) -> None:
    """Copy a child's output pipe into ``target`` as it comes."""
    out = getattr(target, "buffer", None)
    try:
        while chunk := os.read(source.fileno(), 65536):
            if out is not None:
                out.write(chunk)
            else:
                target.write(chunk.decode(getattr(target, "encoding", None) or "utf-8", errors="replace"))
            target.flush()
    except (OSError, ValueError):
        pass
    finally:
        source.close()


def _child_env(token: str, fd: int) -> dict[str, str]:
    env = dict(os.environ)
    env[ENV] = f"{fd}:{token}"
    # the child imports this package as the parent did (the parent may have found it through its
    # working directory or a path its caller set); appended, so it changes no other import
    import offgraph_export

    root = str(Path(offgraph_export.__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, root])
    return env


def _interpreter_flags() -> list[str]:
    flags = getattr(subprocess, "_args_from_interpreter_flags", None)
    try:
        return list(flags()) if flags else []
    except Exception:
        return []


def _read_record(fd: int) -> str:
    """What the child wrote, read without blocking: its record is written before it exits, and a
    process the user's code forked may still hold the pipe open."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) <= _MAX_RECORD:
            chunk = os.read(fd, _MAX_RECORD + 1)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace")


def _parse(text: str, token: str) -> dict | None:
    """The record, or None when there is none that carries the token."""
    lines = text.splitlines()
    if len(lines) != 1:
        return None
    try:
        record = json.loads(lines[0])
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("token"), str):
        return None
    if not hmac.compare_digest(record["token"].encode(), token.encode()):
        return None
    if type(record.get("exit_code")) is not int or type(record.get("complete")) is not bool:
        return None
    return record


def _signal_name(number: int) -> str:
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def verdict(command: str, status: int, record: dict | None) -> tuple[int, str | None]:
    """The exit status the parent gives, and the line it says (None: the child said everything)."""
    head = f"error: {command} did not complete: "
    hint = " (the model's code may have called os._exit or sys.exit)"
    if status < 0:
        return 1, f"{head}the process was killed by {_signal_name(-status)} before its report"
    if record is None:
        return 1, f"{head}the process ended with status {status} before its report{hint}"
    code = record["exit_code"]
    if code != status:
        return (code or 1), (f"{head}the process ended with status {status}, but its report with status {code}"
                             " (code that ran after the report may have called os._exit)")
    if status == 0 and not record["complete"]:
        return 1, f"{head}the process ended with status 0 before its report{hint}"
    if command == "check" and record["complete"] and record.get("passed") is not (status == 0):
        return 1, f"{head}its record says passed={record.get('passed')!r} with status {status}"
    return status, None  # status 0: the report is complete; otherwise the child said why


def run_in_child(command: str) -> int:
    """Run this command line again in a child interpreter; its output is this process's; the exit
    status it earns (see the module's docstring)."""
    if not sys.executable:
        from offgraph_export.errors import OffgraphError

        raise OffgraphError(f"{command} runs in a child interpreter, and this Python names no executable (sys.executable)")
    token = secrets.token_hex(32)
    read_fd, write_fd = os.pipe()
    try:
        os.set_inheritable(read_fd, False)
        out_fd, err_fd = _stream_fd(sys.stdout), _stream_fd(sys.stderr)
        proc = subprocess.Popen(
            [sys.executable, *_interpreter_flags(), "-m", "offgraph_export", *_argv],
            env=_child_env(token, write_fd), pass_fds=(write_fd,),
            stdout=out_fd if out_fd is not None else subprocess.PIPE,
            stderr=err_fd if err_fd is not None else subprocess.PIPE,
        )
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    os.close(write_fd)
    pumps = [threading.Thread(target=_pump, args=(pipe, target), daemon=True)
             for pipe, target in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)) if pipe is not None]
    for pump in pumps:
        pump.start()
    status = _wait(proc)
    for pump in pumps:
        pump.join()
    code, line = verdict(command, status, _parse(_read_record(read_fd), token))
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    return code


def _wait(proc: subprocess.Popen) -> int:
    """The child's status. A Ctrl-C reaches the child from the terminal (its process group): the
    parent waits for the child's own answer to it; a SIGTERM or SIGHUP sent to the parent alone
    is passed on."""
    forwarded = (signal.SIGTERM, signal.SIGHUP)
    previous: dict[int, object] = {}
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for number in forwarded:
            previous[number] = signal.signal(number, lambda n, _frame: proc.send_signal(n))
    try:
        return proc.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
