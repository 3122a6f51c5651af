"""System packages the simulator needs, in one place: ``python3 -m flowlib.sysdeps`` (``make system-deps``).

Stdlib only, so it runs before the virtualenv exists.  ManiSkill3's SAPIEN needs a Vulkan device
even for state observations.  On a machine without a GPU that is Mesa's lavapipe, and SAPIEN
rejects Mesa 22's (Debian bookworm) with "failed to find a rendering device"; Mesa 25 from
bookworm-backports works.  With an NVIDIA driver present nothing is needed.  Meta-World's rendered frames (notebook
01's rollout picture) use MuJoCo's OSMesa backend: Debian's ``libosmesa6``, from the release's own suite.

Run as root on Debian this installs what is missing; otherwise it prints the command to run.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

MESA_MIN_MAJOR = 23
PACKAGES = ["mesa-vulkan-drivers", "libvulkan1"]
OSMESA = "libosmesa6"  # MuJoCo's software renderer (MUJOCO_GL=osmesa): flowlib.envs.metaworld_envs
BACKPORTS_FILE = Path("/etc/apt/sources.list.d/flowlib-backports.sources")


def installed(package: str) -> bool:
    """Whether Debian's ``package`` is installed (False off Debian)."""
    if not shutil.which("dpkg-query"):
        return False
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return out.stdout.startswith("install ok installed")


def ensure_osmesa() -> int:
    """Install ``libosmesa6`` where it is missing on Debian as root; else say what to run."""
    if installed(OSMESA) or not shutil.which("apt-get"):
        return 0
    if os.geteuid() != 0:
        print(f"system-deps: Meta-World's rendered frames need {OSMESA}; run as root: apt-get install -y {OSMESA}")
        return 0
    print(f"system-deps: installing {OSMESA} (Meta-World's frames) ...", flush=True)
    rc = subprocess.run(["sh", "-c", f"( apt-get install -y {OSMESA} || ( apt-get update && apt-get install -y "
                                     f"{OSMESA} ) ) > /tmp/flowlib-osmesa.log 2>&1"],
                        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}).returncode
    if rc:
        print(f"system-deps: {OSMESA} install failed; see /tmp/flowlib-osmesa.log (only Meta-World's frames need it)")
    return 0


def mesa_major() -> int | None:
    """Major version of the installed ``mesa-vulkan-drivers`` (None if absent or not Debian)."""
    if not shutil.which("dpkg-query"):
        return None
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status} ${Version}", "mesa-vulkan-drivers"],
                         capture_output=True, text=True)
    m = re.match(r"install ok installed (?:\d+:)?(\d+)\.", out.stdout)
    return int(m.group(1)) if m else None


def has_nvidia() -> bool:
    return shutil.which("nvidia-smi") is not None


def debian_codename() -> str | None:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return None
    m = re.search(r"^VERSION_CODENAME=(\w+)", text, re.M)
    return m.group(1) if m else None


def debian_mirror() -> str:
    """The URI apt already uses for Debian (so backports come from the same mirror)."""
    for path in [*Path("/etc/apt/sources.list.d").glob("*.sources"), Path("/etc/apt/sources.list")]:
        try:
            text = path.read_text()
        except OSError:
            continue
        m = re.search(r"^URIs:\s*(\S+/debian)/?\s*$", text, re.M) or re.search(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)/?\s", text, re.M)
        if m:
            return m.group(1)
    return "http://deb.debian.org/debian"


def install_script(codename: str) -> str:
    suite = f"{codename}-backports"
    return (
        f"printf 'Types: deb\\nURIs: {debian_mirror()}\\nSuites: {suite}\\nComponents: main\\n"
        f"Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\\n' > {BACKPORTS_FILE} && "
        f"apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y -t {suite} {' '.join(PACKAGES)}"
    )


def vulkan_ready() -> bool:
    major = mesa_major()
    return has_nvidia() or (major is not None and major >= MESA_MIN_MAJOR)


def main() -> int:
    if has_nvidia():
        print("system-deps: NVIDIA driver found; SAPIEN uses its Vulkan device.")
        return 0
    major = mesa_major()
    if major is not None and major >= MESA_MIN_MAJOR:
        print(f"system-deps: Mesa {major} Vulkan (lavapipe) present.")
        return 0
    codename = debian_codename()
    if not shutil.which("apt-get") or codename is None:
        print(f"system-deps: install a Vulkan driver from Mesa >= {MESA_MIN_MAJOR} (lavapipe) with your package "
              "manager; ManiSkill needs it on machines without a GPU. The 2D notebooks run without it.")
        return 0
    script = install_script(codename)
    if os.geteuid() != 0:
        print(f"system-deps: Mesa Vulkan >= {MESA_MIN_MAJOR} is missing (found {major}). Run as root:\n"
              f"  sudo sh -c \"{script}\"")
        return 0
    print(f"system-deps: installing Mesa Vulkan from {codename}-backports (found {major}) ...", flush=True)
    rc = subprocess.run(["sh", "-c", f"( {script} ) > /tmp/flowlib-sysdeps.log 2>&1"]).returncode
    if rc:
        print("system-deps: install failed; see /tmp/flowlib-sysdeps.log")
        return rc
    return _report()


def _report() -> int:
    major = mesa_major()
    print(f"system-deps: Mesa {major} Vulkan installed.")
    return 0 if major and major >= MESA_MIN_MAJOR else 1


if __name__ == "__main__":
    rc = main()
    sys.exit(rc or ensure_osmesa())
