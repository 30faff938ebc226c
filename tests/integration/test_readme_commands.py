"""The README's runnable command blocks, run as a person pastes them, line by line.

Every fenced block preceded by `<!-- runnable: NAME -->` in README.md and docs/*.md is
run in order in a fresh folder that looks like the repository's root (`deploy/` and
`policies/` are there), with this checkout's `gearshift` on PATH:
- a line ending in `&` starts a daemon (stopped, with the engines it started, at the end);
- `export` lines set the environment of the lines after them;
- any other line must succeed (exit 0) within a person's patience (`PATIENCE_S`): it is
  run again, as a person would, while the daemons before it are still starting.
The loopback ports the README names are mapped to free ones, in the commands and in the
example config they use, so the test never takes a port someone else holds. A block that
stops working fails `make test`. The blocks: the quickstart, TLS and tokens, and the
real-hosts walkthrough (TLS, two agents enrolled by bootstrap token and approved, a
gateway with its own certificate, the CLI tour). Cost: about 30 s (13 s each for the
quickstart and the walkthrough, 3 s for TLS)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gearshift.devfleet.local_fleet import kill_strays
from gearshift.devfleet.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- runnable: ([a-z0-9-]+) -->\s*\n```[a-z]*\n(.*?)\n```", re.S)
PORTS = (50051, 9400, 9401, 9402, 8000)  # the loopback ports the README's blocks name
PATIENCE_S = 60.0
SHARED = ("policies",)  # read as they are; deploy/ is copied (its config gets the ports)


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(file, name, text) of every runnable block, in document order."""
    return [(doc.name, m.group(1), m.group(2)) for doc in DOCS
            for m in MARK.finditer(doc.read_text())]


def commands(text: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines out."""
    joined = text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        code = _strip_comment(line).strip()
        if code:
            out.append(code)
    return out


def _strip_comment(line: str) -> str:
    """`line` without a trailing `# comment` (a # inside quotes stays)."""
    quote = ""
    for i, c in enumerate(line):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def test_the_readme_has_runnable_blocks() -> None:
    names = [name for _doc, name, _text in runnable_blocks()]
    assert {"quickstart", "tls", "real-hosts"} <= set(names), names


@pytest.mark.parametrize("doc,name,text", runnable_blocks(), ids=lambda v: str(v)[:24])
def test_a_runnable_block_works_as_pasted(doc: str, name: str, text: str,
                                          tmp_path: Path) -> None:
    ports = {p: free_port() for p in PORTS}

    def mapped(s: str) -> str:
        for old, new in ports.items():
            s = re.sub(rf"(?<=[:\s]){old}\b", str(new), s)
        return s

    root = tmp_path / "checkout"
    shutil.copytree(REPO / "deploy", root / "deploy",
                    ignore=shutil.ignore_patterns("secrets"))
    for conf in (root / "deploy" / "examples").glob("*.yaml"):
        conf.write_text(mapped(conf.read_text()))
    for name_ in SHARED:
        (root / name_).symlink_to(REPO / name_)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")},
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1"}
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        for i, cmd in enumerate(commands(mapped(text))):
            if cmd.startswith("export "):
                env.update(_exported(cmd, env, root))
            elif cmd.endswith("&"):
                log = (tmp_path / f"daemon-{i}.log").open("ab")
                daemons.append(subprocess.Popen(["bash", "-c", cmd.rstrip("&").strip()],
                                                cwd=root, env=env, stdout=log,
                                                stderr=subprocess.STDOUT,
                                                start_new_session=True))
                log.close()
            else:
                _succeeds(cmd, root, env, daemons, tmp_path)
    finally:
        for proc in daemons:
            with _quietly():
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in daemons:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with _quietly():
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        kill_strays(root)  # engines outlive their agent on purpose


def _exported(cmd: str, env: dict[str, str], cwd: Path) -> dict[str, str]:
    """The variables an `export` line sets, as bash sets them."""
    out = subprocess.run(["bash", "-c", f"{cmd} && env -0"], cwd=cwd, env=env,
                         capture_output=True, check=True, timeout=30).stdout.decode()
    names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", cmd.removeprefix("export "))
    values = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    return {n: values[n] for n in names}


def _succeeds(cmd: str, cwd: Path, env: dict[str, str],
              daemons: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while True:
        proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=PATIENCE_S)
        if proc.returncode == 0:
            return
        dead = [p for p in daemons if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}"
                             for p in sorted(tmp_path.glob("daemon-*.log")))
            raise AssertionError(f"`{shlex.quote(cmd)}` failed ({proc.returncode}):\n"
                                 f"{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}\n"
                                 f"daemons exited: {[p.args for p in dead]}\n{logs}")
        time.sleep(1.0)


class _quietly:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)  # type: ignore[arg-type]
