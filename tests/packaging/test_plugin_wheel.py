"""Installing the simulated-ASIC plugin wheel into a fresh virtual environment makes it appear.

The fresh venv gets torchhal's and the plugin's *built wheels*; their third-party dependencies
(torch, pydantic, ...) are borrowed from the test environment through a directory of symlinks
that leaves out every torchhal distribution, so only the wheels installed here can be found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run(*cmd: str | Path, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def build_wheel(project: Path, dist: Path) -> Path:
    run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, project)
    name = project.name if project != ROOT else ""
    wheels = sorted(dist.glob(f"torchhal{'_' + name if name else ''}-*.whl"))
    assert wheels, f"no wheel built for {project}"
    return wheels[-1]


def borrowed_dependencies(tmp: Path) -> Path:
    """Symlinks to everything in this environment's site-packages except torchhal's own dists."""
    site = Path(sysconfig.get_paths()["purelib"])
    deps = tmp / "deps"
    deps.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("torchhal", "_torchhal", "__editable__")) or name.endswith(".pth"):
            continue
        (deps / entry.name).symlink_to(entry)
    return deps


def test_simasic_wheel_appears_in_info_after_install(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    core = build_wheel(ROOT, dist)
    plugin = build_wheel(ROOT / "plugins" / "simasic", dist)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # the outer pip installs into it
    py = env_dir / "bin" / "python"
    env_site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (env_site / "borrowed.pth").write_text(str(borrowed_dependencies(tmp_path)) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHHAL_")}
    env["TORCHHAL_CACHE_DIR"] = str(tmp_path / "cache")
    pip = (sys.executable, "-m", "pip", "--python", py, "install", "--quiet", "--no-deps", "--no-index")
    info = (env_dir / "bin" / "torchhal", "info", "--json")

    run(*pip, core, env=env)
    before = json.loads(run(*info, cwd=tmp_path, env=env))
    assert [d["id"] for d in before["devices"]] == ["cpu"]

    run(*pip, plugin, env=env)
    after = json.loads(run(*info, cwd=tmp_path, env=env))
    assert [d["id"] for d in after["devices"]] == ["simasic:0", "cpu"]
    where = run(py, "-c", "import torchhal_simasic; print(torchhal_simasic.__file__)", cwd=tmp_path, env=env)
    assert where.startswith(str(env_dir)), f"plugin imported from outside the fresh venv: {where}"
