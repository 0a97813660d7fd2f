"""The Docker base image, built locally (no registry is reachable): a Debian minbase with
Python, venv and git made by debootstrap and imported with `docker import`. Built once per
engine; later calls find it by name.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from sandboxes.base import SandboxError

logger = logging.getLogger(__name__)

BASE_IMAGE = os.environ.get("SWERVE_BASE_IMAGE", "swerve-base:bookworm")
BASE_PACKAGES = "python3,python3-venv,python3-pip,git,ca-certificates,procps"


def debian_mirror() -> str:
    """$SWERVE_DEBIAN_MIRROR, else the first Debian mirror apt on this host uses."""
    if mirror := os.environ.get("SWERVE_DEBIAN_MIRROR"):
        return mirror
    sources = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    for source in sources:
        if not source.is_file():
            continue
        for match in re.finditer(r"(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(\S+/debian)\b", source.read_text()):
            return match.group(1)
    return "http://deb.debian.org/debian"


def ensure_base_image(client, name: str = BASE_IMAGE) -> str:
    """Return the base image's id, building it with debootstrap if the engine lacks it."""
    import docker.errors

    try:
        return client.images.get(name).id
    except docker.errors.ImageNotFound:
        pass
    if shutil.which("debootstrap") is None:
        raise SandboxError(f"image {name} is missing and debootstrap is not installed to build it "
                           "(apt-get install debootstrap), or set SWERVE_BASE_IMAGE")
    with tempfile.TemporaryDirectory(prefix="swerve-rootfs-") as tmp:
        root = Path(tmp) / "root"
        cmd = ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm",
               str(root), debian_mirror()]
        logger.info("building base image %s with debootstrap", name)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SandboxError(f"debootstrap failed building {name}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        subprocess.run(["useradd", "--root", str(root), "--uid", "1000", "--create-home", "sandbox"],
                       check=True, capture_output=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["docker", "import", "-", name], stdin=tar.stdout,
                                  capture_output=True, text=True)
        tar.wait()
        if imported.returncode != 0:
            raise SandboxError(f"docker import of {name} failed: {imported.stderr[-2000:]}")
    return client.images.get(name).id


if __name__ == "__main__":
    import docker

    logging.basicConfig(level=logging.INFO)
    print(ensure_base_image(docker.from_env()))
