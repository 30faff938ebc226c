"""Engine version detection from the installed package's METADATA, without importing the
engine: the interpreter of the configured executable (a Python, or a script's `#!` line)
and its site-packages, as pip lays them out in a virtual environment."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from gearshift.agents.engine_version import metadata_version


def _venv(root: Path, dist: str, version: str) -> Path:
    """A venv-shaped prefix holding `dist` `version`'s dist-info; returns its bin/."""
    site = root / "lib" / "python3.12" / "site-packages"
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    # A second, unrelated package must not be picked.
    other = site / "vllm_extras-9.9.9.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Name: vllm-extras\nVersion: 9.9.9\n")
    bindir = root / "bin"
    bindir.mkdir()
    python = bindir / "python3"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return bindir


def _script(bindir: Path, name: str, shebang: str) -> Path:
    path = bindir / name
    path.write_text(f"{shebang}\nimport sys\nsys.exit('must not run')\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_console_script_version_from_its_interpreters_site_packages(tmp_path: Path):
    bindir = _venv(tmp_path / "venv", "tensorrt_llm", "1.1.0")
    script = _script(bindir, "trtllm-serve", f"#!{bindir / 'python3'}")
    assert metadata_version("tensorrt_llm", [str(script)]) == "1.1.0"
    # Found on PATH by name, as the agent's default executable is.
    env = {"PATH": f"{bindir}{os.pathsep}/usr/bin"}
    assert metadata_version("tensorrt_llm", ["trtllm-serve"], env) == "1.1.0"


def test_python_executable_and_env_shebang(tmp_path: Path):
    bindir = _venv(tmp_path / "venv", "sglang", "0.5.5")
    assert metadata_version("sglang", [str(bindir / "python3"), "-m", "sglang.launch_server"]) \
        == "0.5.5"
    script = _script(bindir, "tool", "#!/usr/bin/env python3")
    env = {"PATH": f"{bindir}{os.pathsep}/usr/bin"}
    assert metadata_version("sglang", [str(script)], env) == "0.5.5"


def test_dist_info_names_are_normalized(tmp_path: Path):
    bindir = _venv(tmp_path / "venv", "TensorRT_LLM", "1.2.0rc4")
    assert metadata_version("tensorrt-llm", [str(bindir / "python3")]) == "1.2.0rc4"


def test_nothing_found_is_unknown(tmp_path: Path):
    bindir = _venv(tmp_path / "venv", "sglang", "0.5.5")
    assert metadata_version("vllm", [str(bindir / "python3")]) == ""
    binary = tmp_path / "engine"
    binary.write_bytes(b"\x7fELF\x02\x01")
    binary.chmod(0o755)
    assert metadata_version("vllm", [str(binary)]) == ""
    assert metadata_version("vllm", ["no-such-engine-here"], {"PATH": str(tmp_path)}) == ""
    assert metadata_version("", [str(bindir / "python3")]) == ""
